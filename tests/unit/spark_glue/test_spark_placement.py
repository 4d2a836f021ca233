"""Subtask -> executor placement: stays where it ran while that executor lives, spreads the
rest evenly, and follows RayDP's executor directory layout."""

from __future__ import annotations

from spark_glue.placement import executor_id, plan


def test_first_batch_spreads_evenly():
    got = plan(6, {}, {"0": "h", "1": "h", "2": "h"})
    assert sorted(got) == list(range(6))
    assert sorted(list(got.values()).count(e) for e in "012") == [2, 2, 2]


def test_subtasks_stay_and_lost_executors_are_replaced():
    hosts = {"0": "h", "2": "h", "3": "h"}
    got = plan(4, {0: "1", 1: "2", 2: "2", 3: "0"}, hosts)
    assert got[1] == "2" and got[2] == "2" and got[3] == "0"
    assert got[0] == "3"  # executor 1 is gone: the least loaded live one
    assert plan(3, {0: "1"}, {}) == {}


def test_executor_id_from_local_dirs(monkeypatch):
    monkeypatch.setenv("SPARK_LOCAL_DIRS", "/tmp/ray/session_x/app-2026/7/blockmgr-ab12")
    assert executor_id() == "7"
    monkeypatch.setenv("SPARK_LOCAL_DIRS", "")
    assert executor_id() is None
