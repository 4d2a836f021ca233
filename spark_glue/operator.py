"""A stateful keyed operator for Structured Streaming's ``foreachBatch``, on dstl-ray state.

>>> op = KeyedStatefulOperator("user-counts", key="user", update=count_and_sum,
...                            namespace="dstl_ray")                       # doctest: +SKIP
>>> stream.writeStream.foreachBatch(op).option("checkpointLocation", loc).start()  # doctest: +SKIP

Each micro-batch is one checkpoint whose id is the batch id. The batch's rows are routed to
``parallelism`` subtasks by key group (the job's key hash ``% max_parallelism``, Flink's range
split); each subtask is a Spark task that applies the user's update function to its keys'
state (a :class:`~dstl_ray.ChangelogKeyedStateBackend` cached in the Python worker), then
persists its changes through the nearest node actor and returns its snapshot. The driver
completes checkpoint ``batch_id`` only when every subtask's snapshot arrived (FLIP-158
"Performing a checkpoint"), and only then hands the batch's outputs to the sink; the batch
returns and Spark writes its commit log after that.

Exactly-once state: a retried task restores from the latest complete checkpoint instead of
trusting its cache; a failed batch bumps the epoch so no cached state survives it; a batch
Spark replays after a driver restart (its checkpoint completed but Spark's commit did not)
drops that checkpoint and recomputes it from the previous one, as Spark's own state stores
reload version ``batch_id`` (so the outputs are produced again for the sink). The sink must be
idempotent by batch id, as Spark's foreachBatch documentation asks. Spark replays only its
last batch; a batch id older than the latest complete checkpoint means the query is not the
one that wrote the checkpoints (see :func:`is_replay`) and fails without deleting anything.
A batch id above the latest checkpoint's plus one (the job's state is gone: a new or emptied
base path under an old ``checkpointLocation``) fails before any task runs, unless the
operator was told to start over (``on_missing_state``; see :func:`missing_state`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dstl_ray.checkpoint.coordinator import CheckpointCoordinator
from dstl_ray.errors import ConfigError, StateError
from dstl_ray.state.snapshot import KeyedStateSnapshot
from dstl_ray.state.table import STATE_BACKENDS
from dstl_ray.state.ttl import StateTtlConfig

from .combine import Combine, check_combine
from .data_path import DataPath
from .initial import InitialState
from .initial_frame import InitialFrame, is_frame
from .job_key_hash import JobKeyHash
from .placement import Placement
from .progress import ProgressMetrics
from .replay import ON_MISSING_STATE, is_replay, missing_state, snapshot_time
from .sinks import Outputs, Sink
from .state_shapes import check_against, drop_spec, schema_spec
from .stats import BatchHistory, BatchStats
from .ticks import drop_ticks
from .timers import TIMERS_STATE
from .worker import TaskSpec, UpdateFn

log = logging.getLogger(__name__)



def ttl_spec(state_ttl: Mapping[str, StateTtlConfig | float] | None
             ) -> tuple[tuple[str, StateTtlConfig], ...]:
    """The operator's ``state_ttl`` as tasks carry it, checked on the driver (a bad TTL fails
    the operator's construction, not a task): a :class:`ConfigError` names the state."""
    if state_ttl is None:
        return ()
    if not isinstance(state_ttl, Mapping):
        raise ConfigError(f"state_ttl must map state names to seconds or StateTtlConfig, got "
                          f"{state_ttl!r}")
    out = []
    for name, ttl in state_ttl.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"state_ttl: bad state name {name!r}")
        if name == TIMERS_STATE:
            raise ConfigError(f"state_ttl: {TIMERS_STATE!r} is the operator's timers, which "
                              f"have no TTL")
        try:
            cfg = StateTtlConfig.of(ttl)
        except StateError as e:
            raise ConfigError(f"state_ttl of state {name!r}: {e}") from None
        if cfg is None:
            raise ConfigError(f"state_ttl of state {name!r} is None; leave the state out")
        out.append((name, cfg))
    return tuple(sorted(out, key=lambda x: x[0]))


