"""The executor side of :class:`~spark_glue.operator.KeyedStatefulOperator`: one Spark task per
operator subtask, running in a Spark Python worker process.

Each worker process caches the backend of every subtask it ran (docs/architecture.md "Spark glue"), so a
micro-batch normally applies its rows to state already in memory and only uploads the changes
(FLIP-158 "Performing a checkpoint"). The cache is trusted only when it holds exactly the state
of the checkpoint the driver says is the latest complete one, in the driver's current epoch; a
retried task, a task that lands in another process, or a replay after a driver restart finds
no such entry and restores from that checkpoint (FLIP-158 "Recovery and rescaling"). A task
that fails half-way marks its entry dirty, so no later task builds on half-applied rows.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from dstl_ray.checkpoint.recovery import assign_sources, check_key_hash, load_checkpoint
from dstl_ray.key_hashes import key_hash_named
from dstl_ray.keygroups import key_group_range_for_subtask
from dstl_ray.state.backend import ChangelogKeyedStateBackend
from dstl_ray.state.ttl import StateTtlConfig

from .archives import keep_spark_archive_indexes
from .initial_frame import load, split
from .placement import executor_id
from .routing import Groups, group_by_key, read_payloads, rows_of
from .timers import TimerContext, TimerService, max_event_time_ms
from .vectorized import apply_pandas, outputs_to_ipc
from .views import KeyedState

log = logging.getLogger(__name__)

UpdateFn = Callable[[Any, list[Any], "KeyedState"], Iterable[Any] | None]


@dataclass(frozen=True)
class TaskSpec:
    """What every task of one micro-batch needs (shipped to the workers with the closure)."""

    job_id: str
    operator_id: str
    namespace: str
    gcs_address: str
    parallelism: int
    max_parallelism: int
    materialization_interval: float | None
    update: UpdateFn
    batch_id: int
    epoch: str
    restore_id: int  # latest complete checkpoint (-1: none, start empty)
    restore_url: str | None
    persist_timeout_s: float = 120.0
    # FLIP-306 4.4: the coordinator's subsumed watermark, so merged files are freed on the
    # executors (each batch carries it: a lost one is made good by the next)
    subsumed_watermark: int = -1
    # the driver's Ray namespace: workers speak for the job of that driver (node actors
    # admit a job only from its own namespace); a worker's own namespace is whatever it
    # first connected with
    caller_namespace: str = ""
    # the driver's run of the job (dstl_ray.checkpoint.lease): requests carry it, so node actors keep
    # the job's state per run and never free a new run's merged files with an old one's
    # knowledge
    incarnation: str = ""
    # state name -> its TTL (dstl_ray.state.ttl): the operator's state_ttl
    state_ttl: tuple[tuple[str, StateTtlConfig], ...] = ()
    # the state table of every subtask ("heap" | "rocksdb") and its local directory
    state_backend: str = "heap"
    local_dir: str | None = None
    # the key column, and the update API: "rows" (per key, Row objects) or "pandas"
    # (spark_glue.vectorized)
    key: str = ""
    api: str = "rows"
    # timers (spark_glue.timers): the function a due timer calls, the event-time column,
    # the watermark's allowed delay, and the largest event time of the restore checkpoint
    on_timer: Callable[..., Any] | None = None
    event_time: str | None = None
    allowed_delay_ms: int = 0
    event_time_ms: int | None = None
    # the batch's processing time (ms), chosen by the driver (a replay reuses the original's)
    now_ms: int = 0
    # per subtask, the attempt whose snapshot the restore checkpoint holds (empty: unknown):
    # a cached backend of another attempt of that batch (a duplicate task) is not trusted
    attempts: tuple[str, ...] = ()
    # restore_url is the operator's initial_state (another job's checkpoint): the restored
    # state is materialized into the job's own files before the batch's snapshot
    initial: bool = False
    # the timers' outputs go apart from the update's (the operator's timer_output_schema)
    timer_outputs_apart: bool = False
    # declared state types (name, canonical DDL) and dropped states (spark_glue.state_shapes)
    state_schema: tuple[tuple[str, str], ...] = ()
    drop_state: tuple[str, ...] = ()
    # the batch carries the operator's initial_state DataFrame: (state, column) to load
    # from its rows first (spark_glue.initial_frame)
    initial_columns: tuple[tuple[str, str], ...] = ()
    # how the job's keys become key groups (dstl_ray.key_hashes), the name its checkpoints
    # record
    key_hash: str = "blake2b"


@dataclass
class _Entry:
    backend: ChangelogKeyedStateBackend
    epoch: str
    holds: int | None  # the checkpoint id whose state the backend holds; None = dirty
    busy: bool = False  # handed to a task that has not finished yet (it may run in a thread)
    timers: TimerService | None = None  # built from the backend's state on first use
    attempt: str = ""  # the task attempt that left the state it holds

    def close(self) -> None:
        """Close the timers' index, then the backend (the index lives beside its state)."""
        try:
            if self.timers is not None:
                self.timers.close()
        finally:
            self.backend.close()

    def usable(self, spec: TaskSpec, index: int) -> bool:
        """Holds exactly the restore checkpoint's state, in the driver's current epoch, left
        by the attempt whose snapshot that checkpoint took."""
        return (self.epoch == spec.epoch and self.holds == spec.restore_id
                and (len(spec.attempts) != spec.parallelism
                     or self.attempt == spec.attempts[index]))

    def dead_for(self, spec: TaskSpec) -> bool:
        """No task of ``spec``'s epoch can ever use this entry of another subtask, so it may be
        closed. Within one epoch the driver's restore checkpoint only grows (a replay or a
        failed batch starts a new epoch), so an entry is dead if it is of another epoch, is
        dirty (half-applied rows of a failed task), or holds a checkpoint older than
        ``spec.restore_id``. An entry holding the restore checkpoint serves its subtask in
        this batch; one holding a newer one (this batch's, its subtask ran here first) serves
        it in the next. A busy entry belongs to a running task and is never taken from it."""
        if self.busy:
            return False
        if self.epoch != spec.epoch or self.holds is None:
            return True
        return self.holds < spec.restore_id


