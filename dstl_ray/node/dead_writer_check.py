"""Dead writers at a node (dstl_ray.node.dead_writers; docs/architecture.md "Dead writers"): the
records a node keeps of its writers' processes, the look-up of a driver first seen here, and
the two-phase release round (fence the dead Ray job at every node, then release its logs'
sections of merged files up to their bounds everywhere). Off unless changelog files are
merged across checkpoints and ``dead_writer_check_s`` is set."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

from ..config import ChangelogConfig
from ..transport.discovery import list_node_actors
from ..transport.sender import Caller
from .dead_writers import DeadWriters, bounds_of
from .flush import Flusher
from .namespaces import dead_ray_job_ids
from .peers import Peers, Place
from .sources import REGISTRATION_TIMEOUT_S
from .stats import NodeCounters

log = logging.getLogger(__name__)

LOOKUP_WAIT_S = 5.0  # how long a call waits for its driver's job-table look-up
VETTED_MAX = 10_000  # Ray jobs a node remembers having looked up (dstl_ray.node.dead_writers)
# Ray's job table is read on a thread of its own: a slow GCS (or a table of every Spark
# worker ever started) must not hold up the threads that write and delete files
_JOB_TABLE = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dstl-jobtable")


def restarted_at() -> float:
    """When Ray restarted this node actor (now, if it did), else 0: a restarted node lost
    its writers' records (dstl_ray.node.dead_writers)."""
    try:
        import ray  # lazy: importing dstl_ray must not start loading Ray

        if not ray.is_initialized():
            return 0.0
        actor_id = ray.get_runtime_context().get_actor_id()
        if actor_id is None:
            return 0.0  # not an actor (unit tests): never restarted
    except Exception:  # noqa: BLE001 - outside Ray
        return 0.0
    try:
        # Ray's actor table, as RuntimeContext.was_current_actor_reconstructed reads it, but
        # without its use of the deprecated RuntimeContext.actor_id (a RayDeprecationWarning
        # in every node actor's log)
        from ray._private.state import state

        info = state.actor_table(actor_id)
        return time.time() if info and info.get("NumRestarts", 0) != 0 else 0.0
    except Exception:  # noqa: BLE001 - unknown: take it for restarted (keeps logs, never loses)
        return time.time()


