"""Periodic materialization on its own schedule (FLIP-158 "Materializing state changes"):
with the background timer, state is materialized and the changelog truncated although no
checkpoint is taken; at most one materialization runs at a time; close stops the timer."""

from __future__ import annotations

import time

import dstl_ray as d

from ..ckpt_util import MAXP, client


def test_timer_materializes_without_checkpoints(tmp_path):
    base = f"file://{tmp_path}/dfs"
    b = d.ChangelogKeyedStateBackend(client("timer", base), "op", d.KeyGroupRange(0, MAXP - 1),
                                     MAXP, materialization_interval=0.1,
                                     materialize_in_background=True)
    v = b.value_state("v")
    deadline = time.time() + 20
    i = 0
    while b.materializations < 3 and time.time() < deadline:
        v.update(f"k{i % 50}", i)
        i += 1
        time.sleep(0.01)
    assert b.materializations >= 3
    assert b.materialized_sqn > 0
    snap = b.snapshot().result(timeout=30)
    b.close()
    done = b.materializations
    time.sleep(0.3)
    assert b.materializations == done  # the timer stopped with the backend
    # the snapshot (materialized state + changelog after it) restores to the same state
    want = {"v": {f"k{j % 50}": j for j in range(i)}}
    src = d.RestoreSource(snap, f"{base}", "timer", "test")
    r = d.ChangelogKeyedStateBackend(client("timer", base), "op", d.KeyGroupRange(0, MAXP - 1),
                                     MAXP, restore=[src], materialization_interval=None)
    assert r.dump() == want
    r.close()


def test_no_timer_by_default(tmp_path):
    base = f"file://{tmp_path}/dfs"
    b = d.ChangelogKeyedStateBackend(client("timer", base), "op", d.KeyGroupRange(0, MAXP - 1),
                                     MAXP, materialization_interval=0.05)
    b.value_state("v").update("k", 1)
    time.sleep(0.3)
    assert b.materializations == 0
    b.close()