@dataclass
class _Cache:
    lock: threading.Lock = field(default_factory=threading.Lock)
    clients: dict[tuple[str, str], Any] = field(default_factory=dict)
    entries: dict[tuple[str, str, int, int], _Entry] = field(default_factory=dict)


_CACHE = _Cache()


def _client(spec: TaskSpec) -> Any:
    from dstl_ray.log.client import StateChangelogClient

    from .nearest import connect

    connect(spec.gcs_address, spec.namespace)
    key = (spec.namespace, spec.job_id, spec.caller_namespace)
    with _CACHE.lock:
        c = _CACHE.clients.get(key)
        if c is None:
            c = _CACHE.clients[key] = StateChangelogClient(
                spec.job_id, namespace=spec.namespace,
                caller_namespace=spec.caller_namespace or None)
        return c


def _restore(spec: TaskSpec, index: int, client: Any) -> ChangelogKeyedStateBackend:
    kgr = key_group_range_for_subtask(spec.max_parallelism, spec.parallelism, index)
    sources = []
    if spec.restore_url is not None:
        cc = load_checkpoint(spec.restore_url)
        check_key_hash(cc, spec.key_hash)
        sources = assign_sources(cc, spec.operator_id, spec.parallelism)[index]
    backend = ChangelogKeyedStateBackend(client, spec.operator_id, kgr, spec.max_parallelism,
                                         key_hash=key_hash_named(spec.key_hash),
                                         restore=sources,
                                         materialization_interval=spec.materialization_interval,
                                         incarnation=spec.incarnation,
                                         state_backend=spec.state_backend,
                                         local_dir=spec.local_dir)
    try:
        for name in spec.drop_state:  # once per lineage (a retry keeps what came since)
            backend.schemas.drop(name, once=True)
        backend.schemas.declare(dict(spec.state_schema))  # restored states migrate now
        if spec.initial:  # no snapshot of this job may name the other job's files
            backend.materialize_now()
    except BaseException:
        backend.close()  # (its writer would stay a source its node waits for)
        raise
    return backend


def backend_for(spec: TaskSpec, index: int, retry: bool, client: Any
                ) -> tuple[_Entry, float]:
    """The cached backend of subtask ``index`` if it holds exactly the restore checkpoint's
    state in this epoch (and the task is not a retry), else a freshly restored one. The
    returned entry is marked dirty and busy until the caller finishes the batch
    (:func:`release`)."""
    key = (spec.namespace, spec.job_id + "/" + spec.operator_id, spec.parallelism, index)
    with _CACHE.lock:
        e = _CACHE.entries.get(key)
        # entries of this operator that can never be used again (_Entry.dead_for) are
        # closed: their writers would stay registered sources of the node actor, and its
        # "every source is pending" trigger would wait for them (one file per checkpoint);
        # entries of other subtasks that a later task of this epoch can still use stay
        stale = [k for k, x in _CACHE.entries.items() if k != key and k[:2] == key[:2]
                 and x.dead_for(spec)]
        dropped = [_CACHE.entries.pop(k) for k in stale]
        reuse = e is not None and not retry and e.usable(spec, index)
        if reuse:
            e.holds, e.busy = None, True
        elif e is not None:
            del _CACHE.entries[key]
    for x in dropped:
        try:
            x.close()
        except Exception as e:  # noqa: BLE001 - one stale entry must not keep the others
            log.warning("closing a stale state entry: %s", e)
    if reuse:
        return e, 0.0
    if e is not None:
        e.close()
    t0 = time.perf_counter()
    backend = _restore(spec, index, client)
    restore_s = time.perf_counter() - t0
    e = _Entry(backend, spec.epoch, None, busy=True)
    with _CACHE.lock:
        _CACHE.entries[key] = e
    return e, restore_s