class DeadWriterCheck:
    """This node's part of finding and releasing dead writers."""

    def __init__(self, place: Place, config: ChangelogConfig, dead: DeadWriters, peers: Peers,
                 flusher: Flusher, counters: NodeCounters) -> None:
        self.place = place
        self.config = config
        self.dead = dead
        self.peers = peers
        self.flusher = flusher
        self.counters = counters
        self.on = flusher.merging.across and config.dead_writer_check_s > 0
        self._watch: asyncio.Task | None = None
        self._lookups: dict[str, asyncio.Future] = {}  # Ray job -> its job-table look-up

    # ------------------------------------------------------------------ records

    def registered(self, log_id: str, job_id: str, caller: Caller | None,
                   named: int | None) -> None:
        """A writer registered (``named``: its newest checkpoint with a handle, -1 new)."""
        if self.on:
            self.dead.registered(log_id, job_id, caller, named)
            self.watch()

    def reported(self, log_id: str, job_id: str, caller: Caller | None,
                 named: int | None) -> None:
        """A writer's request or mark named its newest checkpoint with a handle."""
        if self.on:
            self.dead.reported(log_id, job_id, caller, named)
            self.watch()

    def unregistered(self, log_id: str, caller: Caller | None, known: bool) -> None:
        """A writer unregistered; ``known``: it was a source here (not dropped as idle)."""
        if known:
            self.dead.unregistered(log_id)
            return
        # dropped as idle: its record still goes (it released itself)
        rec = self.dead.records.get(log_id)
        if rec is not None and caller is not None and caller.ray_job == rec.ray_job:
            self.dead.unregistered(log_id)

    def saw(self, job_id: str, checkpoint_id: int) -> None:
        """A request or mark of ``job_id`` for ``checkpoint_id`` passed here: a dead log's
        bound is at least the newest checkpoint of its job any node saw."""
        self.dead.saw(job_id, checkpoint_id)

    def watch(self) -> None:
        """Start (once) the periodic check for writers whose process died."""
        if self._watch is None and self.on:
            self._watch = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.dead_writer_check_s)
            try:
                await self.release_dead_writers()
            except Exception as e:  # noqa: BLE001 - tried again next round
                log.warning("%s: dead-writer check failed: %s: %s", self.place.name,
                            type(e).__name__, e)

    async def vet(self, caller: Caller | None) -> None:
        """A writer's driver process (its Ray job) first seen here is looked up once: found
        dead, it is fenced here too. A node restarted by Ray, or one that joined after a
        release round, never got that round's fence; a process Ray took for dead must not
        make a handle here that names sections released already."""
        if not self.on or caller is None or not caller.driver or not caller.ray_job:
            return
        rj = caller.ray_job
        if rj in self.dead.vetted or rj in self.dead.fenced:
            return
        lookup = self._lookups.get(rj)
        if lookup is None:  # one look-up per Ray job, however many calls wait for it
            lookup = asyncio.get_running_loop().run_in_executor(
                _JOB_TABLE, dead_ray_job_ids, {rj})
            self._lookups[rj] = lookup
            lookup.add_done_callback(lambda _f: self._lookups.pop(rj, None))
        try:  # bounded: a slow job table must not hold up requests (a restarted node that
            # missed a fence is the rare case this look-up is for)
            dead = await asyncio.wait_for(asyncio.shield(lookup), LOOKUP_WAIT_S)
        except TimeoutError:
            dead = None
        if dead is None:
            return  # no answer: looked up again on its next call
        if len(self.dead.vetted) >= VETTED_MAX:
            self.dead.vetted.clear()  # bounded: the oldest are simply looked up again
        self.dead.vetted.add(rj)
        if rj in dead:
            self.dead.add_fenced(rj)

    # ------------------------------------------------------------------ rounds

    async def release_dead_writers(self) -> int:
        """Release the merged-file sections of writers whose process died
        (dstl_ray.node.dead_writers): fence each dead Ray job at every node, then release its
        logs up to their bounds everywhere. Returns how many logs were released."""
        ids = self.dead.candidates()
        if not ids:
            return 0
        dead = await asyncio.get_running_loop().run_in_executor(
            _JOB_TABLE, dead_ray_job_ids, ids)
        if not dead:
            return 0
        n = 0
        for ray_job in sorted(dead):
            n += await self._release_ray_job(ray_job)
        return n

    async def _call_all(self, method: str, *args: Any) -> list[Any]:
        """``method`` on every node actor of the tree (this one directly); any failure
        raises, so a round either reached every node or is put off."""
        me = self.place.name
        names = await asyncio.to_thread(list_node_actors, self.config.namespace)
        if me not in names:
            names.append(me)
        out = []
        for name in names:
            if name == me:
                out.append(await getattr(self, method)(*args))
            else:
                out.append(await asyncio.wait_for(
                    getattr(self.peers.actor(name), method).remote(*args),
                    REGISTRATION_TIMEOUT_S))
        return out

    async def _release_ray_job(self, ray_job: str) -> int:
        try:
            answers = await self._call_all("fence_ray_job", ray_job)
            bounds, skipped = bounds_of(answers)
            await self._call_all("forget_logs", ray_job, bounds)
        except Exception as e:  # noqa: BLE001 - every node or none: next round
            self.counters.dead_writer_rounds_failed += 1
            log.warning("%s: releasing the writers of dead Ray job %s put off: %s: %s",
                        self.place.name, ray_job, type(e).__name__, e)
            return 0
        self.dead.skipped += skipped
        n = sum(len(v) for v in bounds.values()) - skipped
        log.info("%s: Ray job %s is dead: %d of its logs released, %d kept", self.place.name,
                 ray_job, n, skipped)
        return n

    async def fence_ray_job(self, ray_job: str) -> dict[str, Any]:
        """Phase 1: refuse ``ray_job`` from now on; its writers' records here."""
        return self.dead.fence(ray_job)

    async def forget_logs(self, ray_job: str, bounds: dict[str, dict[str, int]]) -> None:
        """Phase 2: release these logs' sections up to their bounds (per job)."""
        self.dead.forget(ray_job, bounds)
        await self.flusher.forget_logs(bounds)
