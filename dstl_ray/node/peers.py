"""This node's place in the tree and its peers (docs/architecture.md "Tree"): the other node
actors, found by name in the tree's Ray namespace, and lanes to those on this machine.

A lane is tied to the process it was opened to (its pid, from the peer's ``lane()``), while
releases, registrations and a new lane go to whatever process the peer's NAME means now. So
each lane, open or retiring, is checked against Ray's actor table
(:mod:`dstl_ray.transport.lane_watch`, on a thread of its own): once Ray has restarted that
actor elsewhere or holds it dead (its Ray node declared dead while the old process still
runs: a zombie), the lane is cut at once. Its calls in flight fail (the child flushes itself,
as for a dead parent), and the old process, finding their answers undeliverable, releases
what it wrote for them (:mod:`.lane_server`). A peer that is only stalled stays ALIVE in Ray:
its lane stays, and costs lateness only. An answer whose caller stopped waiting (its
future cancelled) goes to ``late``, the router's release of late answers.

Node actors' names and how to list them live in :mod:`dstl_ray.transport.discovery`;
``topology`` (placement) builds on this package, which never imports it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..transport.lane import Lane, Sent, open_lane
from ..transport.lane_watch import ActorState, LaneWatch, gone

log = logging.getLogger(__name__)

LANE_OPEN_TIMEOUT_S = 10.0
LANE_RETRY_S = 30.0  # a peer that offered no lane (or could not be reached) is asked again
# how long a child listens for an answer it stopped waiting for (routing), and how long a
# dropped lane's calls in flight may still be answered
LATE_ANSWER_WAIT_S = 600.0

# releases the segments of an answer nobody waits for (the router's release_late)
LateRelease = Callable[[list[Sent], list[Any]], Awaitable[None]]


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
                 clock: Callable[[], float] = time.monotonic,
                 actor_state: ActorState | None = None, tcp: bool = False) -> None:
        self.namespace = namespace
        self.handles: dict[str, Any] = {}
        self.use_lanes = lanes
        self.use_tcp = tcp  # host lanes to peers on other hosts
        self.clock = clock
        self.lanes: dict[str, Lane] = {}
        self.retiring: dict[Lane, str] = {}  # dropped lanes still delivering answers
        self.cut = 0  # lanes cut because their peer's actor was restarted or dead
        self.late: LateRelease | None = None  # set by the router
        self._no_lane_until: dict[str, float] = {}  # no lane to it: try again after this
        self._opening: dict[str, asyncio.Task] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch = LaneWatch(self._on_cut, actor_state, name="dstl-peer-lane-watch")

    @property
    def actor_state(self) -> ActorState:
        """Ray's actor table, as the lanes' watch reads it (tests give their own)."""
        return self._watch.actor_state

    @actor_state.setter
    def actor_state(self, lookup: ActorState) -> None:
        self._watch.actor_state = lookup

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

    def send(self, name: str, method: str, *args: Any, timeout_s: float | None = None
             ) -> tuple[concurrent.futures.Future[Any], bool]:
        """``method`` at peer ``name``: over its lane if one is open (queued for the lane's
        sender thread: this loop never blocks on the socket), else, or if the lane refused it
        before anything went out, as a Ray call. Returns the answer's future and whether it
        went by lane. ``timeout_s``: the caller's deadline; a lane drops the call's frame if
        it could not begin sending it by then (a stalled peer), and otherwise never gives up
        on its own: the caller's deadline is the only one."""
        lane = self.lane(name)
        if lane is not None:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            try:
                return lane.submit(method, *args, deadline=deadline), True
            except Exception as e:  # noqa: BLE001 - nothing went out on it: by Ray
                log.debug("lane to %s refused %s: %s", name, method, e)
        return getattr(self.actor(name), method).remote(*args).future(), False

    async def _open(self, name: str) -> None:
        handle = None
        self._loop = asyncio.get_running_loop()
        try:
            handle = self.actor(name)
            info = await asyncio.wait_for(handle.lane.remote(), LANE_OPEN_TIMEOUT_S)
            ln = None
            if info:
                ln = await asyncio.to_thread(open_lane, info, name, self._late_answer,
                                             self.use_tcp)
        except Exception as e:  # noqa: BLE001 - Ray calls still work
            log.info("no lane to %s: %s: %s", name, type(e).__name__, e)
            ln = None
        if ln is None:
            self._no_lane_until[name] = self.clock() + LANE_RETRY_S
            return
        self._watch.add(ln, handle, name)  # the actor (by id, not name) it was opened to
        if self._opening.get(name) is not asyncio.current_task():
            self._retire(ln, name)  # dropped while it opened
        else:
            self.lanes[name] = ln

    def _late_answer(self, method: str, sent: tuple[Sent, ...], results: list[Any]) -> None:
        """(a lane's reader thread) An answer whose caller stopped waiting: released, unused,
        on this actor's loop."""
        loop, late = self._loop, self.late
        if loop is None or late is None:
            return
        log.info("late %s answer over the lane: releasing its segments", method)
        asyncio.run_coroutine_threadsafe(late(list(sent), results), loop)

    def alive(self, name: str) -> bool:
        """Whether ``name`` has an open lane whose process Ray still holds for its actor (as
        far as the last check knows): a call on it that timed out met a stalled peer, not a
        gone one, and the lane stays."""
        ln = self.lanes.get(name)
        return ln is not None and ln.closed is None and gone(
            self._watch.last(ln), ln.peer_pid) is None

    def _on_cut(self, ln: Lane, name: str, why: str) -> None:
        """(the watch's thread, the lane cut already) Forget it on this actor's loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._forget_cut, name, ln)

    def _forget_cut(self, name: str, ln: Lane) -> None:
        """The lane's process is no longer the actor ``name`` means: nothing more goes to
        that process, and what it did for the calls in flight is released there, not named
        here; the handle is looked up again (it may be a new actor)."""
        self.cut += 1
        if self.lanes.get(name) is ln:
            del self.lanes[name]
            self.handles.pop(name, None)
        self.retiring.pop(ln, None)

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
            self._retire(ln, name)

    def _retire(self, ln: Lane, name: str) -> None:
        """Close ``ln`` once its calls in flight are answered, on a thread of its own; it is
        still checked (and cut) meanwhile."""
        self.retiring[ln] = name

        def close() -> None:
            ln.close(drain_s=LATE_ANSWER_WAIT_S)
            self.retiring.pop(ln, None)

        threading.Thread(target=close, daemon=True, name="dstl-lane-retire").start()

    def close(self) -> None:
        for name in list(self.lanes) + list(self._opening):
            self.drop(name)
