"""A writer process's lane to its node actor (docs/architecture.md "Write path" 2): opened to
the node the transport found, kept while it leads to the process that actor is, replaced when
the actor is another process, and watched like a node's lanes to its peers
(:mod:`.lane_watch`).

Finding the node again (a call failed, a registration timed out against a node that is only
stalled) never costs the calls in flight: a lane that still leads to the same process is
kept, and one that does not is retired, not cut: it stops taking calls and keeps delivering
answers until the latest deadline of its calls in flight, as a Ray call would be late, not
failed. Only a lane whose process Ray no longer holds for the actor is cut at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .lane import Lane, LateHook, machine_id, open_lane
from .lane_watch import ActorState, LaneWatch

log = logging.getLogger(__name__)

# the node's ``lane()`` answer (None: it offers none); raises if the node did not answer
AskLane = Callable[[], "dict[str, Any] | None"]


def leads_to(lane: Lane, info: dict[str, Any] | None) -> bool:
    """Whether ``lane`` is open and leads to the process whose ``lane()`` answer is ``info``."""
    return (lane.closed is None and info is not None and info.get("path") == lane.path
            and info.get("machine") == machine_id() and info.get("pid") == lane.peer_pid)


class WriterLane:
    """The lane a writer transport sends its persist calls and marks on (None: Ray calls).
    ``late``: where an answer goes whose caller stopped waiting; ``cut``: called (on the
    watch's thread) after a lane was cut, so the transport finds its node again."""

    def __init__(self, late: LateHook, cut: Callable[[], None],
                 actor_state: ActorState | None = None) -> None:
        self._late = late
        self._on_cut = cut
        self._lane: Lane | None = None
        self._lock = threading.Lock()  # swaps of the lane
        self._refreshing = threading.Lock()  # one refresh at a time (it asks the node)
        self._watch = LaneWatch(self._cut, actor_state, name="dstl-writer-lane-watch")
        self._closed = False
        self.retired = 0
        self.cut = 0

    @property
    def lane(self) -> Lane | None:
        return self._lane

    def refresh(self, node: str, handle: Any, ask: AskLane) -> None:
        """The transport found its node (again), ``handle``: keep the lane if it still leads
        to that actor's process, else open one to it and retire the old one. A node that does
        not answer (stalled) keeps an open lane: the watch cuts it if its process is gone.
        Never call this holding a lock the callers of the lane need: it asks the node."""
        with self._refreshing:
            current = self._lane
            try:
                info = ask()
            except Exception as e:  # noqa: BLE001 - an older node, or a slow or dying one
                log.debug("node %s did not say which lane it offers: %s", node, e)
                if current is not None and current.closed is None:
                    return
                info = None
            if current is not None and leads_to(current, info):
                return
            with self._lock:
                if self._closed:  # (a refresh racing close opens nothing)
                    return
            new = open_lane(info, node, late=self._late) if info else None
            if new is not None:
                self._watch.add(new, handle)
            with self._lock:
                if self._closed:
                    old = new
                else:
                    old, self._lane = self._lane, new
        if old is not None:
            self.retire(old)

    def discard(self, lane: Lane) -> None:
        """``lane`` refused a call (it broke): calls go by Ray until the next refresh."""
        with self._lock:
            if self._lane is lane:
                self._lane = None

    def retire(self, lane: Lane) -> None:
        """Close ``lane`` in the background once its calls in flight are answered, at the
        latest by their deadline (their callers give up then): until then their answers
        still arrive, late ones released through ``late``."""
        self.retired += 1
        drain_s = max(0.0, lane.in_flight_until() - time.monotonic())
        threading.Thread(target=lane.close, args=(drain_s,), daemon=True,
                         name="dstl-lane-retire").start()

    def _cut(self, lane: Lane, _tag: Any, why: str) -> None:
        self.cut += 1
        self.discard(lane)
        self._on_cut()

    def close(self, drain_s: float = 5.0) -> None:
        """Close the lane (its writers are closed), waiting up to ``drain_s`` for answers,
        and stop its watch thread: a closed transport leaves no thread behind."""
        with self._lock:
            self._closed = True
            lane, self._lane = self._lane, None
        self._watch.stop()
        if lane is not None:
            lane.close(drain_s)
