"""The node actor: one ``ChangelogNode`` per Ray node (docs/architecture.md "Write path" 3-6).

A thin Ray entry point that wires the parts, each one concern (after Flink's flink-dstl-dfs):

- :mod:`.intake`: the request-taking endpoints (vet, admit, record, enqueue);
- :mod:`.batching`: FLIP-158 "Implementation notes" batch triggers, on an injected clock;
- :mod:`.sources`: writers, children, idle sources, registration with the upstream;
- :mod:`.routing`: forward-or-flush and up-front routing (FLIP-158 "Future directions");
- :mod:`.flush`: one file per job, or FLIP-306 appends; releases and retains;
- :mod:`.release`: the reference counts of uploaded files; :mod:`.throttle`: in-flight bytes;
- :mod:`.jobs`: namespaces and incarnations; :mod:`.dead_writer_check`: dead writers;
- :mod:`.membership`: the root's watcher; :mod:`.stats`: counters and status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from collections.abc import Coroutine
from typing import Any

from ..config import ChangelogConfig
from ..format.segment import Segment, check_relative_path
from ..merging.pool import FileMergingOptions
from ..observability import tracing
from ..observability.metrics import NodeMetrics
from ..storage.base import normalize_url
from ..storage.registry import storage_for
from ..transport.base import PersistRequest
from ..transport.sender import Caller
from ..upload.uploader import Uploader
from .batching import BatchScheduler, Clock, LoopClock
from .dead_writer_check import DeadWriterCheck, restarted_at
from .dead_writers import DeadWriters
from .flush import Flusher, Result
from .intake import Intake
from .jobs import Jobs
from .lane_server import LaneServer
from .membership import MembershipWatcher, Reconcile
from .namespaces import JobNamespaces
from .peers import Peers, Place
from .routing import Router
from .sources import Sources
from .stats import NodeCounters, build_status


def node_ip() -> str | None:
    """The IP of the Ray node this process runs on, where peers on other hosts reach its
    host lane (None outside Ray: unit tests build nodes without it)."""
    try:
        import ray  # lazy: unit tests build nodes without Ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - no host lane then; Ray calls still work
        return None


class ChangelogNode:
    """Body of the node actor; ``topology.placement`` wraps it with ``ray.remote``.

    All methods run on the actor's asyncio loop; file writes run in worker threads.
    ``reconcile`` (``topology.membership.reconcile``) lets the root keep the tree in line with
    Ray's nodes; ``clock`` is for tests.
    """

    def __init__(self, node_id: str, name: str, base_path: str, config: ChangelogConfig,
                 parent: str | None = None, level: int = 0, index: int = 0,
                 height: int = 0, reconcile: Reconcile | None = None,
                 clock: Clock | None = None) -> None:
        self.node_id = node_id
        self.name = name
        self.node_key = check_relative_path(name)
        self.base_path = normalize_url(base_path)
        self.config = config
        self.raylet_pid = os.environ.get("RAY_RAYLET_PID", "")
        self.started = time.time()
        self.incarnation = uuid.uuid4().hex[:12]  # changes when Ray restarts the actor
        self.counters = NodeCounters()
        tracing.configure(config.tracing, service=f"dstl-ray:{name}")
        self.metrics = NodeMetrics(name, level)
        clock = clock or LoopClock()
        self._place = Place(name, parent, level, index, height)
        self._peers = Peers(config.namespace, lanes=config.local_lane == "on",
                            tcp=config.host_lane == "on")
        storage = storage_for(self.base_path, config)  # S3 options, fault injection
        self._uploader = Uploader(storage, config)
        merging = FileMergingOptions.from_config(config)
        if merging.across:
            merging.check_storage(self.base_path)
        # writers' records and fenced dead processes (dstl_ray.node.dead_writers)
        self._dead = DeadWriters(restarted_at())
        self._namespaces = JobNamespaces()  # job id -> the Ray namespace it may call from
        self._sources = Sources(self._place, self._peers, self.counters,
                                upstream=lambda: self._router.upstream())
        self._batching = BatchScheduler(
            config, self._place, self._sources, self.counters, clock,
            send=lambda batch: self._spawn(self._router.dispatch(batch)),
            before_send=lambda: self._jobs.tick(),
            sources_changed=lambda: self._spawn(self._sources.sync_registration()))
        self._jobs = Jobs(self._place, self.counters, self._dead, self._namespaces,
                          clock.now, on_reset=self._reset_job,
                          active=lambda: (self._sources.writer_jobs()
                                          | self._batching.pending_jobs()),
                          holds=lambda job_id: self._flush.holds(job_id))
        self._flush = Flusher(self._place, self.node_key, self.base_path, config, storage,
                              self._uploader, merging, self._jobs, self._dead, self.counters,
                              self.metrics)
        self._dead_writers = DeadWriterCheck(self._place, config, self._dead, self._peers,
                                             self._flush, self.counters)
        self._router = Router(self._place, config, self._peers, self._sources, self._flush,
                              self.counters, self.metrics,
                              release_here=lambda *a: self._intake.release(*a),
                              clock=clock)
        self._intake = Intake(self._place, self._peers, self._jobs, self._dead_writers,
                              self._sources, self._batching, self._router, self._flush,
                              self.counters, self.metrics, clock, self._spawn)
        self._membership = MembershipWatcher(self._place, self.base_path, config, reconcile)
        # writers on this machine call persist_many and mark over a Unix socket
        # (dstl_ray.transport.lane), the same coroutines as the Ray methods below
        # (an answer the lane cannot deliver is released as a late one: nobody names it)
        self._lane = LaneServer(name, {"persist_many": self.persist_many, "mark": self.mark,
                                       "persist_batch": self.persist_batch},
                                release=self._router.release_late,
                                tcp_host=node_ip() if config.host_lane == "on" else None,
                                node_id=node_id) \
            if config.local_lane == "on" else None

    @staticmethod
    def _spawn(coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(coro)

    def _reset_job(self, job_id: str) -> None:
        """A job's node-side state starts clean (a newer incarnation) or goes (idle)."""
        self._batching.forget_job(job_id)
        self._dead.reset(job_id)
        self._flush.drop_job(job_id)

    @property
    def parent(self) -> str | None:
        return self._place.parent

    @property
    def level(self) -> int:
        return self._place.level

    @property
    def index(self) -> int:
        return self._place.index

    @property
    def height(self) -> int:
        return self._place.height

    # ------------------------------------------------------------------ info

    async def info(self) -> dict[str, Any]:
        return {"name": self.name, "node_id": self.node_id, "base_path": self.base_path,
                "config": self.config.to_dict(), "raylet_pid": self.raylet_pid,
                "level": self.level, "parent": self.parent, "index": self.index}

    async def ping(self) -> str:
        return self.name

    async def lane(self) -> dict[str, Any] | None:
        """How a writer on this machine reaches this actor without Ray (None: no lane):
        socket path, token and machine (dstl_ray.transport.lane). Not part of ``info``: the
        token is for writers, not for status output."""
        if self._lane is None:
            return None
        await self._lane.start()
        return self._lane.info()

    async def status(self) -> dict[str, Any]:
        b, r = self._batching, self._router
        return build_status(
            place=self._place, node_id=self.node_id, raylet_pid=self.raylet_pid,
            started=self.started, incarnation=self.incarnation, counters=self.counters,
            writers=len(self._sources.writers), children=sorted(self._sources.children),
            buffered_bytes=b.pending_bytes, pending_requests=len(b.pending),
            budget=r.budget, in_flight_limit=self.config.in_flight_limit, route=r.route,
            route_left=r.route_left, dead=self._dead, namespaces=self._namespaces,
            jobs=len(self._jobs.seen), merged_changelog=self._flush.merged_stats(),
            upload=self._uploader.stats, entries=self._entries(),
            metrics=self.metrics.to_dict(),
            lane=({**self._lane.stats(), "cut": self._peers.cut}
                  if self._lane is not None else None))

    def _entries(self) -> dict[str, int]:
        """Sizes of the per-job, per-writer and per-file tables (nothing may grow without
        bound over a long run: the soak experiment samples these)."""
        return {**self._sources.entries(), "jobs": len(self._jobs.seen),
                **self._batching.entries(), "dead_writers": self._dead.size(),
                "incarnations": len(self._jobs.incarnations),
                "namespaces": self._namespaces.size(), **self._flush.entries(),
                "handles": len(self._peers.handles)}

    # ------------------------------------------------------------------ tree

    async def set_parent(self, parent: str | None, level: int, index: int | None = None,
                         height: int | None = None) -> None:
        """Re-attach (tree changes): later batches go to ``parent``; any route is dropped."""
        p = self._place
        if index is not None:
            p.index = index
        if height is not None:
            p.height = height
        if parent != p.parent:
            self._router.drop_route()
            self._peers.drop(p.parent)  # its lane retires once its calls are answered
        p.parent, p.level = parent, level
        await self._sources.sync_registration()
        if parent is None:
            self._membership.start()

    async def set_tree(self, order: list[str]) -> None:
        """Root only: the node order the tree was built from (joins append to it)."""
        self._membership.order = list(order)
        self._membership.start()

    async def tree_order(self) -> list[str] | None:
        return self._membership.order

    # ------------------------------------------------------------------ sources

    async def register_writer(self, log_id: str, job_id: str,
                              caller: Caller | None = None, named: int | None = None) -> bool:
        """``named``: the writer's newest checkpoint with a handle (-1 for a new writer;
        None when it registers again and does not say). Returns whether this tree merges
        changelog files (then the writer waits for its marks to be taken)."""
        return await self._intake.register_writer(log_id, job_id, caller, named)

    async def unregister_writer(self, log_id: str, caller: Caller | None = None) -> None:
        await self._intake.unregister_writer(log_id, caller)

    async def register_source(self, child: str, jobs: list[str] | None = None) -> None:
        """``child`` forwards its batches here, with sources of ``jobs`` (again whenever that
        set changes)."""
        await self._intake.register_source(child, jobs)

    async def unregister_source(self, child: str) -> None:
        await self._intake.unregister_source(child)

    # ------------------------------------------------------------------ persist

    async def persist(self, request: PersistRequest) -> Segment:
        """One writer's request; resolves to the segment holding it once durable."""
        return await self._intake.persist(request)

    async def persist_many(self, requests: list[PersistRequest]) -> list[Segment | Exception]:
        """Several writers' requests from one process in one call; each still counts as its
        own writer's request for batching. Per request: its segment, or the exception."""
        return list(await asyncio.gather(*(self.persist(r) for r in requests),
                                         return_exceptions=True))

    async def persist_batch(self, requests: list[PersistRequest], source: str,
                            budget_s: float | None = None, sent_at: float | None = None
                            ) -> list[Result]:
        """A child's whole batch, as ONE request; resolves to one result per request: its
        segment, or why it failed. Jobs are independent: one job's refusal or DFS failure
        fails only that job's requests. ``budget_s``: how long the child waits for the
        answer; past it, nothing is written for the child (it flushes itself), and what
        was written for it is released again. ``sent_at``: the child's wall clock when it
        sent the batch, so time this actor spent paused (a stalled process) counts too;
        the budget alone bounds it should our clocks disagree."""
        return await self._intake.persist_batch(requests, source, budget_s, sent_at)

    async def mark(self, job_id: str, source: str, checkpoint_id: int,
                   caller: Caller | None = None, named: int | None = None) -> None:
        """``source`` has nothing (more) to send for ``checkpoint_id``: its changes are
        durable already or it had none. A batch waiting for it stops waiting; a node that
        had no request of this checkpoint at all passes the mark to its upstream.
        ``named``: a writer's newest checkpoint with a handle (dstl_ray.node.dead_writers); with
        it, ``checkpoint_id`` may be -1 (a handle for no checkpoint id: only recorded)."""
        await self._intake.mark(job_id, source, checkpoint_id, caller, named)

    # ------------------------------------------------------------------ references

    async def retain(self, job_id: str, rel_path: str, offset: int, log_id: str,
                     caller: Caller | None = None, incarnation: str = "") -> bool:
        """A restored writer's backend names an older section of a merged file (see
        :meth:`FlushFiles.retain`); it releases it like its own uploads."""
        return await self._intake.retain(job_id, rel_path, offset, log_id, caller,
                                         incarnation)

    async def release(self, job_id: str, rel_path: str, log_id: str, used: bool,
                      caller: Caller | None = None, offset: int = 0,
                      last_checkpoint: int = -1) -> bool:
        """A writer no longer needs its segment of ``rel_path``. Once every log in the file
        released it and none of them gave it out in a handle, the file is deleted (a
        pre-emptive upload that no checkpoint used). Returns True if the file was deleted."""
        return await self._intake.release(job_id, rel_path, log_id, used, caller, offset,
                                          last_checkpoint)

    # ------------------------------------------------------------------ dead writers

    async def release_dead_writers(self) -> int:
        """Release the merged-file sections of writers whose process died (one round)."""
        return await self._dead_writers.release_dead_writers()

    async def fence_ray_job(self, ray_job: str) -> dict[str, Any]:
        """Phase 1: refuse ``ray_job`` from now on; its writers' records here."""
        return await self._dead_writers.fence_ray_job(ray_job)

    async def forget_logs(self, ray_job: str, bounds: dict[str, dict[str, int]]) -> None:
        """Phase 2: release these logs' sections up to their bounds (per job)."""
        await self._dead_writers.forget_logs(ray_job, bounds)

    # ------------------------------------------------------------------ testing, shutdown

    async def set_fault_spec(self, spec: str) -> None:
        """Testing hook (chaos harness, experiments): replace this node's DFS fault injection
        (``fault_spec`` syntax, "" for none) for later uploads; in-flight ones keep theirs."""
        cfg = dataclasses.replace(self.config, fault_spec=spec)  # validates
        self._flush.set_storage(storage_for(self.base_path, cfg))

    async def spans(self, clear: bool = False) -> list[dict[str, Any]]:
        """Spans finished in this actor (tracing ``memory`` mode)."""
        return tracing.finished_spans(clear)

    async def shutdown(self) -> None:
        self._membership.stop()
        if self._lane is not None:
            await self._lane.close()
        self._peers.close()
        self._uploader.close()

