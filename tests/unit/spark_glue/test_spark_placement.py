"""Subtask -> executor placement: stays where it ran while that executor lives, spreads the
rest evenly, and follows RayDP's executor directory layout."""

from __future__ import annotations

from spark_glue.placement import executor_id, parse_block_managers, plan


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


def test_an_over_loaded_executor_gives_subtasks_to_an_idle_replacement():
    """Issue 28 item 6: executor 2 was lost, its subtask's retry ran on executor 1, and the
    replacement executor 3 joined. On the old code the plan kept subtasks 1 and 2 on
    executor 1 for good (one core: they ran one after the other, every batch) and gave
    executor 3 nothing."""
    hosts = {"0": "h", "1": "h", "3": "h"}
    got = plan(3, {0: "0", 1: "1", 2: "1"}, hosts)
    assert got == {0: "0", 1: "1", 2: "3"}
    assert plan(3, got, hosts) == got, "then it stays"


def test_spreading_moves_only_what_is_above_the_share():
    hosts = {"0": "h", "1": "h", "2": "h"}
    got = plan(6, {0: "0", 1: "0", 2: "0", 3: "0", 4: "1", 5: "1"}, hosts)
    assert got[0] == got[1] == "0" and got[4] == got[5] == "1"
    assert sorted(got.values()) == ["0", "0", "1", "1", "2", "2"]
    even = {0: "0", 1: "0", 2: "1", 3: "1"}  # 2 + 2 + 0: nobody is above the share of 2
    assert plan(4, even, hosts) == even


def test_block_manager_ids_as_spark_prints_them():
    text = ("BlockManagerId(driver, 10.0.0.1, 40411, None)\nBlockManagerId(1, 10.0.0.2, 33, None)"
            "\nBlockManagerId(12, host-b.local, 34, Some(rack-1))\n")
    assert parse_block_managers(text) == {"1": "10.0.0.2", "12": "host-b.local"}
    assert parse_block_managers("") == {}
    # anything else: the hosts are asked for one by one instead
    assert parse_block_managers("BlockManagerId(1, 10.0.0.2)") is None
    assert parse_block_managers("BlockManagerId(1, a b, 3, None)") is None
