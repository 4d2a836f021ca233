"""The driver side of KeyedStatefulOperator without Spark: which batch ids are replays, what an
older batch id does (an error, nothing deleted), and the bounded batch history. The Spark
tasks are replaced by a backend on the in-process DirectTransport whose snapshots the real
CheckpointCoordinator completes on real files (tests/spark covers the operator on RayDP)."""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

import dstl_ray as d
from dstl_ray.checkpoint.recovery import assign_sources, load_checkpoint
from dstl_ray.errors import ConfigError, DstlError, MissingStateError
from dstl_ray.storage.deleter import flush_deletes
from dstl_ray.storage.registry import get_storage
from spark_glue.initial import InitialState
from spark_glue.job_key_hash import JobKeyHash
from spark_glue.operator import KeyedStatefulOperator, is_replay
from spark_glue.placement import Placement
from spark_glue.progress import ProgressMetrics
from spark_glue.replay import missing_state
from spark_glue.sinks import Outputs
from spark_glue.stats import BatchHistory, BatchStats

JOB = "op-batches"
MAXP = 16


def stats(batch_id: int) -> BatchStats:
    return BatchStats(batch_id, 0, 0, 0.0, 0.0, 0.0, 0, 0, False)


# ------------------------------------------------------------------ replay decision


def test_new_batches_and_the_replayed_last_batch():
    assert not is_replay(JOB, 0, None)  # nothing complete yet
    assert not is_replay(JOB, 5, None)
    assert not is_replay(JOB, 4, 3)  # the next batch
    assert is_replay(JOB, 3, 3)  # checkpoint 3 completed, Spark's commit did not


def test_a_batch_older_than_the_latest_checkpoint_is_a_config_error():
    with pytest.raises(ConfigError) as ei:
        is_replay(JOB, 2, 7)
    msg = str(ei.value)
    assert isinstance(ei.value, DstlError)
    assert "micro-batch 2" in msg and "checkpoint 7" in msg and JOB in msg
    assert "new job id" in msg and "old checkpointLocation" in msg
    assert "Nothing was deleted" in msg


def test_a_batch_whose_state_is_gone_is_a_missing_state_error():
    base = "file:///dfs"
    for batch_id, latest in ((0, None), (1, 0), (4, 3), (4, 4), (2, 7)):
        assert missing_state(JOB, batch_id, latest, base) is None  # start, next, replay, older
    for batch_id, latest, found in ((1, None, "no complete checkpoint"),
                                    (4, None, "no complete checkpoint"),
                                    (4, 2, "only checkpoint 2 as the latest")):
        e = missing_state(JOB, batch_id, latest, base)
        assert isinstance(e, MissingStateError) and isinstance(e, DstlError)
        msg = str(e)
        assert f"job {JOB!r}: micro-batch {batch_id} " in msg and found in msg, msg
        assert f"base path {base!r}" in msg and "on_missing_state='start_empty'" in msg
        assert (e.job_id, e.batch_id, e.latest_id, e.base_path) == (JOB, batch_id, latest,
                                                                     base)


@pytest.mark.parametrize("bad", ["start-empty", "", None, 1])
def test_a_bad_on_missing_state_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="on_missing_state must be one of fail, start_empty"):
        KeyedStatefulOperator(JOB, key="k", update=lambda *a: None, on_missing_state=bad)


# ------------------------------------------------------------------ through process_batch


