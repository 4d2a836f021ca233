"""The node actor: one ``ChangelogNode`` per Ray node (docs/architecture.md "Write path" 3-6).

It batches the persist requests it receives exactly as FLIP-158 "Implementation notes" say:
a batch is sent ``persist_delay`` after its first request, at once when every registered
source (local writer or child node) has a pending request, or when the buffered bytes pass
``persist_size_threshold``. Then forward-or-flush (FLIP-158 "Future directions"): the root, or
a node holding at least ``flush_bytes``, writes ONE file per job for the whole batch; any other
node forwards the batch to its parent as ONE request. If the parent is unreachable the node
flushes itself: slower, never lost, never stuck. Handles (segments) travel back to every writer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import resource
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from . import tracing
from .config import ChangelogConfig
from .dead_writers import DeadWriters, bounds_of
from .errors import DeadlineError, DstlError, StaleIncarnationError, StorageError
from .format import FILE_SUFFIX, assemble_file
from .handle import Segment, check_relative_path
from .lease import Incarnation
from .merging import FileMergingOptions
from .messages import PersistRequest
from .metrics import NodeMetrics
from .namespaces import Caller, JobNamespaces, dead_ray_job_ids
from .segment_files import SEGMENTS_DIR, UNMANAGED_DIR, FlushFiles
from .storage import join, normalize_url, storage_for
from .upload import Uploader

log = logging.getLogger(__name__)

def current_rss_kb() -> int:
    """Resident set size now (``ru_maxrss`` is the peak), from /proc where there is one."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


REGISTRATION_TIMEOUT_S = 5.0  # an upstream's (un)register_source call, at most
REPLY_GRACE_S = 2.0  # a parent's answer in transit after its deadline, at most
# how long a child listens for an answer it stopped waiting for (to release it unused); a
# later one stays until the job's next recovery deletes what no checkpoint names
LATE_ANSWER_WAIT_S = 600.0
VETTED_MAX = 10_000  # Ray jobs a node remembers having looked up (dstl_ray.dead_writers)
JOB_IDLE_S = 3600.0  # a job unheard of for this long (and without writers) is forgotten

Result = Segment | BaseException  # per request: its segment, or why it failed


@dataclass
class _Pending:
    requests: list[PersistRequest]
    future: asyncio.Future
    source: str
    size: int
    spans: list[Any] | None = None  # one "dstl.node" span per request (tracing on)
    arrived: float = field(default_factory=time.monotonic)
    # monotonic time after which the sender no longer waits for the answer: its segments
    # are useless to it then (it flushed them itself, or failed its checkpoint)
    deadline: float = float("inf")


class _ByteBudget:
    """Bounded in-flight upload bytes (Flink: max-in-flight): acquirers wait when exceeded.
    A single batch larger than the limit is admitted alone, so nothing can deadlock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.waiting = 0
        self.waits = 0  # acquisitions that had to wait (backpressure)
        self.wait_s = 0.0  # total time spent waiting
        self.peak = 0  # most bytes ever in flight
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            self.waiting += 1
            t0 = time.monotonic()
            admit = lambda: self.used == 0 or self.used + n <= self.limit  # noqa: E731
            try:
                if not admit():
                    self.waits += 1
                    await self._cond.wait_for(admit)
            finally:
                self.waiting -= 1
                self.wait_s += time.monotonic() - t0
            self.used += n
            self.peak = max(self.peak, self.used)

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


def _restarted_at() -> float:
    """When Ray restarted this node actor (now, if it did), else 0: a restarted node lost
    its writers' records (dstl_ray.dead_writers)."""
    try:
        import ray

        if not ray.is_initialized():
            return 0.0
        ctx = ray.get_runtime_context()
        if ctx.get_actor_id() is None:
            return 0.0  # not an actor (unit tests): never restarted
    except Exception:  # noqa: BLE001 - outside Ray
        return 0.0
    try:
        return time.time() if ctx.was_current_actor_reconstructed else 0.0
    except Exception:  # noqa: BLE001 - unknown: take it for restarted (keeps logs, never loses)
        return time.time()


@dataclass(frozen=True)
class _Released:
    """What releasing a request's segment needs (not its bytes)."""

    job_id: str
    log_id: str
    caller: Caller | None


@dataclass
class NodeCounters:
    requests: int = 0  # persist requests received (writer or child batches)
    requests_from_children: int = 0
    batches: int = 0
    files_flushed: int = 0
    bytes_flushed: int = 0
    forwards: int = 0
    bytes_forwarded: int = 0
    forward_failures: int = 0
    flush_failures: int = 0
    files_deleted: int = 0
    routed_direct: int = 0  # batches sent straight to an ancestor, skipping hops
    route_failures: int = 0
    sent_all_pending: int = 0  # batches sent because every source had a request pending
    sent_size: int = 0  # batches sent because the buffered bytes passed the threshold
    sent_delay: int = 0  # batches sent by the persist-delay timer
    sent_late_arrived: int = 0  # sent when the late sources of a checkpoint arrived
    waits_for_late: int = 0  # batches whose delay was extended for late sources
    registration_failures: int = 0  # upstream (un)registrations that failed or timed out
    idle_sources_dropped: int = 0  # sources silent for source_idle_s, no longer waited for
    incarnations: int = 0  # jobs (re)started under a newer incarnation
    stale_refused: int = 0  # requests of a job's older incarnation, refused
    deadline_expired: int = 0  # requests whose sender's deadline passed here
    late_answers_released: int = 0  # forwards answered after we gave up: released unused
    jobs_forgotten: int = 0  # idle jobs whose node-side state was dropped
    dead_writer_rounds_failed: int = 0  # dead-writer releases put off (a node did not answer)


