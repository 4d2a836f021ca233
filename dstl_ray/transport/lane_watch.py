"""Lanes tied to the process they were opened to (docs/architecture.md "Write path" 2 and 4):
the one check both a writer's lane and a node's lanes to its peers go through.

A lane leads to the process that answered ``lane()`` (its pid), while everything else
(releases, registrations, a new lane) goes to whatever process the actor's NAME means now.
So every LANE_CHECK_S each lane, open or still delivering answers after it was closed, is
checked against Ray's actor table, and cut once Ray holds that actor DEAD or RESTARTING, or
runs it in another process (a nonzero pid other than the lane's): its Ray node was declared
dead while the old process runs on (a zombie), or it was restarted elsewhere. Anything else
keeps the lane: a peer that is only stalled stays ALIVE in Ray, and an entry without a pid
(the table is a private Ray API) proves nothing.

The lookups run on ONE thread of the watch's own, one at a time: a lookup has no timeout of
its own, and with Ray's GCS unreachable it blocks that thread only (the next check waits for
it), never a pool that uploads, appends or releases also need.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .lane import Lane

log = logging.getLogger(__name__)

LANE_CHECK_S = 5.0  # how often a lane's peer is checked against Ray's actor table (one GCS
# lookup per lane: every writer process with a lane pays it; Ray itself takes tens of seconds
# to declare a node dead, so a quicker check would cut no sooner)

# (state, pid) or (state, pid, node id) Ray's actor table holds for an actor handle's actor;
# None: not known
ActorState = Callable[[Any], "tuple[str, int] | tuple[str, int, str] | None"]
# a lane whose process is no longer its actor: (the lane, what it was added with, why)
OnCut = Callable[[Lane, Any, str], None]


def ray_actor_state(handle: Any) -> tuple[str, int, str] | None:
    """(state, pid, Ray node id) Ray's actor table holds for the actor behind ``handle``
    ("DEAD", 0 when it has no entry); None when the table could not be read (then nothing is
    concluded)."""
    try:
        from ray._private.state import state

        info = state.actor_table(handle._actor_id.hex())
    except Exception as e:  # noqa: BLE001 - no answer: the lane stays
        log.debug("actor table lookup failed: %s", e)
        return None
    if not info:
        return "DEAD", 0, ""
    address = info.get("Address") or {}
    return (str(info.get("State", "")), int(info.get("Pid") or 0),
            str(address.get("NodeID") or "") if isinstance(address, dict) else "")


def gone(got: tuple[str, int] | tuple[str, int, str] | None, lane_pid: int | None,
         lane_node: str | None = None) -> str | None:
    """Why a lane to process ``lane_pid`` on Ray node ``lane_node`` no longer leads to its
    actor, by Ray's ``got`` (state, pid[, node id]); None keeps it. Only DEAD or RESTARTING,
    or a nonzero pid other than the lane's, or a node other than the lane's (an actor
    restarted on a fresh host can get the pid it had on the lost one), cut a lane: anything
    unknown (no answer, no pid or node, a state this code does not know) keeps it, for
    cutting a lane to a live node makes its callers flush themselves for nothing."""
    if got is None:
        return None
    state, pid = got[0], got[1]
    node = got[2] if len(got) > 2 else ""
    if state in ("DEAD", "RESTARTING"):
        return f"Ray holds its actor {state}"
    if pid and lane_pid is not None and pid != lane_pid:
        return f"Ray's actor now runs in process {pid}"
    if node and lane_node and node != lane_node:
        return f"Ray's actor now runs on node {node}"
    return None


class LaneWatch:
    """Checks the lanes added to it, on a thread of its own while it has any; calls
    ``on_cut`` (on that thread) for each lane it cut. A lane leaves the watch once it has
    ended (:attr:`Lane.done`), so a closed lane still delivering answers stays watched."""

    def __init__(self, on_cut: OnCut, actor_state: ActorState | None = None,
                 name: str = "dstl-lane-watch") -> None:
        self._on_cut = on_cut
        self.actor_state = actor_state or ray_actor_state  # (tests give their own)
        self.name = name
        self._lock = threading.Lock()
        self._lanes: dict[Lane, tuple[Any, Any]] = {}  # lane -> (actor handle, tag)
        self._last: dict[Lane, tuple[Any, ...] | None] = {}
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()  # set by stop(): no more lanes, the thread ends
        self.lookups = 0

    def add(self, lane: Lane, handle: Any, tag: Any = None) -> None:
        """Watch ``lane``, opened to the actor behind ``handle`` (its id, not its name)."""
        with self._lock:
            if self._stopped.is_set():
                return
            self._lanes[lane] = (handle, tag)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
                self._thread.start()

    def last(self, lane: Lane) -> tuple[Any, ...] | None:
        """What Ray's actor table said of ``lane``'s actor at its last check (None: not
        checked yet, or no answer)."""
        return self._last.get(lane)

    def stop(self, timeout: float = 2.0) -> None:
        """Watch nothing more, and end the thread: at once, or after the lookup it is in
        (waited for up to ``timeout``: a lookup has no timeout of its own). A process that
        opens and closes many lanes leaves no thread behind looking its actors up."""
        with self._lock:
            self._stopped.set()
            self._lanes.clear()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while not self._stopped.wait(LANE_CHECK_S):
            with self._lock:
                for ln in [ln for ln in self._lanes if ln.done]:
                    del self._lanes[ln]
                    self._last.pop(ln, None)
                if not self._lanes:
                    self._thread = None
                    return
                lanes = list(self._lanes.items())
            for ln, (handle, tag) in lanes:
                if self._stopped.is_set():
                    break
                self.check(ln, handle, tag)
        with self._lock:
            if self._thread is threading.current_thread():
                self._thread = None

    def check(self, ln: Lane, handle: Any, tag: Any = None) -> None:
        """One lookup of ``ln``'s actor; cuts the lane if its process is gone."""
        if ln.done:
            return
        try:
            self.lookups += 1
            got = self.actor_state(handle)
        except Exception as e:  # noqa: BLE001 - unknown: the lane stays
            log.debug("cannot check the lane to %s: %s", ln.node, e)
            return
        self._last[ln] = got
        why = gone(got, ln.peer_pid, ln.peer_node)
        if why is None:
            return
        log.warning("cutting the lane to %s (pid %s): %s", ln.node, ln.peer_pid, why)
        with self._lock:
            self._lanes.pop(ln, None)
        ln.cut(why)
        try:
            self._on_cut(ln, tag, why)
        except Exception as e:  # noqa: BLE001 - the lane is cut all the same
            log.warning("after cutting the lane to %s: %s", ln.node, e)