class Driver:
    """A KeyedStatefulOperator on a real coordinator (file://), with ``_run`` answering as
    one subtask whose backend lives in this process (no Ray, no Spark)."""

    def __init__(self, tmp_path: Any, history_limit: int | None = 1000, *, job: str = JOB,
                 key: str = "k", initial_state: Any = None) -> None:
        self.base, self.job, self.key = f"file://{tmp_path}/dfs", job, key
        self.client = d.StateChangelogClient(job, transport=d.DirectTransport(job, self.base))
        op = KeyedStatefulOperator.__new__(KeyedStatefulOperator)
        op.job_id, op.key, op.update, op.namespace = job, "k", lambda *a: None, "ns"
        op.operator_id, op.max_parallelism, op.materialization_interval = "op", MAXP, None
        # a session running no streaming query: no batch metrics for query progress
        no_query = SimpleNamespace(sparkContext=SimpleNamespace(getLocalProperty=lambda k: None))
        op.sink, op._spark, op._parallelism, op._placement = None, no_query, 1, \
            Placement(False)
        op.progress = ProgressMetrics(job)
        op.caller_namespace, op.base_path, op.gcs_address = "", self.base, ""
        op.state_ttl, op.state_schema, op.drop_state, op._initial, op.combine = (), (), (), \
            None, None
        op.state_backend, op.local_dir = "heap", None
        op.api, op.output_schema = "rows", None
        op.outputs = Outputs("rows", None, None)
        op.on_timer, op.event_time, op.allowed_delay_ms = None, None, 0
        op._attempts, op._replay_time = (), {}
        op._ttl_names_checked = False
        op.on_missing_state = "fail"
        op.key_hash = JobKeyHash(job, "k", "blake2b")  # (no micro-batch schema here)
        op.coordinator = d.CheckpointCoordinator(job, self.base, max_parallelism=MAXP,
                                                 retained=3)
        # as the operator does (the restore of a driver: no backends here)
        op.coordinator.restore(None, "op", 0, **InitialState.start(
            initial_state, op.coordinator, "op"))
        op.epoch = uuid.uuid4().hex
        op.history = BatchHistory(maxlen=history_limit)
        op._run = self.run
        self.op = op
        self.backend = self._backend(None)
        self.runs: list[int] = []
        self.specs: list[Any] = []

    def _backend(self, restore: Any) -> d.ChangelogKeyedStateBackend:
        sources = assign_sources(restore, "op", 1)[0] if restore else []
        return d.ChangelogKeyedStateBackend(self.client, "op", d.KeyGroupRange(0, MAXP - 1),
                                            MAXP, restore=sources,
                                            materialization_interval=None)

    def run(self, df: Any, spec: Any) -> list[dict[str, Any]]:
        self.runs.append(spec.batch_id)
        if spec.restore_id != self.backend_holds or spec.initial:  # restore, as a task does
            self.backend.close()
            self.backend = self._backend(spec.restore_url and load_checkpoint(spec.restore_url))
            if spec.initial:
                self.backend.materialize_now()
        self.backend.value_state("v").update(self.key, spec.batch_id)
        snap = self.backend.snapshot(checkpoint_id=spec.batch_id).result(timeout=30)
        snap = dataclasses.replace(snap, processing_time_ms=spec.now_ms)  # as run_partition
        self.specs.append(spec)
        self.backend_holds = spec.batch_id
        return [{"index": 0, "attempt_id": "a", "snapshot": json.dumps(snap.to_dict()),
                 "outputs": [],
                 "rows": 1, "keys": 1, "attempt": 0, "stage_attempt": 0, "restore_s": 0.0,
                 "apply_s": 0.0, "snapshot_s": 0.0, "node": "", "chosen_by": "",
                 "raylet_pid": "", "executor": "", "metrics": {"state_rows": 1}}]

    backend_holds = -1

    def files(self) -> set[str]:
        """The job's files once the deletes decided so far ran (a subsumed checkpoint's
        discard runs in the background), as tests/unit/ckpt_util.files reads them."""
        assert flush_deletes(30)
        root = f"{self.base}/{self.job}"
        return set(get_storage(root).list_files(root))

    def close(self) -> None:
        self.backend.close()
        self.op.coordinator.shutdown()


def test_an_older_batch_id_deletes_no_checkpoint(tmp_path):
    """Regression: a batch id below the latest checkpoint (a new checkpointLocation with an
    existing job id) was taken for a replay and dropped every newer checkpoint."""
    drv = Driver(tmp_path)
    for b in range(5):
        drv.op.process_batch(None, b)
    before_ids = [c.checkpoint_id for c in drv.op.coordinator.completed_checkpoints()]
    before_files, epoch = drv.files(), drv.op.epoch
    assert before_ids == [2, 3, 4]
    raised: Exception | None = None
    try:
        drv.op.process_batch(None, 0)
    except ConfigError as e:
        raised = e
    assert [c.checkpoint_id for c in drv.op.coordinator.completed_checkpoints()] == before_ids
    assert drv.files() == before_files  # nothing deleted
    assert raised is not None and re.search(r"micro-batch 0 .* checkpoint 4", str(raised))
    assert drv.runs == [0, 1, 2, 3, 4] and drv.op.epoch == epoch  # nothing run
    assert len(drv.op.history) == 5
    drv.close()


