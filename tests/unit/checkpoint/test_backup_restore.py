"""Restores from a copy of the job's own directory (a backup), and from checkpoints that
name a savepoint's files. The copy's files have the job's own names at other paths: the
registry tells them apart by URL (docs/architecture.md "Checkpoint lifecycle"), so a
NO_CLAIM restore neither keeps the job's files forever nor deletes what is still named
(with file merging too); a copy under another base path is never claimed (its handles
cannot be named by the job's checkpoints, and the copy is the user's); a CLAIM never takes
over a savepoint's files."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

import dstl_ray as d
from dstl_ray.checkpoint.metadata import CheckpointMetadata
from dstl_ray.merging.pool import FileMergingOptions
from dstl_ray.storage.deleter import flush_deletes
from dstl_ray.storage.registry import get_storage

from ..ckpt_util import MAXP, Oracle, client, dump_all, files, referenced

JOB = "job"


def _job(base: str, retained: int = 2, **restore) -> tuple[d.CheckpointCoordinator, list]:
    coord = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=retained)
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


def test_a_backup_under_another_base_path_is_not_claimed(tmp_path):
    """A copy's handles name their files relative to its base path; claimed, the job's next
    checkpoint (taken before any materialization) named them relative to the job's own base
    path: the job's own files of those names, subsumed and deleted long ago (with one
    retained checkpoint, the restart after it failed with a missing file), and subsuming
    the claimed checkpoint deleted the backup's only copy. CLAIM is refused, naming both
    base paths; NO_CLAIM restores it, materializes first, and leaves the copy untouched."""
    base, oracle = f"file://{tmp_path}/dfs", Oracle()
    coord, bs = _job(base, retained=1)
    src = _step(coord, bs, oracle, "a", materialize=True)
    backup = _backup(tmp_path, base)
    copied = {u: get_storage(u).read_file(u) for u in files(backup, JOB)}
    want = oracle.copy()
    _step(coord, bs, oracle, "b", materialize=True)  # src's files subsumed in dfs
    _step(coord, bs, oracle, "c", materialize=True)
    coord.shutdown()
    chk = f"{backup}/{JOB}/" + src.metadata_url.split(f"/{JOB}/")[1]
    before = files(base, JOB)

    with pytest.raises(d.RestoreError, match="NO_CLAIM") as ei:
        _job(base, retained=1, checkpoint=chk, mode=d.RestoreMode.CLAIM)
    assert backup in str(ei.value) and base in str(ei.value)
    assert files(base, JOB) == before

    coord, bs = _job(base, retained=1, checkpoint=chk, mode=d.RestoreMode.NO_CLAIM)
    oracle.state = want
    assert dump_all(bs) == want
    cc = coord.trigger_checkpoint().result(timeout=60)  # no materialization of its own
    assert all(get_storage(u).exists(u) for u in cc.files.values())
    coord.abandon()  # a crash: the restart has only that checkpoint
    coord, bs = _job(base, retained=1)
    assert dump_all(bs) == want
    _run_on(coord, bs, oracle)
    coord.shutdown()
    assert {u: get_storage(u).read_file(u) for u in files(backup, JOB)} == copied


def test_a_copy_with_the_id_of_an_own_checkpoint_restores_in_no_claim_mode(tmp_path):
    """A copy of the job's directory with the id of one of its own retained checkpoints:
    not claimed (another base path), restored in NO_CLAIM mode, the job's own files
    untouched."""
    base, oracle = f"file://{tmp_path}/dfs", Oracle()
    coord, bs = _job(base)
    _step(coord, bs, oracle, "a")
    own = _step(coord, bs, oracle, "b", materialize=True)
    coord.shutdown()
    backup = _backup(tmp_path, base)
    before = files(base, JOB)
    chk = f"{backup}/{JOB}/" + own.metadata_url.split(f"/{JOB}/")[1]
    with pytest.raises(d.RestoreError, match="base path"):
        _job(base, checkpoint=chk, mode=d.RestoreMode.CLAIM)
    assert files(base, JOB) - {f"{base}/{JOB}/_lease"} == before - {f"{base}/{JOB}/_lease"}
    coord, bs = _job(base, checkpoint=chk, mode=d.RestoreMode.NO_CLAIM)
    assert dump_all(bs) == oracle.state
    coord.shutdown()
    coord, bs = _job(base)
    assert dump_all(bs) == oracle.state
    coord.shutdown()


def test_a_claimed_checkpoint_may_have_the_id_of_an_own_one(tmp_path):
    """Job "job" claims job "other"'s checkpoint 2 (same base path) while it retains its own
    checkpoint 2. The registry holds references per metadata URL, so the two are retained
    side by side and subsuming one never drops the other's references (keyed by id, it
    did; the claim was refused for that reason). Every file of both goes once subsumed."""
    base, oracle = f"file://{tmp_path}/dfs", Oracle()
    coord, bs = _job(base)
    _step(coord, bs, oracle, "a")
    own = _step(coord, bs, oracle, "b", materialize=True)
    coord.shutdown()
    other = d.CheckpointCoordinator("other", base, max_parallelism=MAXP, retained=2)
    obs = other.restore(client("other", base), "op", 2, materialization_interval=None)
    theirs_state = Oracle()
    _step(other, obs, theirs_state, "x")
    theirs = _step(other, obs, theirs_state, "y", materialize=True)
    other.shutdown()
    assert own.checkpoint_id == theirs.checkpoint_id == 2
    theirs_files = set(theirs.files.values())

    coord, bs = _job(base, checkpoint=theirs.metadata_url, mode=d.RestoreMode.CLAIM)
    assert dump_all(bs) == theirs_state.state
    assert [c.metadata_url for c in coord.completed_checkpoints()][-2:] in (
        [own.metadata_url, theirs.metadata_url], [theirs.metadata_url, own.metadata_url])
    cc = coord.trigger_checkpoint().result(timeout=60)
    assert all(get_storage(u).exists(u) for u in cc.files.values())
    _run_on(coord, bs, theirs_state)
    assert files(base, JOB) == referenced(coord)
    assert not theirs_files & files(base, "other")  # claimed, then subsumed: deleted
    coord.shutdown()
    coord, bs = _job(base)
    assert dump_all(bs) == theirs_state.state
    coord.shutdown()


def test_no_claim_restore_from_a_backup_with_file_merging_keeps_the_jobs_segments(tmp_path):
    """With file merging (FLIP-306), a restore took over a segment by its path relative to
    the job directory: the copy's ``shared/{subtask}/X`` was adopted as the job's own
    ``shared/{subtask}/X``, which the job's retained checkpoint still named, and deleted at
    once under the watermark (the restart from that checkpoint failed on the missing
    file). Only a segment of this very job directory is taken over."""
    merging = {"file_merging": FileMergingOptions("within_checkpoint")}
    base, oracle = f"file://{tmp_path}/dfs", Oracle()
    coord, bs = _job(base, retained=1, **merging)
    src = _step(coord, bs, oracle, "a", materialize=True)
    backup = _backup(tmp_path, base)
    copied = files(backup, JOB)
    for _ in range(3):  # more checkpoints, no materialization: the same segments
        last = coord.trigger_checkpoint().result(timeout=60)
    coord.shutdown()
    assert any("/shared/" in u for u in last.files.values())
    chk = f"{backup}/{JOB}/" + src.metadata_url.split(f"/{JOB}/")[1]

    coord, bs = _job(base, retained=1, checkpoint=chk, mode=d.RestoreMode.NO_CLAIM,
                     **merging)
    assert dump_all(bs) == oracle.state
    assert flush_deletes(30)
    assert all(get_storage(u).exists(u) for u in last.files.values())
    coord.abandon()  # a crash before the next checkpoint
    coord, bs = _job(base, retained=1, **merging)
    assert dump_all(bs) == oracle.state
    coord.shutdown()
    assert files(backup, JOB) == copied


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