class KeyedStatefulOperator:
    """``foreachBatch`` callable: per-key state over micro-batches with exactly-once state.

    Rows travel as Arrow record batches (:mod:`spark_glue.routing`). With ``api="rows"`` (the
    per-key API), ``update(key, rows, state)`` is called once per key present in a batch with
    that key's rows (``pyspark.sql.Row`` objects, in arrival order) and a
    :class:`~spark_glue.views.KeyedState` offering ``state.value(name)``, ``state.list(name)``
    and ``state.map(name)``; whatever it returns (an iterable or None) is collected into one
    list. With ``api="pandas"`` (the vectorized API, :mod:`spark_glue.vectorized`),
    ``update(keys, rows, state)`` is called once per subtask with all its keys, their rows as
    a pandas DataFrame and their states by the column; the DataFrames it returns are
    collected into one pandas DataFrame, or a Spark DataFrame when ``output_schema`` is given.
    The outputs go to ``sink(batch_id, outputs)`` once the batch's checkpoint is complete.
    The update function must be deterministic, as for any Spark stateful operator.

    ``history``: the :class:`BatchStats` of the last ``history_limit`` batches (None: all).
    ``state_ttl``: state names to a time-to-live (seconds or a
    :class:`~dstl_ray.state.ttl.StateTtlConfig`: Flink's semantics, processing time,
    refreshed by writes). Its duration may change between runs; adding or removing one for a
    state a restored checkpoint names is refused: stored values carry timestamps or not.

    ``combine`` folds the batch's rows per key before the update sees them
    (:mod:`spark_glue.combine`): a function (pandas in and out, the key column kept) runs on
    each input partition's rows before the shuffle; a mapping of output column to Spark
    aggregate expression (``{"n": F.count("*")}``) runs as ``groupBy(key).agg(...)`` in the
    JVM. The update gets the combiner's rows.

    ``state_schema``: state names to types (Spark DDL or pyarrow) that may evolve between
    runs; ``drop_state``: states to remove (:mod:`spark_glue.state_shapes`).

    ``state_backend``: ``"heap"`` (Python dicts) or ``"rocksdb"`` (a local RocksDB per
    subtask under ``local_dir``); checkpoints of either restore into the other.

    ``initial_state``: another job's checkpoint or savepoint to start from, at any
    parallelism, when the job has none of its own (:mod:`spark_glue.initial`), or a
    DataFrame of the key column and one column per value state (:mod:`~.initial_frame`).

    ``on_missing_state``: for a batch ``n > 0`` without a complete checkpoint ``n - 1`` (or
    ``n``), ``"fail"`` raises :class:`~dstl_ray.errors.MissingStateError` before any task
    runs, naming the job, batch and what was found; ``"start_empty"`` starts over.
    """

    def __init__(self, job_id: str, key: str, update: UpdateFn, *,
                 namespace: str | None = None, operator_id: str = "keyed",
                 parallelism: int | None = None, max_parallelism: int = 128,
                 materialization_interval: float | None = 10.0, retained: int = 3,
                 sink: Sink | None = None, spark: Any = None, sticky: bool = True,
                 history_limit: int | None = 1000,
                 state_ttl: Mapping[str, StateTtlConfig | float] | None = None,
                 state_backend: str = "heap", local_dir: str | None = None,
                 api: str = "rows", output_schema: Any = None,
                 on_timer: Callable[..., Any] | None = None, event_time: str | None = None,
                 allowed_delay: float = 0.0, on_missing_state: str = "fail",
                 initial_state: Any = None, timer_output_schema: Any = None,
                 timer_sink: Sink | None = None,
                 state_schema: Mapping[str, Any] | None = None,
                 drop_state: Sequence[str] | None = None,
                 combine: Combine | None = None, key_hash: str = "auto") -> None:
        from dstl_ray.config import ChangelogConfig
        from dstl_ray.log.client import StateChangelogClient

        from .session import gcs_address

        if not isinstance(key, str) or not key:
            raise ConfigError(f"key must be a column name, got {key!r}")
        if not callable(update):
            raise ConfigError(f"update must be callable, got {update!r}")
        if retained < 2:
            raise ConfigError(f"retained must be >= 2 (a replayed batch restores from the "
                              f"checkpoint before it), got {retained}")
        if history_limit is not None and (isinstance(history_limit, bool)
                                          or not isinstance(history_limit, int)
                                          or history_limit < 1):
            raise ConfigError(f"history_limit must be an int >= 1 or None (unbounded), got "
                              f"{history_limit!r}")
        self.state_ttl = ttl_spec(state_ttl)
        self.state_schema = schema_spec(state_schema)
        self.drop_state = drop_spec(drop_state, (n for n, _ in self.state_schema))
        if state_backend not in STATE_BACKENDS:
            raise ConfigError(f"state_backend must be one of {', '.join(STATE_BACKENDS)}, "
                              f"got {state_backend!r}")
        if local_dir is not None and (not isinstance(local_dir, str) or not local_dir):
            raise ConfigError(f"local_dir must be a directory path, got {local_dir!r}")
        self.state_backend, self.local_dir = state_backend, local_dir
        if on_timer is not None and not callable(on_timer):
            raise ConfigError(f"on_timer must be callable, got {on_timer!r}")
        self.outputs = Outputs(api, output_schema, sink, timer_output_schema, timer_sink,
                               has_timers=on_timer is not None)
        self.api, self.output_schema = api, output_schema
        if event_time is not None and (not isinstance(event_time, str) or not event_time):
            raise ConfigError(f"event_time must be a column name, got {event_time!r}")
        if isinstance(allowed_delay, bool) or not isinstance(allowed_delay, (int, float)) \
                or not 0 <= allowed_delay < float("inf"):
            raise ConfigError(f"allowed_delay must be seconds >= 0, got {allowed_delay!r}")
        self.on_timer, self.event_time = on_timer, event_time
        self.combine = check_combine(combine, key, event_time)  # (spark_glue.combine)
        self.key_hash = JobKeyHash(job_id, key, key_hash)  # (spark_glue.job_key_hash)
        if on_missing_state not in ON_MISSING_STATE:
            raise ConfigError(f"on_missing_state must be one of "
                              f"{', '.join(ON_MISSING_STATE)}, got {on_missing_state!r}")
        self.on_missing_state = on_missing_state
        self.allowed_delay_ms = int(round(allowed_delay * 1000))
        self._attempts: tuple[str, ...] = ()  # per subtask, the attempt the latest holds
        self._replay_time: dict[int, int] = {}  # the last batch's processing time
        self._ttl_names_checked = False
        self.job_id = job_id
        self.key = key
        self.update = update
        self.namespace = namespace or ChangelogConfig.from_env().namespace
        self.operator_id = operator_id
        self.max_parallelism = max_parallelism
        self.materialization_interval = materialization_interval
        self.sink = sink
        self._spark = spark
        self._parallelism = parallelism
        # keep each subtask on its executor (spark_glue.placement)
        self._placement = Placement(sticky)
        self._path = DataPath(key, self.combine)  # the routing's JVM objects, as well
        self._client = StateChangelogClient(job_id, namespace=self.namespace)
        import ray

        self.caller_namespace: str = ray.get_runtime_context().namespace
        self.base_path = self._client.transport.base_path
        self.gcs_address = gcs_address()
        self.coordinator = CheckpointCoordinator(job_id, self.base_path,
                                                 max_parallelism=max_parallelism,
                                                 retained=retained)
        # FLIP-158 "Cleanup after recovery": load retained checkpoints, delete orphans,
        # before any checkpoint of this incarnation starts
        # before any checkpoint of this incarnation starts; a job with no state yet starts
        # from initial_state, pinned as its restore point (spark_glue.initial)
        self._initial = InitialFrame.of(initial_state, key) if is_frame(initial_state) \
            else None  # a DataFrame loads in batch 0 (spark_glue.initial_frame)
        self.coordinator.restore(None, operator_id, 0, **InitialState.start(
            None if self._initial else initial_state, self.coordinator, operator_id,
            self.namespace))
        # a declared type stored values cannot follow fails here, not in a task; stored
        # types the run leaves out are declared too
        self.state_schema = check_against(self.coordinator, operator_id, self.state_schema,
                                          self.drop_state)
        self.epoch = uuid.uuid4().hex
        self.history = BatchHistory(maxlen=history_limit)
        self.progress = ProgressMetrics(job_id)  # batch metrics in query.lastProgress

    # ------------------------------------------------------------------ batches

    def _check_ttl_names(self, snaps: list[KeyedStateSnapshot]) -> None:
        """Once some state exists: warn about ``state_ttl`` names no subtask has a state
        of (a misspelled name silently gives its state no TTL)."""
        if not self.state_ttl or self._ttl_names_checked:
            return
        used = {spec[0] for snap in snaps for c in snap.components for spec in c.states}
        if not used:
            return
        self._ttl_names_checked = True
        unknown = sorted(name for name, _ttl in self.state_ttl if name not in used)
        if unknown:
            log.warning("state_ttl names %s, but the update function has used no state of "
                        "that name (states so far: %s); a misspelled name leaves its state "
                        "without a TTL", ", ".join(map(repr, unknown)),
                        ", ".join(map(repr, sorted(used))))

    def _check_event_time(self, df: Any) -> None:
        """The event-time column exists and holds timestamps or integer ms (checked here, so
        a misnamed column fails the batch on the driver, not every task)."""
        if self.event_time is None:
            return
        types = {f.name: f.dataType.typeName() for f in df.schema.fields}
        kind = types.get(self.event_time)
        if kind not in ("timestamp", "timestamp_ntz", "long", "integer", "short", "byte"):
            raise ConfigError(f"event_time column {self.event_time!r} must be a timestamp or "
                              f"integer ms; the micro-batch's columns are {types}")

    def parallelism(self, spark: Any) -> int:
        p = self._parallelism or int(spark.conf.get("spark.sql.shuffle.partitions"))
        if not 0 < p <= self.max_parallelism:
            raise ConfigError(f"parallelism must be in 1..{self.max_parallelism}, got {p}")
        return p

    @property
    def last_outputs(self) -> Any:
        """The last batch's outputs, as the sink got them (kept by :attr:`outputs`)."""
        return self.outputs.last

    def __call__(self, df: Any, batch_id: int) -> None:
        self.process_batch(df, batch_id)

    @property
    def sticky(self) -> bool:
        """Whether each subtask stays on its executor (``sticky=``; may be changed)."""
        return self._placement.sticky

    @sticky.setter
    def sticky(self, value: bool) -> None:
        self._placement.sticky = bool(value)

    def transform(self, df: Any, batch_id: int) -> Any:
        """:meth:`process_batch`, returning the batch's outputs (a Spark DataFrame with an
        ``output_schema``), for a ``foreachBatch`` of your own that chains further work on
        them. They are the outputs of a complete checkpoint; a batch Spark replays gives
        them again (use a :class:`~spark_glue.sinks.FileSink` for exactly-once files). With
        a ``timer_output_schema``, the timers' are in ``op.outputs.last_timers``."""
        self.process_batch(df, batch_id)
        return self.last_outputs

    def process_batch(self, df: Any, batch_id: int) -> BatchStats:
        """Run micro-batch ``batch_id``: update state, complete checkpoint ``batch_id``, then
        the sink. Any failure leaves no cached state trusted (new epoch) and raises."""
        t0 = time.perf_counter()
        cc = self.coordinator
        spark = self._spark or df.sparkSession
        p = self.parallelism(spark)
        self._check_event_time(df)
        latest = cc.latest_checkpoint()
        gone = missing_state(self.job_id, batch_id, latest.checkpoint_id if latest else None,
                             self.base_path)
        if gone is not None:
            if self.on_missing_state == "fail":
                raise gone
            log.warning("job %r: micro-batch %d starts over from empty state "
                        "(on_missing_state='start_empty'); latest complete checkpoint under "
                        "%s: %s", self.job_id, batch_id, self.base_path, gone.latest_id)
            latest, self.epoch, self._attempts = None, uuid.uuid4().hex, ()
        replayed = is_replay(self.job_id, batch_id, latest.checkpoint_id if latest else None)
        # the batch's processing time: a replay runs at the time its first run ran at, so
        # its processing-time timers fire as they did then (remembered here too, for a
        # second try of a replay that failed after dropping the checkpoint)
        now_ms = (snapshot_time(latest, "processing_time_ms") if replayed else None) \
            or self._replay_time.get(batch_id) or int(time.time() * 1000)
        self._replay_time = {batch_id: now_ms}
        if replayed and self.outputs.delivered(spark, batch_id):  # state and output done
            self.history.append(BatchStats.done(batch_id))
            return self.history[-1]
        if replayed:
            log.warning("batch %d is replayed (checkpoint %d complete): recomputing it from "
                        "the previous checkpoint", batch_id, latest.checkpoint_id)
            cc.drop_checkpoints_from(batch_id)
            self.epoch = uuid.uuid4().hex
            self._attempts = ()
            latest = cc.latest_checkpoint()
        point = cc.restore_point.current() if latest is None else None  # initial_state
        load = self._initial is not None and latest is None and point is None
        cc.key_hash = self.key_hash.of(df, latest, point)
        spec = TaskSpec(self.job_id, self.operator_id, self.namespace, self.gcs_address, p,
                        self.max_parallelism, self.materialization_interval, self.update,
                        batch_id, self.epoch, latest.checkpoint_id if latest else -1,
                        latest.metadata_url if latest else point and point.metadata_url,
                        subsumed_watermark=cc.subsumed_watermark(),
                        caller_namespace=self.caller_namespace,
                        incarnation=str(cc.incarnation),
                        state_ttl=self.state_ttl, state_backend=self.state_backend,
                        local_dir=self.local_dir, key=self.key, api=self.api,
                        on_timer=self.on_timer, event_time=self.event_time,
                        allowed_delay_ms=self.allowed_delay_ms,
                        event_time_ms=snapshot_time(latest, "event_time_ms", max),
                        now_ms=now_ms, attempts=self._attempts,
                        initial=point is not None, timer_outputs_apart=self.outputs.apart,
                        state_schema=self.state_schema, drop_state=self.drop_state,
                        initial_columns=self._initial.states if load else (),  # type: ignore
                        key_hash=cc.key_hash)
        try:
            cc.begin_checkpoint(batch_id)  # its chk-n made while the tasks run
            results = self._run(df, spec)
            snaps = [KeyedStateSnapshot.from_dict(json.loads(r["snapshot"]), self.base_path)
                     for r in results]
            outputs = self.outputs.shape(results, spark)  # (a bad one fails before completing)
            t1 = time.perf_counter()
            cc.complete_checkpoint(batch_id, snaps)
            t2 = time.perf_counter()
        except BaseException:
            self.epoch = uuid.uuid4().hex
            raise
        self._attempts = tuple(r["attempt_id"] for r in results)
        self._check_ttl_names(snaps)
        self.outputs.deliver(batch_id, outputs)
        t3 = time.perf_counter()
        new = cc.latest_checkpoint()
        written = len(new.files.keys() - (latest.files.keys() if latest else set())) \
            if new is not None else 0
        stats = BatchStats.of(batch_id, results, replayed, (t0, t1, t2, t3), written)
        self.history.append(stats)
        try:  # the batch is done: its metrics never fail it
            self.progress.record(spark, batch_id, stats.metrics())
        except Exception as e:  # noqa: BLE001
            log.warning("job %r: batch %d's metrics are not in the query's progress: %s",
                        self.job_id, batch_id, e)
        return stats

    def _run(self, df: Any, spec: TaskSpec) -> list[dict[str, Any]]:
        p = spec.parallelism
        results = self._path.run(drop_ticks(df), spec, self._placement,
                                 self._initial.df if spec.initial_columns else None)
        got = sorted(r["index"] for r in results)
        if got != list(range(p)):
            raise RuntimeError(f"batch {spec.batch_id}: expected one result per subtask "
                               f"0..{p - 1}, got {got}")
        self._placement.remember({r["index"]: r["executor"] for r in results if r["executor"]})
        return sorted(results, key=lambda r: r["index"])

    # ------------------------------------------------------------------ state

    def state(self, checkpoint: str | None = None) -> dict[str, dict[Any, Any]]:
        """The state of the latest complete checkpoint (or ``checkpoint``, a ``_metadata``
        URL), restored from storage in this process: {state name: {key: value}}."""
        from dstl_ray.checkpoint.reader import read_states

        latest = self.coordinator.latest_checkpoint()
        url = checkpoint or (latest.metadata_url if latest else None)
        return {} if url is None else read_states(url, self.operator_id)

    def savepoint(self, timeout: float = 600.0) -> str:
        """A savepoint of the job (FLINK-5053), its ``_metadata`` URL: the latest batch's
        state, rewritten from that checkpoint's files (on the driver, a subtask's range at a
        time, under ``local_dir``; ``timeout`` for all) into a ``savepoint-...`` directory no
        run of the job writes into or deletes, for ``initial_state=`` or ``read_state``.
        Take it between batches: a batch completing meanwhile may subsume what it reads, and
        it then fails, leaving nothing."""
        latest = self.coordinator.latest_checkpoint()
        if latest is None:
            raise StateError(f"job {self.job_id!r} has no complete checkpoint yet: run a "
                             f"micro-batch first")
        return self.coordinator.trigger_savepoint(
            of=latest, table=self.state_backend, local_dir=self.local_dir,
            timeout_s=timeout).result().metadata_url

    def close(self) -> None:
        """Stop coordinating (retained checkpoints stay for the next run)."""
        self.progress.close()
        self.coordinator.shutdown()
        self._client.close()