class ChangelogNode:
    """Body of the node actor; :func:`dstl_ray.topology.placement` wraps it with ``ray.remote``.

    All methods run on the actor's asyncio loop; file writes run in worker threads.
    """

    def __init__(self, node_id: str, name: str, base_path: str, config: ChangelogConfig,
                 parent: str | None = None, level: int = 0, index: int = 0,
                 height: int = 0) -> None:
        self.node_id = node_id
        self.name = name
        self.node_key = check_relative_path(name)
        self.base_path = normalize_url(base_path)
        self.config = config
        self.parent = parent
        self.level = level
        self.raylet_pid = os.environ.get("RAY_RAYLET_PID", "")
        self.started = time.time()
        self.incarnation = uuid.uuid4().hex[:12]  # changes when Ray restarts the actor
        self.counters = NodeCounters()
        tracing.configure(config.tracing, service=f"dstl-ray:{name}")
        self.metrics = NodeMetrics(name, level)
        self._storage = storage_for(self.base_path, config)  # S3 options, fault injection
        self._uploader = Uploader(self._storage, config)
        self._writers: dict[str, str] = {}  # log id -> job id
        self._namespaces = JobNamespaces()  # job id -> the Ray namespace it may call from
        self._children: set[str] = set()  # child nodes that forward to this one
        # child -> the jobs it has sources of (told when it registers with us): before a
        # job's first checkpoint here, the sources a batch of that job waits for
        self._child_jobs: dict[str, frozenset[str]] = {}
        self._last_seen: dict[str, float] = {}  # source -> time of its last request
        # job -> source -> the newest checkpoint id it sent a request (or a mark) for
        self._ckpt_seen: dict[str, dict[str, int]] = {}
        self._sent_for: dict[str, int] = {}  # job -> newest checkpoint id with a request here
        self._first_ckpt: dict[str, int] = {}  # job -> first checkpoint id seen here
        self._marked_up: dict[str, int] = {}  # job -> newest checkpoint id marked upstream
        self._extended = False  # the delay is over; waiting for late sources of a checkpoint
        self._pending: list[_Pending] = []
        self._pending_bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self._budget: _ByteBudget | None = None
        self.index = index
        self.height = height
        # our last batch was big enough to flush ourselves: then our upstream should not
        # wait for us (it is re-registered as soon as we forward again)
        self._flushes_self = False
        self._registered_to: str | None = None  # upstream node we are a source of
        self._late_answers: set[asyncio.Task] = set()  # forwards we stopped waiting for
        # writers' records and fenced dead processes (dstl_ray.dead_writers)
        self._dead = DeadWriters(_restarted_at())
        self._dead_watch: asyncio.Task | None = None
        self._registered_jobs: frozenset[str] = frozenset()  # the jobs we told it of
        self._handles: dict[str, Any] = {}
        # up-front routing (FLIP-158 "Future directions"): the ancestor that flushed our last
        # batch, used directly for the next ``routing_horizon`` batches
        self._route: str | None = None
        self._route_left = 0
        self._order: list[str] | None = None  # root only: the tree's node order
        self._watcher: asyncio.Task | None = None
        # path -> ({(log id, section offset)} not yet released, [kept])
        self._files: dict[str, tuple[set[tuple[str, int]], list[bool]]] = {}
        # FLIP-306 across checkpoints: each job's flushes appended to this node's open file
        self._merging = FileMergingOptions.from_config(config)
        if self._merging.across:
            self._merging.check_storage(self.base_path)
        self._flush_files: dict[str, FlushFiles] = {}
        # job -> its newest incarnation seen here (dstl_ray.lease): a job's node-side state
        # belongs to one incarnation and starts clean when a newer one appears
        self._incarnations: dict[str, Incarnation] = {}
        self._job_seen: dict[str, float] = {}  # job -> last time it was heard of
        self._jobs_checked = time.monotonic()

    # ------------------------------------------------------------------ info

    async def info(self) -> dict[str, Any]:
        return {"name": self.name, "node_id": self.node_id, "base_path": self.base_path,
                "config": self.config.to_dict(), "raylet_pid": self.raylet_pid,
                "level": self.level, "parent": self.parent, "index": self.index}

    async def ping(self) -> str:
        return self.name

    async def status(self) -> dict[str, Any]:
        c = self.counters
        return {
            "name": self.name, "node_id": self.node_id, "level": self.level,
            "parent": self.parent, "root": self.parent is None,
            "writers": len(self._writers), "children": sorted(self._children),
            "buffered_bytes": self._pending_bytes, "pending_requests": len(self._pending),
            "in_flight_bytes": self._budget.used if self._budget else 0,
            "requests": c.requests, "requests_from_children": c.requests_from_children,
            "batches": c.batches, "files_flushed": c.files_flushed,
            "bytes_flushed": c.bytes_flushed, "forwards": c.forwards,
            "bytes_forwarded": c.bytes_forwarded, "forward_failures": c.forward_failures,
            "flush_failures": c.flush_failures, "files_deleted": c.files_deleted,
            "routed_direct": c.routed_direct,
            "batch_triggers": {"all_pending": c.sent_all_pending, "size": c.sent_size,
                               "delay": c.sent_delay, "late_arrived": c.sent_late_arrived},
            "waits_for_late": c.waits_for_late,
            "idle_sources_dropped": c.idle_sources_dropped,
            "registration_failures": c.registration_failures, "route": self._route,
            "incarnations": c.incarnations, "stale_refused": c.stale_refused,
            "deadline_expired": c.deadline_expired,
            "late_answers_released": c.late_answers_released,
            "dead_writers_released": self._dead.released,
            "dead_writers_kept": self._dead.skipped,
            "dead_writer_rounds_failed": c.dead_writer_rounds_failed, "jobs_forgotten": c.jobs_forgotten,
            "jobs": len(self._job_seen),
            "namespace_refusals": self._namespaces.refused,
            "merged_changelog": {j: ff.stats_dict() for j, ff in self._flush_files.items()},
            "namespace_takeovers": self._namespaces.taken_over,
            "route_left": self._route_left, "route_failures": c.route_failures,
            "index": self.index, "height": self.height,
            "upload_attempts": self._uploader.stats.attempts,
            "upload_retries": self._uploader.stats.retries,
            "upload": self._uploader.stats.to_dict(),
            "backpressure": {"limit": self.config.in_flight_limit,
                             "waiting": self._budget.waiting if self._budget else 0,
                             "waits": self._budget.waits if self._budget else 0,
                             "wait_s": round(self._budget.wait_s, 3) if self._budget else 0.0,
                             "peak_in_flight_bytes": self._budget.peak if self._budget else 0},
            "raylet_pid": self.raylet_pid, "uptime_s": round(time.time() - self.started, 1),
            "pid": os.getpid(), "rss_kb": current_rss_kb(),
            "py_blocks": sys.getallocatedblocks(),
            "entries": self._entries(),
            "max_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "incarnation": self.incarnation,
            "metrics": self.metrics.to_dict(),
        }

    def _entries(self) -> dict[str, int]:
        """Sizes of the per-job, per-writer and per-file tables (nothing may grow without
        bound over a long run: the soak experiment samples these)."""
        return {"writers": len(self._writers), "children": len(self._children),
                "last_seen": len(self._last_seen), "jobs": len(self._job_seen),
                "ckpt_seen": sum(len(v) for v in self._ckpt_seen.values()),
                "sent_for": len(self._sent_for), "marked_up": len(self._marked_up),
                "first_ckpt": len(self._first_ckpt), "child_jobs": len(self._child_jobs),
                "dead_writers": self._dead.size(),
                "incarnations": len(self._incarnations),
                "namespaces": self._namespaces.size(), "files": len(self._files),
                "merged_files": sum(ff.size() for ff in self._flush_files.values()),
                "handles": len(self._handles)}

    async def set_parent(self, parent: str | None, level: int, index: int | None = None,
                         height: int | None = None) -> None:
        """Re-attach (tree changes): later batches go to ``parent``; any route is dropped."""
        if index is not None:
            self.index = index
        if height is not None:
            self.height = height
        if parent != self.parent:
            self._drop_route()
        self.parent, self.level = parent, level
        await self._sync_registration()
        if parent is None:
            self._start_watcher()

    async def set_tree(self, order: list[str]) -> None:
        """Root only: the node order the tree was built from (joins append to it)."""
        self._order = list(order)
        self._start_watcher()

    async def tree_order(self) -> list[str] | None:
        return self._order

    # ------------------------------------------------------------------ sources

    async def register_writer(self, log_id: str, job_id: str,
                              caller: Caller | None = None, named: int | None = None) -> bool:
        """``named``: the writer's newest checkpoint with a handle (-1 for a new writer;
        None when it registers again and does not say). Returns whether this tree merges
        changelog files (then the writer waits for its marks to be taken)."""
        await self._vet(caller)
        self._admit(job_id, caller)
        self._writers[log_id] = job_id
        if self._dead_writers_on:
            self._dead.registered(log_id, job_id, caller, named)
            self._watch_dead_writers()
        self._last_seen[log_id] = time.monotonic()
        await self._sync_registration()
        return self._dead_writers_on

    async def unregister_writer(self, log_id: str, caller: Caller | None = None) -> None:
        job_id = self._writers.get(log_id)
        if job_id is None:  # dropped as idle: its record still goes (it released itself)
            rec = self._dead.records.get(log_id)
            if rec is not None and caller is not None and caller.ray_job == rec.ray_job:
                self._dead.unregistered(log_id)
            return
        self._admit(job_id, caller)
        self._writers.pop(log_id, None)
        self._dead.unregistered(log_id)
        self._last_seen.pop(log_id, None)
        for seen in self._ckpt_seen.values():
            seen.pop(log_id, None)
        self._maybe_send_now()
        await self._sync_registration()

    async def register_source(self, child: str, jobs: list[str] | None = None) -> None:
        """``child`` forwards its batches here, with sources of ``jobs`` (again whenever that
        set changes)."""
        self._children.add(child)
        self._last_seen[child] = time.monotonic()
        if jobs is not None:
            self._child_jobs[child] = frozenset(jobs)
        await self._sync_registration()

    async def unregister_source(self, child: str) -> None:
        self._children.discard(child)
        self._child_jobs.pop(child, None)
        self._last_seen.pop(child, None)
        self._maybe_send_now()
        await self._sync_registration()

    def _sources(self) -> set[str]:
        return set(self._writers) | self._children

    def _source_jobs(self) -> frozenset[str]:
        """The jobs this node has sources of: its writers' and its children's."""
        jobs = set(self._writers.values())
        for child in self._children:
            jobs |= self._child_jobs.get(child, frozenset())
        return frozenset(jobs)

    def _of_job(self, source: str, job_id: str) -> bool:
        return self._writers.get(source) == job_id or job_id in self._child_jobs.get(
            source, ())

    def _upstream(self) -> str | None:
        return self._route if self._route_left > 0 else self.parent

    async def _sync_registration(self) -> None:
        """Be a registered source of whichever node our batches go to, so that node's
        "every source is pending" trigger waits for us, and only for us while we send there."""
        want = self._upstream() if self._sources() and not self._flushes_self else None
        have = self._registered_to
        jobs = self._source_jobs() if want is not None else frozenset()
        if want == have and jobs == self._registered_jobs:
            return
        self._registered_to, self._registered_jobs = want, jobs
        if want == have:
            have = None  # the same upstream: only tell it our jobs again
        # bounded: registration only helps batching, a persist request must never wait on
        # an upstream that is gone but not yet declared dead (a removed Ray node)
        limit = REGISTRATION_TIMEOUT_S
        try:
            if have is not None:
                await asyncio.wait_for(self._actor(have).unregister_source.remote(self.name),
                                       limit)
        except Exception as e:  # noqa: BLE001 - a dead upstream forgets us anyway
            log.debug("%s: cannot unregister from %s: %s", self.name, have, e)
        try:
            if want is not None:
                await asyncio.wait_for(self._actor(want).register_source.remote(
                    self.name, sorted(jobs)), limit)
        except Exception as e:  # noqa: BLE001 - a missing upstream only costs batching delay
            self.counters.registration_failures += 1
            if self._registered_to == want:
                self._registered_to, self._registered_jobs = None, frozenset()
            self._handles.pop(want, None)
            log.warning("%s: cannot register with %s: %s", self.name, want, e)

    def _actor(self, name: str) -> Any:
        h = self._handles.get(name)
        if h is None:
            import ray

            h = ray.get_actor(name, namespace=self.config.namespace)
            self._handles[name] = h
        return h

    def _drop_route(self) -> None:
        self._route, self._route_left = None, 0

    # ------------------------------------------------------------------ persist

    # ------------------------------------------------------------------ jobs

    def _admit(self, job_id: str, caller: Caller | None, incarnation: str = "") -> None:
        """Every request-taking endpoint: the job's namespace (dstl_ray.namespaces), then its
        incarnation. A newer incarnation resets the job's node-side state (batching
        knowledge, merged changelog files, the subsumed watermark): the job was restarted
        under the same id, and nothing the old run taught us may touch the new run's files.
        The old run's merged files are left alone (the new run's registry counts references
        to them like any shared file). Requests of an older incarnation are refused."""
        check_relative_path(job_id)
        self._dead.check(caller)
        self._namespaces.admit(job_id, caller)
        self._job_seen[job_id] = time.monotonic()
        inc = Incarnation.parse(incarnation)
        if inc is None:
            return  # a writer outside any coordinated job: whatever runs now
        cur = self._incarnations.get(job_id)
        if cur is None or (inc.epoch, inc.holder) > (cur.epoch, cur.holder):
            if cur is not None:
                log.info("%s: job %s restarted as incarnation %s (was %s): its node "
                         "state starts clean", self.name, job_id, inc, cur)
                self.counters.incarnations += 1
            self._incarnations[job_id] = inc
            self._reset_job(job_id)
        elif inc != cur:
            self.counters.stale_refused += 1
            raise StaleIncarnationError(
                f"job {job_id!r}: request of incarnation {inc} refused, node {self.name} "
                f"serves its newer incarnation {cur} (the job was started again)")

    def _reset_job(self, job_id: str) -> None:
        self._ckpt_seen.pop(job_id, None)
        self._dead.dead_logs.pop(job_id, None)
        self._first_ckpt.pop(job_id, None)
        self._sent_for.pop(job_id, None)
        self._marked_up.pop(job_id, None)
        ff = self._flush_files.pop(job_id, None)
        if ff is not None:
            ff.abandon()

    def _forget_idle_jobs(self) -> None:
        """Nothing grows without bound on a long-lived tree: a job not heard of for
        ``JOB_IDLE_S``, with no writer registered here and no file of it tracked here (a
        job checkpointing rarely keeps its merged files and its namespace binding), loses
        its node-side state; a later request of it starts clean."""
        now = time.monotonic()
        active = set(self._writers.values()) | {r.job_id for p in self._pending
                                                for r in p.requests}
        for job_id, seen in list(self._job_seen.items()):
            ff = self._flush_files.get(job_id)
            job_dir = join(self.base_path, job_id) + "/"
            if (now - seen > JOB_IDLE_S and job_id not in active
                    and (ff is None or ff.size() == 0)
                    and not any(p.startswith(job_dir) for p in self._files)):
                del self._job_seen[job_id]
                self._incarnations.pop(job_id, None)
                self._reset_job(job_id)
                self._namespaces.forget(job_id)
                self.counters.jobs_forgotten += 1

    def _stale(self, r: PersistRequest) -> StaleIncarnationError | None:
        """``r`` was admitted, but a newer incarnation of its job arrived since."""
        inc, cur = Incarnation.parse(r.incarnation), self._incarnations.get(r.job_id)
        if inc is None or cur is None or inc == cur:
            return None
        self.counters.stale_refused += 1
        return StaleIncarnationError(f"job {r.job_id!r}: request of incarnation {inc} "
                                     f"dropped, the job runs as incarnation {cur} now")

    # ------------------------------------------------------------------ persist

    def _request_budget(self) -> float:
        """How long a writer's request may take here, all levels above included: each
        level may wait for its batch and need a full upload (all attempts) to flush itself
        should its parent fail; the root is ``level`` hops away."""
        c = self.config
        per_level = (self._flush_reserve() + c.persist_max_wait_s
                     + c.persist_delay_s * (2 + self.level + self.height))
        return per_level * (self.level + 2)

    def _flush_reserve(self) -> float:
        c = self.config
        return c.max_attempts * (c.upload_timeout_s + c.retry_delay_s) + 1.0

    async def persist(self, request: PersistRequest) -> Segment:
        """One writer's request; resolves to the segment holding it once durable."""
        if not isinstance(request, PersistRequest):
            raise DstlError(f"bad persist request {type(request).__name__}")
        await self._vet(request.caller)
        self._admit(request.job_id, request.caller, request.incarnation)
        if self._dead_writers_on:
            self._dead.reported(request.source, request.job_id, request.caller,
                                request.named)
            self._watch_dead_writers()
        if request.source not in self._writers:
            # registered with an earlier incarnation of this actor (Ray restarted it):
            # count it as a source again, so batches wait for it; the upstream learns of
            # us in the background (the request does not wait for that)
            self._writers[request.source] = request.job_id
            asyncio.get_running_loop().create_task(self._sync_registration())
        res = (await self._enqueue([request], request.source, self._request_budget()))[0]
        if isinstance(res, BaseException):
            raise res
        return res

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
        self.counters.requests_from_children += 1
        if budget_s is not None and sent_at is not None:
            budget_s = min(budget_s, sent_at + budget_s - time.time())
        out: list[Result | None] = [None] * len(requests)
        admitted: list[int] = []
        for i, r in enumerate(requests):  # each request still names its first sender
            try:
                if not isinstance(r, PersistRequest):
                    raise DstlError(f"bad persist request {type(r).__name__}")
                self._admit(r.job_id, r.caller, r.incarnation)
                admitted.append(i)
            except DstlError as e:
                out[i] = e
        if source not in self._children:  # registered before this actor was restarted
            self._children.add(source)
            asyncio.get_running_loop().create_task(self._sync_registration())
        # the jobs it has sources of, should its registration (and job list) be lost
        self._child_jobs[source] = self._child_jobs.get(source, frozenset()) | {
            requests[i].job_id for i in admitted}
        if admitted:
            res = await self._enqueue([requests[i] for i in admitted], source,
                                      self._request_budget() if budget_s is None
                                      else budget_s)
            for i, x in zip(admitted, res, strict=True):
                out[i] = x
        return [x for x in out if x is not None]

    async def _enqueue(self, requests: list[PersistRequest], source: str,
                       budget_s: float) -> list[Result]:
        if self._budget is None:
            self._budget = _ByteBudget(self.config.in_flight_limit)
        for r in requests:
            if not isinstance(r, PersistRequest):
                raise DstlError(f"bad persist request {type(r).__name__}")
            check_relative_path(r.job_id)
        loop = asyncio.get_running_loop()
        spans = [tracing.start_span("dstl.node", dict(r.trace), node=self.name,
                                    level=self.level, bytes=r.size, log=r.log_id,
                                    source=source)
                 for r in requests] if tracing.enabled() else None
        item = _Pending(requests, loop.create_future(), source, sum(r.size for r in requests),
                        spans)
        item.deadline = item.arrived + budget_s
        self._last_seen[source] = item.arrived
        for r in requests:
            if r.subsumed >= 0 and r.job_id in self._flush_files:
                asyncio.get_running_loop().run_in_executor(
                    None, self._flush_files[r.job_id].subsumed, r.subsumed)
            if r.checkpoint_id >= 0:
                self._first_ckpt.setdefault(r.job_id, r.checkpoint_id)
                seen = self._ckpt_seen.setdefault(r.job_id, {})
                seen[source] = max(seen.get(source, -1), r.checkpoint_id)
                self._sent_for[r.job_id] = max(self._sent_for.get(r.job_id, -1),
                                               r.checkpoint_id)
        self.counters.requests += 1
        self.metrics.request()
        self._pending.append(item)
        self._pending_bytes += item.size
        if not self._maybe_send_now() and self._timer is None:
            self._timer = loop.call_later(self._delay(), self._on_timer)
        try:
            segs = await item.future
        except BaseException as e:
            for sp in spans or ():
                tracing.end_span(sp, error=e)
            raise
        for sp, x in zip(spans or (), segs, strict=False):
            tracing.end_span(sp, error=x if isinstance(x, BaseException) else None)
        return segs

    def _delay(self) -> float:
        """``persist_delay`` after the first pending request (FLIP-158 "Implementation
        notes"), once per level below us: a child's batch cannot arrive before the child's
        own delay, so a parent that waited only ``persist_delay`` would split checkpoints
        into several files whenever some source is late."""
        return self.config.persist_delay_s * (1 + self.height)

    def _maybe_send_now(self) -> bool:
        if not self._pending:
            return False
        sources = self._sources()
        pending_sources = {p.source for p in self._pending}
        if self._pending_bytes >= self.config.persist_size_threshold:
            self.counters.sent_size += 1
        elif sources and sources <= pending_sources | self._done_sources():
            self.counters.sent_all_pending += 1
        elif self._extended and not self._late_sources():
            self.counters.sent_late_arrived += 1
        else:
            return False
        self._send_batch()
        return True

    def _on_timer(self) -> None:
        self._timer = None
        if self._pending:
            waited = time.monotonic() - self._pending[0].arrived
            left = self.config.persist_max_wait_s - waited
            if left > 0 and self._late_sources():
                if not self._extended:
                    self._extended = True
                    self.counters.waits_for_late += 1
                self._timer = asyncio.get_running_loop().call_later(left, self._on_timer)
                return
            self.counters.sent_delay += 1
            self._drop_idle_sources()
        self._send_batch()

    def _late_sources(self) -> set[str]:
        """Sources that sent a request for a job's previous checkpoint but not yet for the
        one pending here: their request is on its way, and the checkpoint cannot complete
        without it, so waiting keeps the checkpoint in one file at no cost to its duration."""
        late: set[str] = set()
        for job, cid in self._newest_checkpoints().items():
            late |= self._late_for(job, cid)
        return late

    def _newest_checkpoints(self) -> dict[str, int]:
        newest: dict[str, int] = {}
        for p in self._pending:
            for r in p.requests:
                if r.checkpoint_id >= 0:
                    newest[r.job_id] = max(newest.get(r.job_id, -1), r.checkpoint_id)
        return newest

    def _done_sources(self) -> set[str]:
        """Sources that already sent (or marked) the newest pending checkpoint of a job:
        the "every source is pending" trigger need not wait for them."""
        done: set[str] = set()
        for job, cid in self._newest_checkpoints().items():
            done |= {s for s, c in self._ckpt_seen.get(job, {}).items() if c >= cid}
        return done

    def _late_for(self, job_id: str, checkpoint_id: int) -> set[str]:
        seen = self._ckpt_seen.get(job_id, {})
        previous = max((c for c in seen.values() if c < checkpoint_id), default=None)
        sources = self._sources()
        if previous is None:
            if self._first_ckpt.get(job_id) != checkpoint_id:
                return set()
            # the job's first checkpoint here (after a deploy, a restart of this actor): the
            # sources that registered for the job and have not sent it yet. A child's first
            # forward comes after its own delay and its first calls, later than ours times
            # out. Only the first: a registered source that never sends costs one wait
            return {s for s in sources
                    if self._of_job(s, job_id) and seen.get(s, -1) < checkpoint_id}
        return {s for s, c in seen.items() if c == previous and s in sources}

    async def mark(self, job_id: str, source: str, checkpoint_id: int,
                   caller: Caller | None = None, named: int | None = None) -> None:
        """``source`` has nothing (more) to send for ``checkpoint_id``: its changes are
        durable already or it had none. A batch waiting for it stops waiting; a node that
        had no request of this checkpoint at all passes the mark to its upstream.
        ``named``: a writer's newest checkpoint with a handle (dstl_ray.dead_writers); with
        it, ``checkpoint_id`` may be -1 (a handle for no checkpoint id: only recorded)."""
        await self._vet(caller)
        self._admit(job_id, caller)
        if type(checkpoint_id) is not int or checkpoint_id < (-1 if named is not None else 0):
            raise DstlError(f"bad checkpoint id {checkpoint_id!r}")
        if named is not None and self._dead_writers_on:
            self._dead.reported(source, job_id, caller, named)
            self._watch_dead_writers()
        if checkpoint_id < 0:
            return
        seen = self._ckpt_seen.setdefault(job_id, {})
        self._first_ckpt.setdefault(job_id, checkpoint_id)
        if source in self._sources():
            seen[source] = max(seen.get(source, -1), checkpoint_id)
        if source in self._children:
            self._child_jobs[source] = self._child_jobs.get(source, frozenset()) | {job_id}
        self._last_seen[source] = time.monotonic()
        self._maybe_send_now()
        upstream = self._upstream()
        if (upstream is not None and self._sent_for.get(job_id, -1) < checkpoint_id
                and self._marked_up.get(job_id, -1) < checkpoint_id
                and not self._late_for(job_id, checkpoint_id)
                and not any(r.job_id == job_id and r.checkpoint_id == checkpoint_id
                            for p in self._pending for r in p.requests)):
            self._marked_up[job_id] = checkpoint_id
            try:
                self._actor(upstream).mark.remote(job_id, self.name, checkpoint_id, caller)
            except Exception as e:  # noqa: BLE001 - only batching suffers
                log.debug("%s: mark to %s failed: %s", self.name, upstream, e)

    def _drop_idle_sources(self) -> None:
        """A batch had to wait for the delay: forget sources silent for ``source_idle_s``
        (a killed writer process or a vanished child never unregisters), so later batches go
        out as soon as every live source is pending again. A dropped source that sends
        again is counted again (``persist`` / ``persist_batch``)."""
        if self.config.source_idle_s <= 0:
            return
        # never sooner than a few batching delays: a live source that is merely late
        # (checkpoints taken one writer after another) is still waited for
        idle_s = max(self.config.source_idle_s, 4 * self._delay())
        now = time.monotonic()
        pending = {p.source for p in self._pending}
        idle = [s for s in self._sources()
                if s not in pending and now - self._last_seen.get(s, now) > idle_s]
        for s in idle:
            self._writers.pop(s, None)
            self._children.discard(s)
            self._child_jobs.pop(s, None)
            self._last_seen.pop(s, None)
            for seen in self._ckpt_seen.values():
                seen.pop(s, None)
        if idle:
            self.counters.idle_sources_dropped += len(idle)
            log.info("%s: %d idle source(s) no longer waited for", self.name, len(idle))
            asyncio.get_running_loop().create_task(self._sync_registration())

    def _send_batch(self) -> None:
        now = time.monotonic()
        if now - self._jobs_checked > 60.0:
            self._jobs_checked = now
            self._forget_idle_jobs()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._extended = False
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        if batch:
            self.counters.batches += 1
            asyncio.get_running_loop().create_task(self._dispatch(batch))

    async def _dispatch(self, batch: list[_Pending]) -> None:
        now = time.monotonic()
        for p in batch:  # their senders gave up already: write nothing for them
            if now > p.deadline and not p.future.done():
                self.counters.deadline_expired += len(p.requests)
                p.future.set_result([self._expired(r) for r in p.requests])
        batch = [p for p in batch if not p.future.done()]
        if not batch:
            return
        requests = [r for p in batch for r in p.requests]
        total = sum(p.size for p in batch)
        spans: list[Any] = []
        for p in batch:
            wait_ms = (now - p.arrived) * 1000
            self.metrics.batch_wait(wait_ms)
            for sp in p.spans or ():
                sp.set_attribute("dstl.batch_wait_ms", wait_ms)
                sp.set_attribute("dstl.batch_bytes", total)
                sp.set_attribute("dstl.batch_requests", len(requests))
                spans.append(sp)
        assert self._budget is not None
        await self._budget.acquire(total)
        self.metrics.in_flight(self._budget.used)
        try:
            try:
                results = await self._forward_or_flush(requests, total, spans,
                                                       min(p.deadline for p in batch))
            except Exception as e:  # noqa: BLE001 - every waiter learns the cause
                results = [e] * len(requests)
            pos = 0
            for p in batch:
                mine = results[pos:pos + len(p.requests)]
                pos += len(p.requests)
                if time.monotonic() > p.deadline:
                    # its sender stopped waiting: what we wrote for it is nobody's
                    self.counters.deadline_expired += len(p.requests)
                    await self._release_late(p.requests, mine)
                    mine = [self._expired(r) for r in p.requests]
                if not p.future.done():
                    p.future.set_result(mine)
        finally:
            await self._budget.release(total)
            self.metrics.in_flight(self._budget.used)

    def _expired(self, r: PersistRequest) -> DeadlineError:
        return DeadlineError(f"persist request of log {r.log_id} (job {r.job_id}) passed its "
                             f"deadline at node {self.name}")

    async def _late_answer(self, answer: asyncio.Future, requests: list[_Released]) -> None:
        try:
            results = await asyncio.wait_for(answer, LATE_ANSWER_WAIT_S)
        except BaseException:  # noqa: BLE001 - no answer (or too late: recovery cleans up)
            return
        if isinstance(results, list) and len(results) == len(requests):
            self.counters.late_answers_released += 1
            await self._release_late(requests, results)

    async def _release_late(self, requests: list[PersistRequest] | list[_Released],
                            results: list[Result]) -> None:
        """Segments written for a sender that gave up: release them unused, so the file
        goes once nobody else in it needs it (at whichever node flushed it)."""
        for r, x in zip(requests, results, strict=True):
            if isinstance(x, BaseException):
                continue
            try:
                if x.flushed_by == self.name:
                    await self.release(r.job_id, x.path, r.log_id, False, r.caller, x.offset)
                else:
                    self._actor(x.flushed_by).release.remote(
                        r.job_id, x.path, r.log_id, False, r.caller, x.offset)
            except Exception as e:  # noqa: BLE001 - recovery's orphan cleanup covers it
                log.debug("%s: cannot release late segment %s: %s", self.name, x.path, e)

    async def _forward_or_flush(self, requests: list[PersistRequest], total: int,
                                spans: list[Any] | None = None,
                                deadline: float = float("inf")) -> list[Result]:
        from topology.routing import should_flush

        flush = should_flush(self.parent is not None, total, self.config.flush_bytes)
        if self.parent is not None and flush != self._flushes_self:
            self._flushes_self = flush
            await self._sync_registration()
        # the parent gets what is left of our deadline, less what we need to flush ourselves
        # should it fail: then no level's timeout expires together with its parent's
        budget = deadline - time.monotonic() - self._flush_reserve() - REPLY_GRACE_S
        if not flush and budget > 0:
            target = self._upstream()
            assert target is not None
            for sp in spans or ():
                sp.set_attribute("dstl.action", "forward")
                sp.set_attribute("dstl.target", target)
                sp.set_attribute("dstl.bypass", target != self.parent)
            if spans:  # the next level's spans become children of ours
                requests = [dataclasses.replace(r, trace=tuple(tracing.carrier(sp).items()))
                            for r, sp in zip(requests, spans, strict=True)]
            try:
                segs = await self._forward(target, requests, budget)
            except Exception as e:  # noqa: BLE001 - upstream unreachable
                self._handles.pop(target, None)
                if target != self.parent:
                    # any failure drops the routing decision; go the normal way once more
                    self.counters.route_failures += 1
                    log.warning("%s: routed send to %s failed (%s); back to parent %s",
                                self.name, target, e, self.parent)
                    self._drop_route()
                    await self._sync_registration()
                    self.metrics.error("route")
                    return await self._forward_or_flush(requests, total, spans, deadline)
                self.counters.forward_failures += 1
                self.metrics.error("forward")
                self._registered_to, self._registered_jobs = None, frozenset()
                log.warning("%s: forwarding to %s failed (%s); flushing to DFS myself",
                            self.name, self.parent, e)
                for sp in spans or ():
                    sp.add_event("parent unreachable, flushing myself", {"error": str(e)})
                return await self._flush(requests, spans)
            self.counters.forwards += 1
            self.counters.bytes_forwarded += total
            self.metrics.forwarded(total, bypass=target != self.parent)
            if target != self.parent:
                self.counters.routed_direct += 1
                self._route_left -= 1
                if self._route_left <= 0:
                    self._drop_route()  # horizon used up: next batch goes via the parent
                    await self._sync_registration()
            else:
                await self._learn_route([x for x in segs if isinstance(x, Segment)])
            return await self._flush_failed(requests, segs, spans)
        return await self._flush(requests, spans)

    async def _flush_failed(self, requests: list[PersistRequest], results: list[Result],
                            spans: list[Any] | None) -> list[Result]:
        """Requests the upstream could not write (its DFS failed, or it was too late) are
        flushed here: slower, never lost. Refusals (namespace, incarnation) stand."""
        redo = [i for i, x in enumerate(results)
                if isinstance(x, (StorageError, DeadlineError))]
        if not redo:
            return results
        for i in redo:
            log.warning("%s: upstream failed request of job %s (%s); flushing it myself",
                        self.name, requests[i].job_id, results[i])
        again = await self._flush([requests[i] for i in redo],
                                  [spans[i] for i in redo] if spans else None)
        out = list(results)
        for i, x in zip(redo, again, strict=True):
            out[i] = x
        return out

    async def _learn_route(self, segs: list[Segment]) -> None:
        """Up-front routing: if an ancestor above our parent flushed this batch, send the
        next ``routing_horizon`` batches straight to it; when the horizon is used up, go
        through the parent again and decide anew."""
        horizon = self.config.routing_horizon
        flusher = segs[0].flushed_by if segs else None
        if horizon > 0 and flusher and flusher not in (self.name, self.parent):
            self._route, self._route_left = flusher, horizon
            await self._sync_registration()

    async def _forward(self, target: str, requests: list[PersistRequest], budget_s: float
                       ) -> list[Result]:
        """``target`` writes nothing for us after ``budget_s`` and releases what it wrote
        late; we wait a little longer for an answer already on its way. An answer later
        still (a parent paused past its deadline and the grace) is released unused when it
        comes: we flushed those requests ourselves, nobody will name its segments."""
        ref = self._actor(target).persist_batch.remote(requests, self.name, budget_s,
                                                       time.time())
        answer = asyncio.wrap_future(ref.future())
        try:
            segs = await asyncio.wait_for(asyncio.shield(answer), budget_s + REPLY_GRACE_S)
        except TimeoutError:
            keys = [_Released(r.job_id, r.log_id, r.caller) for r in requests]
            task = asyncio.get_running_loop().create_task(self._late_answer(answer, keys))
            self._late_answers.add(task)
            task.add_done_callback(self._late_answers.discard)
            raise
        if len(segs) != len(requests):
            raise DstlError(f"{target} returned {len(segs)} results for "
                            f"{len(requests)} requests")
        return segs

    async def _flush(self, requests: list[PersistRequest], spans: list[Any] | None = None
                     ) -> list[Result]:
        """Write ONE file per job holding every request of the batch. Jobs are independent
        ("Many jobs, one tree"): a job whose write fails gets its error, the others their
        segments; a request of a job's older incarnation is not written at all."""
        by_job: dict[str, list[int]] = {}
        out: list[Result | None] = [None] * len(requests)
        for i, r in enumerate(requests):
            out[i] = self._stale(r)
            if out[i] is None:
                by_job.setdefault(r.job_id, []).append(i)

        async def one_job(job_id: str, idx: list[int]) -> None:
            sections = [requests[i].section for i in idx]
            data, offsets = assemble_file(sections)
            rel = f"dstl/{self.node_key}/{uuid.uuid4().hex}{FILE_SUFFIX}"
            path = join(self.base_path, job_id, rel)
            job_dir = join(self.base_path, job_id) + "/"
            job_spans = [spans[i] for i in idx] if spans else []
            for sp in job_spans:
                sp.set_attribute("dstl.action", "flush")
                sp.set_attribute("dstl.file", rel)
            if self._merging.across:
                await self._append(job_id, idx, requests, data, offsets, out, job_spans)
                return
            attempts0 = self._uploader.stats.attempts
            t0 = time.monotonic()
            with tracing.span("dstl.dfs.put",
                              tracing.carrier(job_spans[0]) if job_spans else None,
                              links=[tracing.link_to(tracing.carrier(sp))
                                     for sp in job_spans[1:]],
                              node=self.name, level=self.level, file=rel, bytes=len(data),
                              logs=len(idx)) as put:
                try:
                    # a retry or hedge may win under its own name: use the name that landed
                    path = await asyncio.to_thread(
                        self._uploader.write, path, data,
                        tracing.carrier(put) if put is not None else None)
                    rel = check_relative_path(path[len(job_dir):])
                except StorageError as e:
                    self.counters.flush_failures += 1
                    self.metrics.error("dfs")
                    if put is not None:
                        put.set_attribute("dstl.error", str(e))
                    raise
                finally:
                    if put is not None:
                        put.set_attribute("dstl.attempts",
                                          self._uploader.stats.attempts - attempts0)
            self.metrics.dfs_request(len(data), (time.monotonic() - t0) * 1000, len(idx))
            self.counters.files_flushed += 1
            self.counters.bytes_flushed += len(data)
            # one entry per section: a log may have two requests in one batch (a
            # pre-emptive upload and the checkpoint's); each is released on its own
            self._files[path] = ({(requests[i].log_id, off)
                                  for i, off in zip(idx, offsets, strict=True)}, [False])
            for i, off in zip(idx, offsets, strict=True):
                s = requests[i].section
                out[i] = Segment(rel, off, len(s.data), s.sqn_min, s.sqn_max, self.name)

        errors = await asyncio.gather(*(one_job(j, idx) for j, idx in by_job.items()),
                                      return_exceptions=True)
        for idx, e in zip(by_job.values(), errors, strict=True):
            if isinstance(e, BaseException):
                for i in idx:
                    out[i] = e if isinstance(e, DstlError) else StorageError(
                        f"flush of job {requests[i].job_id} failed at node {self.name}: "
                        f"{type(e).__name__}: {e}")
        assert all(x is not None for x in out)
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ release

    def _job_files(self, job_id: str) -> FlushFiles:
        """The job's merged files of its current incarnation, in
        ``segments/{incarnation}/{node}/`` (``none`` for writers outside a coordinated job)."""
        ff = self._flush_files.get(job_id)
        if ff is None:
            inc = self._incarnations.get(job_id)
            ff = self._flush_files[job_id] = FlushFiles(
                self._storage, join(self.base_path, job_id),
                f"{SEGMENTS_DIR}/{inc or UNMANAGED_DIR}/{self.node_key}", self._merging)
            for log_id, bound in self._dead.bounds_for(job_id).items():
                ff.forget(log_id, bound)  # (no files yet: nothing written)
        return ff

    async def _append(self, job_id: str, idx: list[int], requests: list[PersistRequest],
                      data: bytes, offsets: list[int], out: list[Segment | None],
                      spans: list[Any]) -> None:
        """FLIP-306 across checkpoints: the flush goes to the end of this node's open file
        for the job; section offsets shift by where it landed."""
        ff = self._job_files(job_id)
        t0 = time.monotonic()
        with tracing.span("dstl.dfs.append",
                          tracing.carrier(spans[0]) if spans else None,
                          node=self.name, level=self.level, bytes=len(data), logs=len(idx)):
            parts = [(requests[i].log_id, off) for i, off in zip(idx, offsets, strict=True)]
            for attempt in range(1, self.config.max_attempts + 1):
                try:  # a failed append closes its file; the next attempt takes a new one
                    rel, base = await asyncio.to_thread(ff.append, data, parts)
                    break
                except DstlError as e:
                    self.counters.flush_failures += 1
                    self.metrics.error("dfs")
                    if attempt == self.config.max_attempts:
                        raise StorageError(f"cannot append to a merged file of {job_id} "
                                           f"after {attempt} attempts: {e}") from e
                    await asyncio.sleep(self.config.retry_delay_s)
        self.metrics.dfs_request(len(data), (time.monotonic() - t0) * 1000, len(idx))
        self.counters.files_flushed += 1
        self.counters.bytes_flushed += len(data)
        for sp in spans:
            sp.set_attribute("dstl.file", rel)
        for i, off in zip(idx, offsets, strict=True):
            s = requests[i].section
            out[i] = Segment(rel, base + off, len(s.data), s.sqn_min, s.sqn_max, self.name)

    # ------------------------------------------------------------------ dead writers

    @property
    def _dead_writers_on(self) -> bool:
        return self._merging.across and self.config.dead_writer_check_s > 0

    def _watch_dead_writers(self) -> None:
        """Start (once) the periodic check for writers whose process died."""
        if self._dead_watch is None and self._dead_writers_on:
            self._dead_watch = asyncio.get_running_loop().create_task(self._dead_loop())

    async def _dead_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.dead_writer_check_s)
            try:
                await self.release_dead_writers()
            except Exception as e:  # noqa: BLE001 - tried again next round
                log.warning("%s: dead-writer check failed: %s: %s", self.name,
                            type(e).__name__, e)

    async def _vet(self, caller: Caller | None) -> None:
        """A writer's driver process (its Ray job) first seen here is looked up once: found
        dead, it is fenced here too. A node restarted by Ray, or one that joined after a
        release round, never got that round's fence; a process Ray took for dead must not
        make a handle here that names sections released already."""
        if (not self._dead_writers_on or caller is None or not caller.driver
                or not caller.ray_job):
            return
        rj = caller.ray_job
        if rj in self._dead.vetted or rj in self._dead.fenced:
            return
        dead = await asyncio.to_thread(dead_ray_job_ids, {rj})
        if dead is None:
            return  # no answer: looked up again on its next call
        if len(self._dead.vetted) >= VETTED_MAX:
            self._dead.vetted.clear()  # bounded: the oldest are simply looked up again
        self._dead.vetted.add(rj)
        if rj in dead:
            self._dead.fenced.add(rj)

    async def release_dead_writers(self) -> int:
        """Release the merged-file sections of writers whose process died
        (dstl_ray.dead_writers): fence each dead Ray job at every node, then release its
        logs up to their bounds everywhere. Returns how many logs were released."""
        ids = self._dead.candidates()
        if not ids:
            return 0
        dead = await asyncio.to_thread(dead_ray_job_ids, ids)
        if not dead:
            return 0
        n = 0
        for ray_job in sorted(dead):
            n += await self._release_ray_job(ray_job)
        return n

    async def _call_all(self, method: str, *args: Any) -> list[Any]:
        """``method`` on every node actor of the tree (this one directly); any failure
        raises, so a round either reached every node or is put off."""
        from topology.discovery import list_node_actors

        names = await asyncio.to_thread(list_node_actors, self.config.namespace)
        if self.name not in names:
            names.append(self.name)
        out = []
        for name in names:
            if name == self.name:
                out.append(await getattr(self, method)(*args))
            else:
                out.append(await asyncio.wait_for(
                    getattr(self._actor(name), method).remote(*args), REGISTRATION_TIMEOUT_S))
        return out

    async def _release_ray_job(self, ray_job: str) -> int:
        try:
            answers = await self._call_all("fence_ray_job", ray_job)
            bounds, skipped = bounds_of(answers)
            await self._call_all("forget_logs", ray_job, bounds)
        except Exception as e:  # noqa: BLE001 - every node or none: next round
            self.counters.dead_writer_rounds_failed += 1
            log.warning("%s: releasing the writers of dead Ray job %s put off: %s: %s",
                        self.name, ray_job, type(e).__name__, e)
            return 0
        self._dead.skipped += skipped
        n = sum(len(v) for v in bounds.values()) - skipped
        log.info("%s: Ray job %s is dead: %d of its logs released, %d kept", self.name,
                 ray_job, n, skipped)
        return n

    async def fence_ray_job(self, ray_job: str) -> dict[str, Any]:
        """Phase 1: refuse ``ray_job`` from now on; its writers' records here."""
        return self._dead.fence(ray_job)

    async def forget_logs(self, ray_job: str, bounds: dict[str, dict[str, int]]) -> None:
        """Phase 2: release these logs' sections up to their bounds (per job)."""
        self._dead.forget(ray_job, bounds)
        for job_id, logs in bounds.items():
            ff = self._flush_files.get(job_id)
            if ff is not None:
                for log_id, bound in logs.items():
                    await asyncio.to_thread(ff.forget, log_id, bound)

    async def retain(self, job_id: str, rel_path: str, offset: int, log_id: str,
                     caller: Caller | None = None, incarnation: str = "") -> bool:
        """A restored writer's backend names an older section of a merged file (see
        :meth:`FlushFiles.retain`); it releases it like its own uploads."""
        await self._vet(caller)
        self._admit(job_id, caller, incarnation)
        ff = self._flush_files.get(job_id)
        rel = check_relative_path(rel_path)
        if ff is None or not ff.owns(rel):
            return False
        return await asyncio.to_thread(ff.retain, rel, offset, log_id)

    async def release(self, job_id: str, rel_path: str, log_id: str, used: bool,
                      caller: Caller | None = None, offset: int = 0,
                      last_checkpoint: int = -1) -> bool:
        """A writer no longer needs its segment of ``rel_path``. Once every log in the file
        released it and none of them gave it out in a handle, the file is deleted (a
        pre-emptive upload that no checkpoint used). Returns True if the file was deleted."""
        self._admit(job_id, caller)
        path = join(self.base_path, job_id, check_relative_path(rel_path))
        ff = self._flush_files.get(job_id)
        if ff is not None and ff.owns(rel_path):
            await asyncio.to_thread(ff.release, rel_path, offset, log_id, used,
                                    last_checkpoint)
            return False
        entry = self._files.get(path)
        if entry is None:
            return False
        logs, kept = entry
        logs.discard((log_id, offset))
        kept[0] = kept[0] or used
        if logs:
            return False
        del self._files[path]
        if kept[0]:
            return False
        await asyncio.to_thread(self._storage.delete, path)
        self.counters.files_deleted += 1
        return True

    # ------------------------------------------------------------------ membership (root)

    def _start_watcher(self) -> None:
        if (self.parent is None and self._watcher is None
                and self.config.membership_interval_s > 0):
            self._watcher = asyncio.get_running_loop().create_task(self._watch_membership())

    async def _watch_membership(self) -> None:
        """Root only: attach nodes that joined Ray as leaves; re-attach the children of
        nodes that left (docs/architecture.md "Tree": the tree is static between membership changes)."""
        from topology.membership import reconcile

        while self.parent is None:
            await asyncio.sleep(self.config.membership_interval_s)
            try:
                self._order = await asyncio.to_thread(
                    reconcile, self.base_path, self.config, self._order)
            except Exception as e:  # noqa: BLE001 - try again next round
                log.warning("%s: membership check failed: %s", self.name, e)

    async def set_fault_spec(self, spec: str) -> None:
        """Testing hook (chaos harness, experiments): replace this node's DFS fault injection
        (``fault_spec`` syntax, "" for none) for later uploads; in-flight ones keep theirs."""
        cfg = dataclasses.replace(self.config, fault_spec=spec)  # validates
        self._storage = storage_for(self.base_path, cfg)
        self._uploader.storage = self._storage  # later attempts (and their cleanup) use it
        for ff in self._flush_files.values():
            ff.storage = self._storage

    async def spans(self, clear: bool = False) -> list[dict[str, Any]]:
        """Spans finished in this actor (tracing ``memory`` mode)."""
        return tracing.finished_spans(clear)

    async def shutdown(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        self._uploader.close()
