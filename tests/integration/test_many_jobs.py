"""Many jobs, one tree: a job's failure never fails another job, and a job id used again on
a long-lived tree starts clean (its new files are never freed with the old run's knowledge)."""

from __future__ import annotations

import json
import os
import time

import pytest

import dstl_ray as d
from dstl_ray.checkpoint.recovery import restore_backends
from dstl_ray.errors import StaleIncarnationError

MAXP = 16


def test_one_jobs_dfs_failure_fails_only_that_job(tree_factory, namespace, tmp_path):
    base = f"file://{tmp_path}/dfs"
    faults = json.dumps({"error_rate": 1.0, "match": "/badjob/", "seed": 3})
    tree = tree_factory(base=base, fault_spec=faults, plugins="dstl_ray.testing",
                        persist_delay_s=0.3, max_attempts=2,
                        retry_delay_s=0.01)
    good = d.StateChangelogClient("goodjob", namespace=namespace)
    bad = d.StateChangelogClient("badjob", namespace=namespace)
    wg = good.create_writer("op", d.KeyGroupRange(0, 7))
    wb = bad.create_writer("op", d.KeyGroupRange(0, 7))
    for w in (wg, wb):
        w.append(1, b"change")
    # both requests reach the node within its persist delay: one batch, two jobs
    fg = wg.persist_durably(after=0, checkpoint_id=1)
    fb = wb.persist_durably(after=0, checkpoint_id=1)
    with pytest.raises(d.PersistError) as ei:
        fb.result(timeout=60)
    assert "badjob" in str(ei.value)
    handle = fg.result(timeout=60)  # the healthy job is untouched by the other's DFS error
    assert list(handle.get_state_changes(1)) == [b"change"]
    for seg in handle.segments:
        assert os.path.exists(f"{tmp_path}/dfs/goodjob/{seg.path}")
    assert sum(s["batches"] for s in tree.status()) == 1, "the test wants one shared batch"
    good.close()
    bad.close()


def _update(bs, state, rnd, keys=40):
    for i in range(keys):
        k = f"k{(rnd * 7 + i) % 60}"
        state[k] = state.get(k, 0) + 1
        kg = d.assign_key_group(k, MAXP)
        next(b for b in bs if kg in b.key_group_range).value_state("n").update(k, state[k])


def _run(base, namespace, rounds, **kw):
    coord = d.CheckpointCoordinator("reused", base, max_parallelism=MAXP, retained=2,
                                    retention=d.CheckpointRetention.DELETE_ON_CANCELLATION)
    bs = coord.restore(d.StateChangelogClient("reused", namespace=namespace), "op", 2,
                       materialization_interval=0.2)
    state: dict[str, int] = {}
    for r in range(rounds):
        _update(bs, state, r)
        coord.trigger_checkpoint().result(timeout=60)
        for c in coord.completed_checkpoints():  # nothing a retained checkpoint names is gone
            gone = [u for u in c.files.values() if not os.path.exists(u[len("file://"):])]
            assert not gone, (c.checkpoint_id, gone)
        time.sleep(0.05)
    return coord, bs, state


def test_a_job_id_reused_on_a_long_lived_tree_starts_clean(tree_factory, namespace, tmp_path):
    base = f"file://{tmp_path}/dfs"
    tree = tree_factory(base=base, file_merging="across_checkpoints")
    coord, bs, _ = _run(base, namespace, 14)  # the nodes learn a watermark near 12
    coord.shutdown(cancel=True)  # DELETE_ON_CANCELLATION: ids start at 1 again
    coord, bs, state = _run(base, namespace, 8)
    latest = coord.latest_checkpoint()
    reader = restore_backends(d.StateChangelogClient("reused-r", namespace=namespace), latest,
                              "op", 1, MAXP, materialization_interval=None)
    assert reader[0].dump()["n"] == state
    reader[0].close()
    assert sum(s["incarnations"] for s in tree.status()) >= 1
    coord.shutdown()


def test_an_older_incarnations_requests_are_refused(tree_factory, namespace, tmp_path):
    base = f"file://{tmp_path}/dfs"
    tree_factory(base=base)
    old = d.StateChangelogClient("inc", namespace=namespace).create_writer(
        "op", d.KeyGroupRange(0, 7))
    new = d.StateChangelogClient("inc", namespace=namespace).create_writer(
        "op", d.KeyGroupRange(0, 7))
    old.incarnation, new.incarnation = "100-aaaa", "200-bbbb"
    for w in (old, new):
        w.append(0, b"x")
    new.persist_durably(after=0, checkpoint_id=1).result(timeout=60)
    with pytest.raises(d.PersistError) as ei:
        old.persist_durably(after=0, checkpoint_id=1).result(timeout=60)
    assert isinstance(ei.value.__cause__, StaleIncarnationError) or "incarnation" in str(
        ei.value)