def release(entry: _Entry, holds: int | None, attempt: str = "") -> None:
    """The task attempt ``attempt`` using ``entry`` finished: it now holds checkpoint
    ``holds`` (None: the task failed half-way, the entry stays dirty and is closed by a
    later task)."""
    with _CACHE.lock:
        entry.holds, entry.busy, entry.attempt = holds, False, attempt


def apply_rows(update: UpdateFn, groups: Groups, backend: ChangelogKeyedStateBackend,
               ttl: Mapping[str, StateTtlConfig], timers: TimerContext | None = None
               ) -> list[Any]:
    """The per-key API: ``update(key, rows, state)`` once per key, rows as ``Row`` objects."""
    rows = rows_of(groups.table)
    off = groups.offsets
    outputs: list[Any] = []
    handles: dict[tuple[type, str], Any] = {}
    for i, key in enumerate(groups.keys):
        out = update(key, rows[off[i]:off[i + 1]],
                     KeyedState(backend, key, ttl, timers, handles))
        if out is not None:
            outputs.extend(out)
    return outputs


def fire_timers(spec: TaskSpec, ctx: TimerContext, backend: ChangelogKeyedStateBackend,
                ttl: Mapping[str, StateTtlConfig]) -> list[Any]:
    """Call ``on_timer(key, timer, state)`` for every timer due in this batch, earliest
    first; what the calls return, in order."""
    outputs: list[Any] = []
    handles: dict[tuple[type, str], Any] = {}
    for timer in ctx.service.due(ctx.watermark_ms, ctx.now_ms):
        out = spec.on_timer(timer.key, timer, KeyedState(backend, timer.key, ttl, ctx, handles))
        if out is None:
            continue
        if spec.api == "pandas" and hasattr(out, "columns"):  # one DataFrame or Arrow table
            outputs.append(out)
        else:
            outputs.extend(out)
    return outputs


def timer_context(spec: TaskSpec, entry: _Entry, groups: Groups) -> tuple[TimerContext | None,
                                                                          int | None]:
    """This batch's timers of the subtask (None: the operator has no on_timer) and the
    largest event time seen so far (the driver's, and this subtask's rows')."""
    seen = spec.event_time_ms
    if spec.event_time is not None:
        mine = max_event_time_ms(groups.table, spec.event_time)
        if mine is not None:
            seen = mine if seen is None else max(seen, mine)
    if spec.on_timer is None:
        return None, seen
    if entry.timers is None:
        entry.timers = TimerService(entry.backend, spec.state_backend, spec.local_dir)
    watermark = None if seen is None else seen - spec.allowed_delay_ms
    return TimerContext(entry.timers, watermark, spec.now_ms), seen


_COUNTS = ("timers_registered", "timers_fired", "ttl_evicted")


def _counts(entry: _Entry) -> tuple[int, int, int]:
    """The subtask's counters behind the per-batch :data:`_COUNTS` (their differences)."""
    t = entry.timers
    return (t.registered if t else 0, t.fired if t else 0, entry.backend.ttl_evicted)


def run_partition(spec: TaskSpec, index: int, payloads: Iterator[Any]
                  ) -> Iterator[dict[str, Any]]:
    """Apply one subtask's rows of the micro-batch (its Arrow payloads, spark_glue.routing),
    snapshot, and report the snapshot."""
    t0 = time.perf_counter()
    keep_spark_archive_indexes()  # this worker's next tasks start sooner
    table, initial = split(read_payloads(index, payloads), spec.initial_columns)
    yield run_subtask(spec, index, table, initial, t0)


