"""The job's restore point (dstl_ray.checkpoint.restore_point; issue 28, "no silent start on
lost state"): a driver that restored from a savepoint or another job's checkpoint and died
before its first checkpoint is followed by one that restores the same state, not the job's
newest own checkpoint from before; once a checkpoint completed, recovery takes the latest
again; an explicit restore of the job's own checkpoint and a cancel that deletes the
checkpoints remove it; a restore point naming a checkpoint that is gone is an error naming
it, never a silent fallback."""

from __future__ import annotations

import pytest

import dstl_ray as d
from dstl_ray.checkpoint.restore_point import RESTORE_POINTS_DIR
from dstl_ray.errors import RestoreError
from dstl_ray.storage.registry import get_storage

from ..ckpt_util import MAXP, client

JOB = "job"


def _run(base: str, **restore) -> tuple[d.CheckpointCoordinator, list]:
    coord = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=3)
    return coord, coord.restore(client(JOB, base), "op", 2, materialization_interval=None,
                                **restore)


def _value(backends) -> dict:
    out: dict = {}
    for b in backends:
        out.update(b.dump().get("v", {}))
    return out


def _set(backends, value) -> None:
    for key in ("a", "b", "c"):
        owner = next(b for b in backends if d.assign_key_group(key, MAXP) in b.key_group_range)
        owner.value_state("v").update(key, value)


def test_a_crash_before_the_first_checkpoint_restores_the_savepoint_again(tmp_path):
    base = f"file://{tmp_path}/dfs"
    coord, bs = _run(base)
    _set(bs, "at-savepoint")
    coord.trigger_checkpoint().result(timeout=30)
    sp = coord.trigger_savepoint().result(timeout=30)
    _set(bs, "newer")
    coord.trigger_checkpoint().result(timeout=30)  # the job's newest own checkpoint
    coord.shutdown()
    coord, bs = _run(base, checkpoint=sp.metadata_url)  # the user restores the savepoint
    assert _value(bs) == dict.fromkeys("abc", "at-savepoint")
    point = get_storage(base).read_file(f"{base}/{RESTORE_POINTS_DIR}/{JOB}")
    assert sp.metadata_url.encode() in point
    coord.abandon()  # the driver dies before any checkpoint
    coord, bs = _run(base)  # recovery, no checkpoint named: the savepoint's state again
    assert _value(bs) == dict.fromkeys("abc", "at-savepoint")
    _set(bs, "after-restore")
    coord.trigger_checkpoint().result(timeout=30)  # from now on the job's latest counts
    coord.abandon()
    coord, bs = _run(base)
    assert _value(bs) == dict.fromkeys("abc", "after-restore")
    latest = coord.latest_checkpoint().metadata_url
    coord.abandon()
    coord, bs = _run(base, checkpoint=latest)
    assert not get_storage(base).exists(f"{base}/{RESTORE_POINTS_DIR}/{JOB}")  # own: gone
    coord.shutdown()


def test_a_cancel_that_deletes_the_checkpoints_removes_it(tmp_path):
    base = f"file://{tmp_path}/dfs"
    coord, bs = _run(base)
    _set(bs, "x")
    sp = coord.trigger_savepoint().result(timeout=30)
    coord.shutdown()
    coord, bs = _run(base, checkpoint=sp.metadata_url)
    coord.retention = d.CheckpointRetention.DELETE_ON_CANCELLATION
    coord.shutdown(cancel=True)
    assert not get_storage(base).exists(f"{base}/{RESTORE_POINTS_DIR}/{JOB}")
    coord, bs = _run(base)  # the job started again under its id: from nothing
    assert _value(bs) == {}
    coord.shutdown()


def test_a_restore_point_naming_a_checkpoint_that_is_gone_is_an_error(tmp_path):
    base = f"file://{tmp_path}/dfs"
    other = d.CheckpointCoordinator("other", base, max_parallelism=MAXP)
    (o,) = other.restore(client("other", base), "op", 1, materialization_interval=None)
    o.value_state("v").update("a", 1)
    theirs = other.trigger_checkpoint().result(timeout=30)
    coord, bs = _run(base, checkpoint=theirs.metadata_url, mode=d.RestoreMode.NO_CLAIM)
    assert _value(bs) == {"a": 1}
    coord.abandon()
    get_storage(base).delete(theirs.metadata_url)  # the other job's checkpoint is gone
    with pytest.raises(RestoreError, match=rf"restore point names {theirs.metadata_url}.*"
                                           rf"delete .*{RESTORE_POINTS_DIR}/{JOB}"):
        _run(base)
    other.shutdown()
