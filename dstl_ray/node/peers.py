"""This node's place in the tree and its peers (docs/architecture.md "Tree"): the other node
actors, found by name in the tree's Ray namespace, and lanes to those on this machine.

``topology`` (placement, discovery) builds on these names; this package never imports it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any

from ..transport.lane import Lane, open_lane

log = logging.getLogger(__name__)

LANE_OPEN_TIMEOUT_S = 10.0

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
    first use so no call ever waits for one: until it is open, calls go by Ray."""

    def __init__(self, namespace: str, lanes: bool = True) -> None:
        self.namespace = namespace
        self.handles: dict[str, Any] = {}
        self.use_lanes = lanes
        self.lanes: dict[str, Lane | None] = {}  # None: that peer has no lane for us
        self._opening: dict[str, asyncio.Task] = {}

    def actor(self, name: str) -> Any:
        h = self.handles.get(name)
        if h is None:
            import ray  # lazy: unit tests build nodes without Ray

            h = ray.get_actor(name, namespace=self.namespace)
            self.handles[name] = h
        return h

    def lane(self, name: str) -> Lane | None:
        """The open lane to ``name``, or None (then use Ray; a first call starts opening
        one, on this actor's loop)."""
        if not self.use_lanes:
            return None
        ln = self.lanes.get(name)
        if ln is not None and ln.closed is None:
            return ln
        if name not in self.lanes and name not in self._opening:
            task = asyncio.get_running_loop().create_task(self._open(name))
            self._opening[name] = task
            task.add_done_callback(lambda _t: self._opening.pop(name, None))
        return None

    async def _open(self, name: str) -> None:
        try:
            info = await asyncio.wait_for(self.actor(name).lane.remote(), LANE_OPEN_TIMEOUT_S)
            ln = await asyncio.to_thread(open_lane, info, name) if info else None
        except Exception as e:  # noqa: BLE001 - Ray calls still work; try again after a drop
            log.info("no lane to %s: %s: %s", name, type(e).__name__, e)
            ln = None
        self.lanes[name] = ln

    def drop(self, name: str | None) -> None:
        """Forget ``name``'s handle and lane (a call to it failed): looked up again next
        time."""
        if name is None:
            return
        self.handles.pop(name, None)
        ln = self.lanes.pop(name, None)
        if ln is not None:  # as with a Ray handle, the calls in flight on it go on; closed
            # once they are answered (close waits for them: not on this loop)
            threading.Thread(target=ln.close, daemon=True, name="dstl-lane-close").start()

    def close(self) -> None:
        for name in list(self.lanes):
            self.drop(name)
