"""How a writer process's persist calls and marks reach its node actor: over the node's local
lane when it offers one on this machine, else as Ray actor calls (docs/architecture.md
"Write path" 2, the local lane).

The lane (:mod:`.lane`) is held by a :class:`~.lane_holder.WriterLane`, which keeps it while
it leads to the process the node actor is, retires it when the actor moved, and has it
watched against Ray's actor table (:mod:`.lane_watch`). This channel adds what a *caller*
needs: a call goes over the lane when there is one; a lane found closed sent nothing, so the
call goes by Ray instead and the node is found again (and a new lane opened) before the next
one. Registrations, releases, retains and status always go by Ray (:mod:`.node_lookup`,
:mod:`.retention`). :meth:`NodeChannel.close` closes the lane and stops its watch thread.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Protocol

from .lane import Lane, LaneClosedError, LateHook
from .lane_holder import WriterLane
from .node_lookup import Get, NodeLookup, ray_get


class Lanes(Protocol):
    """What the channel uses of a :class:`WriterLane` (tests give their own)."""

    @property
    def lane(self) -> Lane | None: ...

    def refresh(self, node: str, handle: Any, ask: Any) -> None: ...

    def discard(self, lane: Lane) -> None: ...

    def close(self) -> None: ...


class NodeChannel:
    """Calls to the node actor ``lookup`` finds. ``late``: where a lane's answer goes whose
    caller stopped waiting (the transport releases its segments unused)."""

    def __init__(self, lookup: NodeLookup, late: LateHook, *, get: Get = ray_get,
                 lanes: Lanes | None = None) -> None:
        self._lookup = lookup
        self._get = get
        # a lane cut by its watch (its process is no longer the actor): find the node again
        self._lanes: Lanes = lanes or WriterLane(late, lookup.mark_stale)

    @property
    def lane(self) -> Lane | None:
        """The open local lane to the node actor (None: Ray calls)."""
        return self._lanes.lane

    def refresh(self, handle: Any) -> None:
        """(holding no lock: it asks the node) A lane to the node just found, ``handle``, if
        it offers one on this machine; the one we have if it still leads to that process."""
        self._lanes.refresh(self._lookup.node_name, handle,
                            lambda: self._get(handle.lane.remote(), 30.0))

    def call(self, method: str, *args: Any, deadline: float | None = None
             ) -> concurrent.futures.Future[Any]:
        """``method`` of the node actor, as a future: over the lane when there is one, else
        by Ray. ``deadline`` (``time.monotonic()``): :meth:`Lane.call`'s; Ray calls have
        none (the transport fails them by it)."""
        handle, lane = self._lookup.current(), self._lanes.lane
        if lane is not None:
            try:
                return lane.call(method, *args, deadline=deadline)
            except LaneClosedError:
                self._lanes.discard(lane)  # (not a lane another thread opened since)
                self._lookup.mark_stale()
        return getattr(handle, method).remote(*args).future()

    def close(self) -> None:
        """Close the lane (its answers drained for a while) and stop its watch thread."""
        self._lanes.close()
