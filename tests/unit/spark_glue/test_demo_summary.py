"""The demo's recovery figures (spark_glue.demo.recovery_latency): checkpoint p50 before the
failure, and in the 30 s after the cluster healed (the executors back to their spread)."""

from __future__ import annotations

from spark_glue.demo import recovery_latency
from spark_glue.stats import BatchStats


def _batch(at: float, ms: float, executors: str) -> BatchStats:
    return BatchStats(batch_id=int(at), rows=1, keys=1, batch_s=ms / 1000,
                      checkpoint_s=ms / 1000, commit_s=0.0, restores=0, retries=0,
                      replayed=False, executors=dict(enumerate(executors)), finished_at=at)


def test_after_recovery_starts_once_the_executors_are_back():
    history = ([_batch(0, 20000, "012")]  # the first batch: the query's warm-up
               + [_batch(t, 150, "012") for t in range(1, 10)]  # before the failure at 9.5
               + [_batch(10, 900, "01"), _batch(11, 500, "011")]  # a subtask retried on 1
               + [_batch(t, 160, "013") for t in range(12, 50)])  # replacement executor 3
    got = recovery_latency(history, fail_at=9.5)
    assert got["checkpoint_ms_p50_before_failure"] == 150
    assert got["healed_s"] == 2.5 and got["checkpoints_after_recovery"] == 30
    assert got["checkpoint_ms_p50_after_recovery"] == 160
    # before: the window_s before the failure only
    late = recovery_latency([_batch(t, 300, "012") for t in range(5)] + history[5:],
                            fail_at=9.5, window_s=4.0)
    assert late["checkpoint_ms_p50_before_failure"] == 150


def test_a_short_run_takes_every_checkpoint_after_recovery_and_no_failure_none():
    history = [_batch(0, 100, "01"), _batch(1, 120, "01"), _batch(2, 400, "0"),
               _batch(3, 130, "0"), _batch(4, 110, "0"), _batch(5, 125, "0")]  # never spread
    got = recovery_latency(history, fail_at=1.5)
    assert got["healed_s"] == 0.5 and got["checkpoint_ms_p50_after_recovery"] == 125
    none = recovery_latency(history, fail_at=None)
    assert none["checkpoint_ms_p50_before_failure"] == 125  # all but the first batch
    assert none["checkpoint_ms_p50_after_recovery"] is None