def test_a_restart_on_an_empty_base_path_fails_until_told_to_start_over(tmp_path):
    """Regression (issue 28 item 7): Spark's checkpointLocation ran batches 0-3, the job's
    base path is new and empty; batch 4 ran on empty state with no error."""
    old = Driver(tmp_path / "old")
    for b in range(4):
        old.op.process_batch(None, b)
    old.close()
    drv = Driver(tmp_path / "new")
    with pytest.raises(MissingStateError) as ei:
        drv.op.process_batch(None, 4)
    msg = str(ei.value)
    assert f"job {JOB!r}: micro-batch 4 " in msg and "no complete checkpoint" in msg
    assert drv.base in msg
    assert drv.runs == [] and len(drv.op.history) == 0  # no task ran
    assert not any("/chk-" in f for f in drv.files())
    drv.op.on_missing_state = "start_empty"  # the explicit choice
    st = drv.op.process_batch(None, 4)
    assert drv.runs == [4] and drv.specs[0].restore_id == -1 and not st.replayed
    assert drv.op.state() == {"v": {"k": 4}}
    drv.op.process_batch(None, 5)  # and on from there
    assert [c.checkpoint_id for c in drv.op.coordinator.completed_checkpoints()] == [4, 5]
    drv.close()


def test_a_checkpoint_older_than_the_previous_batch_is_missing_state(tmp_path):
    """The base path holds checkpoints 0-1 (restored from an old copy, say) while Spark's
    checkpointLocation ran batches up to 3: batch 4 fails. The next batch (2), its replay
    and batch 3 run."""
    drv = Driver(tmp_path)
    for b in range(2):
        drv.op.process_batch(None, b)
    with pytest.raises(MissingStateError, match="micro-batch 4 .*only checkpoint 1 as the "
                                                 "latest complete one"):
        drv.op.process_batch(None, 4)
    assert drv.runs == [0, 1]
    drv.op.process_batch(None, 2)
    drv.op.process_batch(None, 2)  # a replay
    drv.op.process_batch(None, 3)
    assert drv.runs == [0, 1, 2, 2, 3]
    drv.close()


def test_the_last_batch_is_replayed_from_the_checkpoint_before_it(tmp_path):
    drv = Driver(tmp_path)
    for b in range(3):
        drv.op.process_batch(None, b)
        time.sleep(0.02)  # every batch at its own processing time
    epoch = drv.op.epoch
    st = drv.op.process_batch(None, 2)
    assert st.replayed and drv.op.epoch != epoch
    # the replay runs at the processing time of the run it replays (its timers fire alike)
    assert drv.specs[-1].now_ms == drv.specs[2].now_ms and drv.specs[2].now_ms > 0
    assert drv.specs[-1].attempts == () and drv.specs[2].attempts == ("a",)
    assert [c.checkpoint_id for c in drv.op.coordinator.completed_checkpoints()] == [0, 1, 2]
    assert drv.op.state() == {"v": {"k": 2}}
    drv.close()


# ------------------------------------------------------------------ initial state


