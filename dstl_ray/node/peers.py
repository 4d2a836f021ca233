"""This node's place in the tree and its peers (docs/architecture.md "Tree"): the other node
actors, found by name in the tree's Ray namespace, and lanes to those on this machine.

``topology`` (placement, discovery) builds on these names; this package never imports it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..transport.lane import Lane, open_lane

log = logging.getLogger(__name__)

LANE_OPEN_TIMEOUT_S = 10.0
LANE_RETRY_S = 30.0  # a peer that offered no lane (or could not be reached) is asked again
# how long a child listens for an answer it stopped waiting for (routing), and how long a
# dropped lane's calls in flight may still be answered
LATE_ANSWER_WAIT_S = 600.0

NODE_PREFIX = "dstl-node-"  # node actors' names: this prefix and the Ray node id's head


def list_node_actors(namespace: str) -> list[str]:
    """The names of every node actor of the tree in ``namespace``, sorted."""
    import ray  # lazy: importing dstl_ray must not start loading Ray

    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in names
                  if a.get("namespace") == namespace and a["name"].startswith(NODE_PREFIX))


@dataclass
class Place:
    """Where this node sits; ``set_parent`` moves it (tree changes)."""

    name: str
    parent: str | None = None
    level: int = 0
    index: int = 0
    height: int = 0


class Peers:
    """Actor handles of other nodes by name, looked up once and kept until a call fails; and
    lanes to those on this machine (dstl_ray.transport.lane), opened in the background on
    first use so no call ever waits for one: until it is open, calls go by Ray. Calls go
    out on a lane from its sender thread (``Lane.submit``), never blocking this loop."""

    def __init__(self, namespace: str, lanes: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.namespace = namespace
        self.handles: dict[str, Any] = {}
        self.use_lanes = lanes
        self.clock = clock
        self.lanes: dict[str, Lane] = {}
        self._no_lane_until: dict[str, float] = {}  # no lane to it: try again after this
        self._opening: dict[str, asyncio.Task] = {}

    def actor(self, name: str) -> Any:
        h = self.handles.get(name)
        if h is None:
            import ray  # lazy: unit tests build nodes without Ray

            h = ray.get_actor(name, namespace=self.namespace)
            self.handles[name] = h
        return h

    def lane(self, name: str) -> Lane | None:
        """The open lane to ``name``, or None (then use Ray; this starts opening one, on this
        actor's loop, unless one is opening or ``name`` had none a moment ago)."""
        if not self.use_lanes:
            return None
        ln = self.lanes.get(name)
        if ln is not None:
            if ln.closed is None:
                return ln
            del self.lanes[name]  # broke (its peer restarted?): open a new one
        if name not in self._opening and self.clock() >= self._no_lane_until.get(name, 0.0):
            task = asyncio.get_running_loop().create_task(self._open(name))
            self._opening[name] = task
            task.add_done_callback(
                lambda t: self._opening.pop(name) if self._opening.get(name) is t else None)
        return None

    def send(self, name: str, method: str, *args: Any
             ) -> tuple[concurrent.futures.Future[Any], bool]:
        """``method`` at peer ``name``: over its lane if one is open (queued for the lane's
        sender thread: this loop never blocks on the socket), else, or if the lane refused it
        before anything went out, as a Ray call. Returns the answer's future and whether it
        went by lane."""
        lane = self.lane(name)
        if lane is not None:
            try:
                return lane.submit(method, *args), True
            except Exception as e:  # noqa: BLE001 - nothing went out on it: by Ray
                log.debug("lane to %s refused %s: %s", name, method, e)
        return getattr(self.actor(name), method).remote(*args).future(), False

    async def _open(self, name: str) -> None:
        try:
            info = await asyncio.wait_for(self.actor(name).lane.remote(), LANE_OPEN_TIMEOUT_S)
            ln = await asyncio.to_thread(open_lane, info, name) if info else None
        except Exception as e:  # noqa: BLE001 - Ray calls still work
            log.info("no lane to %s: %s: %s", name, type(e).__name__, e)
            ln = None
        if ln is None:
            self._no_lane_until[name] = self.clock() + LANE_RETRY_S
        elif self._opening.get(name) is not asyncio.current_task():
            _retire(ln)  # dropped while it opened
        else:
            self.lanes[name] = ln

    def drop(self, name: str | None) -> None:
        """Forget ``name``'s handle and lane (a call to it failed): looked up again next
        time. As with a Ray handle, the calls in flight on the lane go on: it is closed once
        they are answered (or after LATE_ANSWER_WAIT_S), so late answers still arrive."""
        if name is None:
            return
        self.handles.pop(name, None)
        self._no_lane_until.pop(name, None)
        self._opening.pop(name, None)  # an open under way retires what it opens
        ln = self.lanes.pop(name, None)
        if ln is not None:
            _retire(ln)

    def close(self) -> None:
        for name in list(self.lanes) + list(self._opening):
            self.drop(name)


def _retire(ln: Lane) -> None:
    """Close ``ln`` once its calls in flight are answered, on a thread of its own."""
    threading.Thread(target=ln.close, kwargs={"drain_s": LATE_ANSWER_WAIT_S}, daemon=True,
                     name="dstl-lane-retire").start()
