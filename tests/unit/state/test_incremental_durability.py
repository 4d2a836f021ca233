"""Durability of incremental rocksdb materialization under restores that are not the plain
"same job, same directory" case: a checkpoint of a job with the same id in another
checkpoint directory (the SST files it names are not under this job's directory, so they
must be uploaded again, never named), a rescale whose restore opens more than one handle as
its database (only the last one's SST files are uploaded already), and a restore whose local
disk fails while the downloaded files become the database (the working directory must not
stay behind)."""

from __future__ import annotations

import os

import pytest

import dstl_ray as d
from dstl_ray.errors import LocalStateError
from dstl_ray.state import rocksdb as rocksdb_mod
from dstl_ray.storage.registry import get_storage

from ..ckpt_util import MAXP, client, new_base, workdirs


def _keys_in(lo: int, hi: int, n: int, tag: str) -> list[str]:
    """``n`` keys whose key groups lie in ``lo..hi``."""
    out, i = [], 0
    while len(out) < n:
        k = f"{tag}{i:04d}"
        i += 1
        if lo <= d.assign_key_group(k, MAXP) <= hi:
            out.append(k)
    return out


def _restore(job, base, local, parallelism, **opts):
    coord = d.CheckpointCoordinator(job, base, max_parallelism=MAXP)
    bs = coord.restore(client(job, base), "op", parallelism, materialization_interval=None,
                       state_backend="rocksdb", local_dir=str(local), **opts)
    return coord, bs


def test_a_checkpoint_of_the_same_job_id_elsewhere_has_its_ssts_uploaded_again(tmp_path):
    """Job "job" moves to another checkpoint directory and restores the old directory's
    checkpoint explicitly (NO_CLAIM: a checkpoint under another base path is never
    claimed). Its SST files live under the old directory: a materialization that names
    them as uploaded (paths relative to the new job directory) writes a checkpoint whose
    files do not exist, and the next restore fails."""
    mode = d.RestoreMode.NO_CLAIM
    local = tmp_path / "local"
    local.mkdir()
    old_base, new_base_ = new_base(), new_base()
    coord, (b,) = _restore("job", old_base, local, 1)
    for i in range(200):
        b.value_state("v").update(f"k{i}", i)
    b.materialize().result(timeout=60)
    src = coord.trigger_checkpoint().result()
    coord.shutdown()

    coord, (r,) = _restore("job", new_base_, local, 1, checkpoint=src.metadata_url,
                           mode=mode)
    r.value_state("v").update("new", 1)
    h = r.materialize(force=True).result(timeout=60)
    coord.trigger_checkpoint().result()
    want = r.dump()
    coord.shutdown()
    # every file the new handle names exists under the new job directory
    root = f"{new_base_}/job"
    st = get_storage(root)
    missing = [f.path for f in h.files() if not st.exists(f"{root}/{f.path}")]
    assert missing == []
    coord, (again,) = _restore("job", new_base_, local, 1)
    assert again.dump() == want
    coord.shutdown()


def test_a_restore_that_opens_two_handles_seeds_only_the_database_it_kept(tmp_path):
    """Rescale 2 -> 3: the middle subtask (key groups 6..10) reads subtask 0's handle for
    6..7, where it has no entries, so its table is still empty when subtask 1's handle
    comes and becomes the database instead. Only that handle's SST files are in the
    database; subtask 0's local names must not count as uploaded (the next SST RocksDB
    writes under such a name would be named by the other database's upload)."""
    local = tmp_path / "local"
    local.mkdir()
    base = new_base()
    coord, (a, b) = _restore("job", base, local, 2)
    assert (a.key_group_range.end, b.key_group_range.start) == (7, 8)
    for k in _keys_in(0, 5, 3, "a"):  # three SST files, none with key groups 6..7
        a.value_state("v").update(k, "x" * 20)
        a.materialize().result(timeout=60)
    for k in _keys_in(8, 10, 1, "b"):
        b.value_state("v").update(k, "x" * 20)
        b.materialize().result(timeout=60)
    coord.trigger_checkpoint().result()
    coord.abandon()
    a.close()
    b.close()
    coord, bs = _restore("job", base, local, 3)
    z = bs[1]
    assert (z.key_group_range.start, z.key_group_range.end) == (6, 10)
    db = f"{z._table.path}/db"
    on_disk = {n: os.path.getsize(f"{db}/{n}") for n in os.listdir(db) if n.endswith(".sst")}
    known = z._files.ssts.known
    assert set(known) <= set(on_disk), sorted(set(known) - set(on_disk))
    assert {n: f.size for n, f in known.items()} == {n: on_disk[n] for n in known}
    coord.shutdown()


def test_a_disk_error_while_the_restored_files_become_the_database_leaves_no_directory(
        tmp_path, monkeypatch):
    """A full disk fails opening the downloaded database and then the empty stand-in: the
    table is left without a database, and closing it must still delete its working
    directory (a full copy of the state; the worker retries, and every retry would leave
    one more)."""
    local = tmp_path / "local"
    local.mkdir()
    base = new_base()
    coord, (b,) = _restore("job", base, local, 1)
    for i in range(200):
        b.value_state("v").update(f"k{i}", i)
    b.materialize().result(timeout=60)
    coord.trigger_checkpoint().result()
    coord.shutdown()
    assert workdirs(local) == []

    real_open = rocksdb_mod.open_db

    def full_disk(path: str, where: str):
        # the database the table starts with does not exist yet; the downloaded one and
        # the empty stand-in fail
        if os.path.exists(path) or "/empty-" in path:
            raise LocalStateError(f"RocksDB state table in {where}: opening failed: "
                                  f"No space left on device")
        return real_open(path, where)

    monkeypatch.setattr(rocksdb_mod, "open_db", full_disk)
    with pytest.raises(d.StateError):
        _restore("job", base, local, 1)
    assert workdirs(local) == []


def test_a_failed_rename_of_the_restored_files_is_a_local_error_and_leaves_no_directory(
        tmp_path, monkeypatch):
    local = tmp_path / "local"
    local.mkdir()
    base = new_base()
    coord, (b,) = _restore("job", base, local, 1)
    b.value_state("v").update("k", 1)
    b.materialize().result(timeout=60)
    coord.trigger_checkpoint().result()
    coord.shutdown()

    def rename(src: str, dst: str) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(rocksdb_mod.os, "rename", rename)
    with pytest.raises(LocalStateError):
        _restore("job", base, local, 1)
    assert workdirs(local) == []