def test_a_job_starts_from_another_jobs_checkpoint_and_never_touches_its_files(tmp_path):
    """initial_state (issue 30 item 2): the first batch restores from the other job's
    checkpoint and materializes it into the job's own files, so its checkpoints never name
    the other job's files; a replay of that batch restores from it again."""
    other = Driver(tmp_path, job="other", key="a")
    for b in range(3):
        other.op.process_batch(None, b)
    source = other.op.coordinator.latest_checkpoint()
    other.close()
    before = other.files()
    drv = Driver(tmp_path, initial_state=f"{other.base}/other")  # the job directory
    assert drv.op.coordinator.restore_point.current().metadata_url == source.metadata_url
    drv.op.process_batch(None, 0)
    assert drv.specs[0].initial and drv.specs[0].restore_url == source.metadata_url
    assert drv.op.state() == {"v": {"a": 2, "k": 0}}  # the other job's state, then batch 0
    ours = drv.op.coordinator.latest_checkpoint()
    assert ours.files and not any("/other/" in u for u in ours.files.values()), ours.files
    drv.op.process_batch(None, 1)
    drv.op.process_batch(None, 1)  # replays restore from our checkpoint 0
    assert not drv.specs[-1].initial and drv.specs[-1].restore_id == 0
    drv.op.process_batch(None, 2)
    drv.op.process_batch(None, 3)  # checkpoint 0 subsumed: none of its files were the other's
    drv.close()
    assert other.files() == before  # nothing of the other job written or deleted
    replay = Driver(tmp_path / "again", initial_state=source.metadata_url)
    replay.op.process_batch(None, 0)
    replay.op.process_batch(None, 0)  # a replay of the first batch: from the source again
    assert replay.specs[-1].initial and replay.op.state() == {"v": {"a": 2, "k": 0}}
    replay.close()


def test_the_initial_state_is_pinned_at_the_first_start_and_never_resolved_again(tmp_path):
    """Review of issue 30 item 2: every driver start resolved initial_state again: a job
    directory then meant the other job's newest checkpoint, so a replay of the first batch
    after a restart restored other state than the batch's first run (while a file sink kept
    the first run's outputs), and once the other job's checkpoint was gone the job could
    not start at all, though it no longer needed it."""
    other = Driver(tmp_path, job="other", key="a")
    other.op.process_batch(None, 0)
    first = other.op.coordinator.latest_checkpoint().metadata_url
    drv = Driver(tmp_path / "b", initial_state=f"{other.base}/other")
    drv.op.process_batch(None, 0)  # restored from the other job's checkpoint 0
    drv.op.coordinator.abandon()  # the driver dies before Spark's commit of batch 0
    drv.backend.close()
    for b in (1, 2):  # the other job goes on (its checkpoint 0 still retained)
        other.op.process_batch(None, b)
    again = Driver(tmp_path / "b", initial_state=f"{other.base}/other")  # no resolve: pinned
    again.op.process_batch(None, 0)  # Spark replays batch 0: from the pinned checkpoint
    assert again.specs[-1].initial and again.specs[-1].restore_url == first
    assert again.op.state() == {"v": {"a": 0, "k": 0}}  # not the other job's newest (a: 2)
    again.op.process_batch(None, 1)
    again.op.coordinator.abandon()
    again.backend.close()
    for b in (3, 4):  # now the other job's checkpoint 0 is gone
        other.op.process_batch(None, b)
    assert not get_storage(first).exists(first)
    late = Driver(tmp_path / "b", initial_state=f"{other.base}/other")  # starts: needs none
    late.op.process_batch(None, 2)
    assert not late.specs[-1].initial and late.op.state() == {"v": {"a": 0, "k": 2}}
    late.close()
    other.close()


def test_an_initial_state_of_the_jobs_own_is_refused(tmp_path):
    drv = Driver(tmp_path)
    drv.op.process_batch(None, 0)
    drv.close()
    with pytest.raises(ConfigError, match="is the job's own"):
        InitialState.resolve(f"{drv.base}/{JOB}", "op", MAXP, job_path=f"{drv.base}/{JOB}")


class _LoggedSink:
    """A sink that says which batches it holds for good (as FileSink's log does)."""

    def __init__(self) -> None:
        self.got: list[int] = []

    def __call__(self, batch_id: int, outputs: Any) -> None:
        self.got.append(batch_id)

    def committed(self, spark: Any) -> int | None:
        return max(self.got, default=None)


