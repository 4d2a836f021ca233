"""Checkpoints completed from snapshots taken elsewhere (Spark tasks): ids are micro-batch ids,
must grow, and a replayed batch drops its checkpoint and completes it anew from the older
state, leaving storage with exactly the retained checkpoints' files."""

from __future__ import annotations

import pytest

import dstl_ray as d
from dstl_ray.checkpoint.recovery import assign_sources
from dstl_ray.storage.deleter import flush_deletes
from dstl_ray.storage.registry import get_storage

from ..ckpt_util import MAXP, client

JOB = "ext"


def _files(base: str) -> set[str]:
    assert flush_deletes(30)  # the deletes decided so far (they run in the background)
    root = f"{base}/{JOB}"
    return set(get_storage(root).list_files(root))


def _retained_files(coord) -> set[str]:
    cs = coord.completed_checkpoints()
    lease = {coord.lease.url} if coord.lease.incarnation is not None else set()
    return {u for c in cs for u in c.files.values()} | {c.metadata_url for c in cs} | lease


def _backend(base, restore=None):
    sources = assign_sources(restore, "op", 1)[0] if restore else []
    return d.ChangelogKeyedStateBackend(client(JOB, base), "op", d.KeyGroupRange(0, MAXP - 1),
                                        MAXP, restore=sources, materialization_interval=None)


def test_complete_drop_and_recomplete(tmp_path):
    base = f"file://{tmp_path}/dfs"
    coord = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=2)
    b = _backend(base)
    for batch in range(4):
        b.value_state("v").update("k", batch)
        if batch == 1:
            b.materialize().result(timeout=30)
        coord.complete_checkpoint(batch, [b.snapshot().result(timeout=30)])
    assert [c.checkpoint_id for c in coord.completed_checkpoints()] == [2, 3]
    with pytest.raises(d.CheckpointDeclinedError, match="ids must grow"):
        coord.complete_checkpoint(3, [b.snapshot().result(timeout=30)])
    assert _files(base) == _retained_files(coord)
    b.close()
    # batch 3 is replayed: drop checkpoint 3, recompute it from checkpoint 2
    assert coord.drop_checkpoints_from(3) == [3]
    assert _files(base) == _retained_files(coord)
    b2 = _backend(base, coord.latest_checkpoint())
    assert b2.dump() == {"v": {"k": 2}}
    b2.value_state("v").update("k", 33)
    cc = coord.complete_checkpoint(3, [b2.snapshot().result(timeout=30)])
    b2.close()
    b3 = _backend(base, cc)
    assert b3.dump() == {"v": {"k": 33}}
    b3.close()
    assert _files(base) == _retained_files(coord)
    coord.shutdown()


def test_batch_zero_is_a_valid_first_checkpoint(tmp_path):
    base = f"file://{tmp_path}/dfs"
    coord = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=2)
    b = _backend(base)
    b.value_state("v").update("a", 1)
    assert coord.complete_checkpoint(0, [b.snapshot().result(timeout=30)]).checkpoint_id == 0
    b.close()
    coord.shutdown()
