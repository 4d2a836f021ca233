"""How experiments.multihost counts a run's figures, without hosts: which of the other
job's declines count against isolation, which checkpoints are "outside faults", and the
totals of both jobs."""

from __future__ import annotations

import math

from experiments.multihost import GRACE_S, inside, summarize

FAULTS = [
    {"kind": "partition", "host": "10.0.0.3", "start": 100.0, "end": 108.0, "seconds": 8.0},
    {"kind": "loss", "host": "10.0.0.4", "start": 200.0, "end": 215.0,
     "replaced_by": "10.0.0.6"},
    {"kind": "partition", "host": "10.0.0.5", "start": 300.0, "end": 345.0, "seconds": 45.0,
     "node_declared_dead": True, "rejoined_as": "10.0.0.7"},
]


def result(rounds, declines, other_ms=((1.0, 5.0),)):
    return {"rounds": rounds, "checkpoints_completed": sum(r["ok"] for r in rounds),
            "checkpoints_declined": sum(not r["ok"] for r in rounds), "recoveries": 3,
            "changes_verified": 1000, "changes_lost": 1, "leaked_files": 2,
            "missing_files": 0, "other_job_lost": 1, "other_job_leaked_files": 0,
            "other_job_missing_files": 3, "other_job_checkpoints": 50,
            "other_job_checkpoint_ms": [list(x) for x in other_ms],
            "other_job_decline_times": [list(d) for d in declines]}


def test_a_window_is_a_faults_span_plus_the_grace_after_it():
    assert inside(104.0, 104.1, FAULTS, "partition")
    assert not inside(104.0, 104.1, FAULTS, "loss")
    assert not inside(110.0, 110.1, FAULTS) and inside(110.0, 110.1, FAULTS, grace=GRACE_S)
    assert inside(98.5, 99.5, FAULTS)  # a checkpoint that started just before the fault
    assert not inside(150.0, 151.0, FAULTS, grace=GRACE_S)


def test_declines_of_the_other_job_are_told_apart_by_where_they_fall():
    declines = [(104.0, 104.5),  # during a partition
                (112.0, 112.5),  # in the heal window after it
                (150.0, 150.5),  # in no window: counts against isolation
                (205.0, 206.0)]  # during a host loss
    got = summarize(result([], declines), FAULTS, hosts=4)
    assert got["other_job_declines"] == 1
    assert got["other_job_declines_during_partitions"] == 1
    assert got["other_job_declines_in_heal_windows"] == 3


def test_totals_add_both_jobs_and_count_faults_and_hosts():
    rounds = [{"at": 50.0, "ok": True, "ms": 10.0}, {"at": 60.0, "ok": True, "ms": 30.0},
              {"at": 101.0, "ok": True, "ms": 5000.0}, {"at": 202.0, "ok": False, "ms": None},
              {"at": 400.0, "ok": True, "ms": 20.0}]
    got = summarize(result(rounds, []), FAULTS, hosts=4)
    assert (got["partitions"], got["host_losses"], got["long_partitions_node_declared_dead"],
            got["hosts_ever"]) == (2, 1, 1, 6)
    assert (got["changes_lost"], got["leaked_files"], got["missing_files"]) == (2, 2, 3)
    assert (got["checkpoints_completed"], got["checkpoints_declined"]) == (4, 1)
    assert got["checkpoint_ms_p99"] == 5000.0  # every completed checkpoint
    assert got["checkpoint_ms_p99_outside_faults"] == 30.0  # the one in a partition left out
    assert got["checkpoint_ms_p50_outside_faults"] == 20.0


def test_a_run_without_completed_checkpoints_has_no_latency():
    got = summarize(result([{"at": 1.0, "ok": False, "ms": None}], [], other_ms=()), [], 4)
    assert math.isnan(got["checkpoint_ms_p50"]) and math.isnan(got["other_job_checkpoint_ms_p99"])
