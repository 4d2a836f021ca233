"""Restores from a copy of the job's own directory (a backup), and from checkpoints that
name a savepoint's files. The copy's files have the job's own names at other paths: the
registry tells them apart by URL (docs/architecture.md "Checkpoint lifecycle"), so neither
restore mode keeps the job's files forever or deletes what is still named, and a CLAIM
never takes over a savepoint's files."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

import dstl_ray as d
from dstl_ray.checkpoint.recovery import load_checkpoint
from dstl_ray.checkpoint.snapshot import CheckpointMetadata
from dstl_ray.storage.registry import get_storage

from ..ckpt_util import MAXP, Oracle, client, dump_all, files, referenced

JOB = "job"


def _job(base: str, **restore) -> tuple[d.CheckpointCoordinator, list]:
    coord = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=2)
    return coord, coord.restore(client(JOB, base), "op", 2, materialization_interval=None,
                                **restore)


def _step(coord, bs, oracle: Oracle, tag: str, materialize: bool = False
          ) -> d.CompletedCheckpoint:
    for i in range(20):
        oracle.put(bs, f"k{i}", f"{tag}{i}")
        oracle.map_put(bs, f"k{i % 4}", i % 3, tag)
    if materialize:  # a checkpoint of materialized state only
        for b in bs:
            b.materialize(force=True).result(timeout=60)
    return coord.trigger_checkpoint().result(timeout=60)


def _backup(tmp_path, base: str) -> str:
    """A copy of the job's directory (its lease left out: a backup tool copies data).
    Only its checkpoints of materialized state restore from another place: a changelog
    handle names its job directory by full URL, and a handle of another directory is
    refused."""
    shutil.copytree(tmp_path / "dfs" / JOB, tmp_path / "backup" / JOB,
                    ignore=shutil.ignore_patterns("_lease"))
    return f"file://{tmp_path}/backup"


def _run_on(coord, bs, oracle: Oracle) -> None:
    """Checkpoints with materializations until none of the restore's ones is retained."""
    for i in range(4):
        _step(coord, bs, oracle, f"n{i}", materialize=True)


def test_no_claim_restore_from_a_backup_leaves_no_file_of_the_job_behind(tmp_path):
    base, oracle = f"file://{tmp_path}/dfs", Oracle()
    coord, bs = _job(base)
    _step(coord, bs, oracle, "a")
    _step(coord, bs, oracle, "b", materialize=True)
    coord.shutdown()
    backup = _backup(tmp_path, base)
    copied = files(backup, JOB)
    chk = f"{backup}/{JOB}/" + coord.latest_checkpoint().metadata_url.split(f"/{JOB}/")[1]

    coord, bs = _job(base, checkpoint=chk, mode=d.RestoreMode.NO_CLAIM)
    assert dump_all(bs) == oracle.state
    _run_on(coord, bs, oracle)
    # keyed by name, the copy's protection kept the job's own files of those names
    assert files(base, JOB) == referenced(coord)
    assert files(backup, JOB) == copied  # the copy is untouched
    coord.shutdown()
    coord, bs = _job(base)
    assert dump_all(bs) == oracle.state
    coord.shutdown()


def test_claim_restore_from_a_backup_owns_the_copy(tmp_path):
    """Claimed, the copy's checkpoint is the job's: its files go once no retained checkpoint
    names them (keyed by name, the registry knew only the job's own URL of each name, so the
    copy's files stayed forever). The job's own newer checkpoints are kept."""
    base, oracle = f"file://{tmp_path}/dfs", Oracle()
    coord, bs = _job(base)
    _step(coord, bs, oracle, "a")
    src = _step(coord, bs, oracle, "b", materialize=True)
    backup = _backup(tmp_path, base)
    want = oracle.copy()
    _step(coord, bs, oracle, "c")
    _step(coord, bs, oracle, "d")
    coord.shutdown()
    chk = f"{backup}/{JOB}/" + src.metadata_url.split(f"/{JOB}/")[1]
    claimed = set(load_checkpoint(chk).files.values())

    coord, bs = _job(base, checkpoint=chk, mode=d.RestoreMode.CLAIM)
    oracle.state = want
    assert dump_all(bs) == oracle.state
    _run_on(coord, bs, oracle)
    live = {u for c in coord.completed_checkpoints() for u in c.files.values()}
    assert not (claimed - live) & files(backup, JOB)  # claimed, then subsumed: deleted
    assert files(base, JOB) == referenced(coord)
    coord.shutdown()


def test_claim_of_a_copy_with_the_id_of_an_own_checkpoint_is_refused(tmp_path):
    """Two retained checkpoints of one id share their references in the registry:
    subsuming one dropped the other's. Refused, naming both; NO_CLAIM restores it."""
    base, oracle = f"file://{tmp_path}/dfs", Oracle()
    coord, bs = _job(base)
    _step(coord, bs, oracle, "a")
    own = _step(coord, bs, oracle, "b", materialize=True)
    coord.shutdown()
    backup = _backup(tmp_path, base)
    before = files(base, JOB)
    chk = f"{backup}/{JOB}/" + own.metadata_url.split(f"/{JOB}/")[1]
    with pytest.raises(d.RestoreError, match="same id") as ei:
        _job(base, checkpoint=chk, mode=d.RestoreMode.CLAIM)
    assert own.metadata_url in str(ei.value) and chk in str(ei.value)
    assert files(base, JOB) - {f"{base}/{JOB}/_lease"} == before - {f"{base}/{JOB}/_lease"}
    coord, bs = _job(base, checkpoint=chk, mode=d.RestoreMode.NO_CLAIM)
    assert dump_all(bs) == oracle.state
    coord.shutdown()


def test_a_claimed_checkpoint_never_takes_over_savepoint_files(tmp_path):
    """A checkpoint (of another job, forged: dstl-ray writes none) that names a savepoint's
    files, restored in CLAIM mode: those files are protected, so subsuming it deletes none
    of them."""
    base, oracle = f"file://{tmp_path}/dfs", Oracle()
    coord, bs = _job(base)
    _step(coord, bs, oracle, "a")
    sp = coord.trigger_savepoint().result(timeout=60)
    coord.shutdown()
    sp_dir = sp.metadata_url.rsplit("/", 1)[0]
    rel = sp_dir.split(f"/{JOB}/")[1]
    snaps = tuple(dataclasses.replace(s, components=tuple(
        dataclasses.replace(c, job=JOB, path=f"{rel}/{c.path}") for c in s.components))
        for s in sp.metadata.snapshots)
    meta = CheckpointMetadata("other", 5, "checkpoint", MAXP, snaps)
    url = f"{base}/forged/chk-5/_metadata"
    get_storage(url).write_file(url, meta.to_json().encode())
    sp_files = {u for u in files(base, JOB) if u.startswith(sp_dir + "/")}
    assert set(sp.files.values()) < sp_files

    other = d.CheckpointCoordinator("other", base, max_parallelism=MAXP, retained=1)
    obs = other.restore(client("other", base), "op", 2, checkpoint=url,
                        mode=d.RestoreMode.CLAIM, materialization_interval=None)
    assert dump_all(obs) == oracle.state
    _run_on(other, obs, oracle)
    other.shutdown()
    assert {u for u in files(base, JOB) if u.startswith(sp_dir + "/")} == sp_files