def run_batches(spec: TaskSpec, index: int, batches: Iterable[Any]) -> dict[str, Any]:
    """:func:`run_partition` of a subtask whose rows Spark's JVM routed
    (spark_glue.jvm_route): its partition's Arrow record batches, every row one of its key
    groups' (a row of another subtask's key group fails at its first state access, which
    checks the backend's range)."""
    import pyarrow as pa

    t0 = time.perf_counter()
    keep_spark_archive_indexes()
    kept = [b for b in batches if b.num_rows]
    return run_subtask(spec, index, pa.Table.from_batches(kept) if kept else None, None, t0)


def run_subtask(spec: TaskSpec, index: int, table: Any, initial: Any, t0: float
                ) -> dict[str, Any]:
    """Subtask ``index``'s part of the micro-batch: ``initial`` (the initial state's rows,
    spark_glue.initial_frame) loaded, ``table``'s rows applied (None: no rows), due timers
    fired, a snapshot persisted; its result for the driver (``t0``: when the task began)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    attempt = ctx.attemptNumber() if ctx else 0
    # PySpark has no stage attempt number: a re-run of a task that succeeded in an earlier
    # stage attempt finds its entry holding this batch (not the restore checkpoint): restore
    stage_attempt = getattr(ctx, "stageAttemptNumber", lambda: 0)() if ctx else 0
    attempt_id = uuid.uuid4().hex  # this attempt, told from a duplicate
    groups = group_by_key(table, spec.key)
    t_read = time.perf_counter() - t0
    client = _client(spec)
    entry, restore_s = backend_for(spec, index, attempt > 0 or stage_attempt > 0, client)
    backend = entry.backend
    holds: int | None = None
    outputs: list[Any] = []
    output_ipc: list[bytes | None] = []
    timer_outputs: list[Any] = []  # the timers', when they go apart from the update's
    timer_ipc: list[bytes | None] = []
    try:
        loaded, t_load, cpu_load = 0, time.perf_counter(), time.thread_time()
        if initial is not None:  # before the batch's own rows
            loaded = load(backend, initial, spec.key, spec.initial_columns,
                          dict(spec.state_ttl))
        t_load, cpu_load = time.perf_counter() - t_load, time.thread_time() - cpu_load
        ttl = dict(spec.state_ttl)
        timers, seen = timer_context(spec, entry, groups)
        before = _counts(entry)
        if spec.api == "pandas":
            output_ipc = [apply_pandas(spec.update, groups, backend, ttl, timers)]
        else:
            outputs = apply_rows(spec.update, groups, backend, ttl, timers)
        if timers is not None:
            fired = fire_timers(spec, timers, backend, ttl)
            ipc = outputs_to_ipc(fired) if fired and spec.api == "pandas" else None
            if spec.timer_outputs_apart:
                timer_outputs, timer_ipc = (fired, []) if spec.api == "rows" else ([], [ipc])
            elif spec.api == "pandas":
                output_ipc.append(ipc)
            else:
                outputs.extend(fired)
        t1 = time.perf_counter()
        backend.notify_checkpoint_subsumed(spec.subsumed_watermark)
        snap = backend.snapshot(checkpoint_id=spec.batch_id).result(
            timeout=spec.persist_timeout_s)
        snap = dataclasses.replace(snap, event_time_ms=seen, processing_time_ms=spec.now_ms)
        t2 = time.perf_counter()
        metrics = {"state_rows": backend.entries(), "state_bytes": snap.state_size(),
                   "initial_keys": loaded, "initial_load_ms": round(t_load * 1000, 3),
                   "initial_load_cpu_ms": round(cpu_load * 1000, 3),
                   **{k: a - b for k, a, b in zip(_COUNTS, _counts(entry), before,
                                                  strict=True)}}
        holds = spec.batch_id
    finally:
        release(entry, holds, attempt_id)
    return {
        "index": index, "attempt_id": attempt_id, "snapshot": json.dumps(snap.to_dict()),
        "outputs": outputs, "output_ipc": output_ipc, "timer_outputs": timer_outputs,
        "timer_ipc": timer_ipc, "rows": groups.rows, "keys": len(groups.keys),
        "attempt": attempt, "stage_attempt": stage_attempt, "read_s": t_read,
        "restore_s": restore_s, "apply_s": t1 - t0 - restore_s - t_read, "snapshot_s": t2 - t1,
        "node": client.node_name, "chosen_by": getattr(client.transport, "chosen_by", ""),
        "raylet_pid": os.environ.get("RAY_RAYLET_PID", ""), "pid": os.getpid(),
        "executor": executor_id(),
        "materializations": backend.materializations, "metrics": metrics,
    }