def test_a_replay_the_sink_already_holds_is_not_recomputed(tmp_path):
    """Review of issue 30 item 1: a replayed batch whose outputs a file sink had logged was
    recomputed (its checkpoint dropped): state could then differ from the logged outputs."""
    drv = Driver(tmp_path)
    sink = drv.op.outputs.update.sink = _LoggedSink()
    for b in range(3):
        drv.op.process_batch(None, b)
    st = drv.op.process_batch(None, 2)  # Spark replays its last batch
    assert st.replayed and drv.runs == [0, 1, 2] and sink.got == [0, 1, 2]
    assert [c.checkpoint_id for c in drv.op.coordinator.completed_checkpoints()] == [0, 1, 2]
    drv.op.process_batch(None, 3)
    assert drv.runs == [0, 1, 2, 3]
    drv.close()


def test_an_initial_state_that_does_not_fit_is_a_config_error(tmp_path):
    other = Driver(tmp_path, job="other", key="a")
    other.op.process_batch(None, 0)
    other.close()
    url = other.op.coordinator.latest_checkpoint().metadata_url
    with pytest.raises(ConfigError, match="max_parallelism 16, the operator 32"):
        InitialState.resolve(url, "op", 32)
    with pytest.raises(ConfigError, match="has no operator 'keyed' \\(it has 'op'\\)"):
        InitialState.resolve(url, "keyed", MAXP)
    with pytest.raises(ConfigError, match="initial_state must be a checkpoint or savepoint"):
        InitialState.resolve(5, "op", MAXP)


# ------------------------------------------------------------------ history


def test_history_keeps_the_last_batches_and_counts_all(tmp_path):
    drv = Driver(tmp_path, history_limit=3)
    for b in range(7):
        drv.op.process_batch(None, b)
    h = drv.op.history
    assert len(h) == 3 and h.total == 7
    assert [s.batch_id for s in h] == [4, 5, 6]
    assert h[0].batch_id == 4 and h[-1].batch_id == 6
    assert [s.batch_id for s in h[1:]] == [5, 6] and isinstance(h[1:], list)
    drv.close()


def test_batch_history_unbounded_and_copy():
    h = BatchHistory(maxlen=None)
    for b in range(1500):
        h.append(stats(b))
    assert len(h) == h.total == 1500
    assert [s.batch_id for s in h[-2:]] == [1498, 1499]
    import copy

    c = copy.copy(h)
    assert isinstance(c, BatchHistory) and len(c) == 1500


def test_history_limit_defaults_to_1000():
    import inspect

    sig = inspect.signature(KeyedStatefulOperator)
    assert sig.parameters["history_limit"].default == 1000


@pytest.mark.parametrize("bad", [0, -1, 2.5, "10", True])
def test_bad_history_limit_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="history_limit"):
        KeyedStatefulOperator(JOB, key="k", update=lambda *a: None, history_limit=bad)


def test_a_state_ttl_name_no_state_has_is_warned_about_once(tmp_path, caplog):
    """The update function writes state "v"; state_ttl names "v" and a misspelled "vv"."""
    drv = Driver(tmp_path)
    drv.op.state_ttl = (("v", d.StateTtlConfig(60)), ("vv", d.StateTtlConfig(60)))
    with caplog.at_level("WARNING", logger="spark_glue.operator"):
        drv.op.process_batch(None, 0)
        drv.op.process_batch(None, 1)
    warned = [r.getMessage() for r in caplog.records if "state_ttl names" in r.getMessage()]
    assert len(warned) == 1 and "'vv'" in warned[0] and "'v'," not in warned[0]
    drv.close()


def test_the_event_time_column_is_checked_on_the_driver():
    from types import SimpleNamespace

    from pyspark.sql.types import LongType, StringType, StructField, StructType

    op = KeyedStatefulOperator.__new__(KeyedStatefulOperator)
    op.event_time = "ts"
    df = SimpleNamespace(schema=StructType([StructField("user", StringType()),
                                            StructField("ts", LongType())]))
    op._check_event_time(df)
    for fields in ([StructField("user", StringType())],
                   [StructField("ts", StringType())]):
        with pytest.raises(ConfigError, match="event_time column 'ts' must be a timestamp"):
            op._check_event_time(SimpleNamespace(schema=StructType(fields)))
