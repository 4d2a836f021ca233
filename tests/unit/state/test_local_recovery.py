"""Task-local recovery of the rocksdb table (Flink's local recovery): a restore on the machine
that materialized takes the SST files from its local copy (hard links, checked against the
handle's size and CRC32C) instead of downloading them; a damaged local copy is downloaded
instead; a folder keeps only its range's latest materialization, a rescale drops the
overlapping ranges' folders, and folders not written for a day are swept; a job of the same
id under another checkpoint directory never takes another's files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import dstl_ray as d
from dstl_ray.format.incremental import RocksDBHandle, UploadedFile
from dstl_ray.state.local_recovery import MAX_AGE_S, LocalRecovery
from dstl_ray.storage.registry import get_storage

from ..ckpt_util import MAXP, client, new_base

N = 20_000


def _job(base, local, parallelism=1, job="job"):
    coord = d.CheckpointCoordinator(job, base, max_parallelism=MAXP, retained=2)
    bs = coord.restore(client(job, base), "op", parallelism, materialization_interval=None,
                       state_backend="rocksdb", local_dir=str(local))
    return coord, bs


def _fill(b, n=N, tag="v"):
    s = b.value_state("s")
    for i in range(n):
        s.update(f"key-{i}", f"{tag}-{i}-" + "x" * 60)


def _root(local) -> str:
    return LocalRecovery(str(local)).root


def _kept(local) -> dict[str, int]:
    """Every file of the local recovery copies: name -> inode."""
    out = {}
    for dp, _, fs in os.walk(_root(local)):
        for f in fs:
            out[f] = os.stat(os.path.join(dp, f)).st_ino
    return out


def _materialized(tmp_path, n=N):
    base, local = new_base(tmp_path), tmp_path / "local"
    local.mkdir(exist_ok=True)
    coord, (b,) = _job(base, local)
    _fill(b, n)
    h = b.materialize().result(timeout=60)
    b.value_state("s").update("after", 1)  # in the changelog after the materialization
    coord.trigger_checkpoint().result()
    want = b.dump()
    coord.abandon()
    b.close()  # the worker goes; its local copy stays
    return base, local, h, want


def test_a_restore_on_the_same_machine_links_the_kept_files(tmp_path):
    base, local, h, want = _materialized(tmp_path)
    kept = _kept(local)
    assert set(kept) == {os.path.basename(f.path) for f in h.ssts}
    coord, (r,) = _job(base, local)
    assert r._table.recovery.taken == len(h.ssts)
    assert r.dump() == want
    db = os.path.join(r._table.path, "db")
    assert {os.stat(os.path.join(db, f.name)).st_ino for f in h.ssts} == set(kept.values())
    coord.shutdown()


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_a_dfs_copy_gone_fails_the_restore_even_with_a_local_copy(tmp_path, damage):
    """Later checkpoints name the restored files again: a restore that took them locally
    while the DFS lost them would hand on checkpoints no other machine can restore."""
    base, local, h, _ = _materialized(tmp_path)
    victim = f"{base}/job/{h.ssts[0].path}"
    st_ = get_storage(victim)
    if damage == "missing":
        st_.delete(victim)
    else:
        st_.write_file(victim, st_.read_file(victim)[:-10])
    with pytest.raises(d.RestoreError) as ei:
        _job(base, local)
    assert ei.value.path == victim


def test_a_checkpoint_after_a_local_restore_restores_on_another_machine(tmp_path):
    base, local, h, want = _materialized(tmp_path)
    coord, (r,) = _job(base, local)
    assert r._table.recovery.taken == len(h.ssts)
    r.value_state("s").update("later", 2)
    r.materialize(force=True).result(timeout=60)
    coord.trigger_checkpoint().result()
    want = r.dump()
    coord.abandon()
    r.close()
    coord, (e,) = _job(base, tmp_path / "elsewhere")
    assert e._table.recovery.taken == 0 and e.dump() == want
    coord.shutdown()


@pytest.mark.parametrize("damage", ["short", "flipped"])
def test_a_damaged_local_copy_is_downloaded_instead(tmp_path, damage):
    base, local, h, want = _materialized(tmp_path)
    folder = next(dp for dp, _, fs in os.walk(_root(local)) if fs)
    name = os.path.join(folder, os.path.basename(h.ssts[0].path))
    data = bytearray(Path(name).read_bytes())
    if damage == "short":
        data = data[:-10]
    else:  # the same size: only the CRC32C tells
        data[len(data) // 2] ^= 1
    os.unlink(name)  # a link shares its bytes with the database that wrote them: replace
    Path(name).write_bytes(bytes(data))
    coord, (r,) = _job(base, local)
    assert r._table.recovery.taken == len(h.ssts) - 1
    assert r.dump() == want
    assert not os.path.exists(name)  # dropped: not checked again by every restore
    coord.shutdown()


def test_a_restore_keeps_its_generation_through_the_next_materialization(tmp_path):
    """A restore, then a materialization whose checkpoint never completes: the next
    restore (of the same checkpoint) still finds the restored files here."""
    base, local, h, want = _materialized(tmp_path)
    coord, (r,) = _job(base, local)
    _fill(r, N, tag="again")
    r._table._db.compact_range(None, None)  # new files only
    h2 = r.materialize(force=True).result(timeout=60)
    assert not {f.path for f in h2.ssts} & {f.path for f in h.ssts}
    coord.abandon()  # no checkpoint names h2
    r.close()
    coord, (again,) = _job(base, local)
    assert again._table.recovery.taken == len(h.ssts) and again.dump() == want
    coord.shutdown()


def test_another_machine_downloads_and_the_folder_keeps_only_the_latest(tmp_path):
    base, local, h1, want = _materialized(tmp_path)
    coord, (r,) = _job(base, tmp_path / "elsewhere")  # no local copy there
    assert r._table.recovery.taken == 0 and r.dump() == want
    for i in range(0, N, 50):
        r.value_state("s").update(f"key-{i}", "changed")
    h2 = r.materialize(force=True).result(timeout=60)
    coord.trigger_checkpoint().result()
    coord.shutdown()
    # the machine that restored keeps exactly its latest materialization's files
    assert set(_kept(tmp_path / "elsewhere")) == {os.path.basename(f.path) for f in h2.ssts}
    assert set(_kept(local)) == {os.path.basename(f.path) for f in h1.ssts}


def test_an_unreadable_local_copy_is_downloaded(tmp_path, monkeypatch):
    base, local, h, want = _materialized(tmp_path)
    from dstl_ray.state import incremental

    def broken(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(incremental, "file_crc32c", broken)
    coord, (r,) = _job(base, local)
    assert r._table.recovery.taken == 0 and r.dump() == want
    coord.shutdown()


def test_a_damaged_copy_is_replaced_by_the_next_materialization(tmp_path):
    base, local = new_base(tmp_path), tmp_path / "local"
    local.mkdir()
    coord, (b,) = _job(base, local)
    _fill(b)
    h = b.materialize(force=True).result(timeout=60)
    folder = next(dp for dp, _, fs in os.walk(_root(local)) if fs)
    name = os.path.join(folder, os.path.basename(h.ssts[0].path))
    os.unlink(name)
    Path(name).write_bytes(b"garbage")  # another inode at the copy's name
    b.value_state("s").update("x", 1)
    h2 = b.materialize(force=True).result(timeout=60)
    assert h.ssts[0].path in {f.path for f in h2.ssts}
    assert os.path.getsize(name) == h.ssts[0].size
    coord.shutdown()


def test_a_folder_keeps_two_materializations_per_operator(tmp_path):
    base, local = new_base(tmp_path), tmp_path / "local"
    local.mkdir()
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP)
    cl = client("job", base)
    a = d.ChangelogKeyedStateBackend(cl, "a", d.KeyGroupRange(0, MAXP - 1), MAXP,
                                     materialization_interval=None, state_backend="rocksdb",
                                     local_dir=str(local))
    b = d.ChangelogKeyedStateBackend(cl, "b", d.KeyGroupRange(0, MAXP - 1), MAXP,
                                     materialization_interval=None, state_backend="rocksdb",
                                     local_dir=str(local))
    hs = []
    for i in range(3):
        for x in (a, b):
            _fill(x, 2000, tag=f"r{i}")
            x._table._db.compact_range(None, None)  # every SST new: nothing shared
        hs.append(a.materialize(force=True).result(timeout=60))
        b.materialize(force=True).result(timeout=60)
    kept = set(_kept(local))
    names = [{os.path.basename(f.path) for f in h.ssts} for h in hs]
    assert names[1] | names[2] <= kept and not names[0] & kept
    assert len(os.listdir(_root(local))) == 2  # one folder per operator
    a.close()
    b.close()
    coord.shutdown()


def test_a_root_open_to_others_is_made_private_and_a_linked_root_is_refused(tmp_path):
    local = tmp_path / "local"
    root = Path(_root(local))
    root.mkdir(parents=True)
    os.chmod(root, 0o755)  # ours, but readable by others: made private again
    base, local, h, want = _materialized(tmp_path)
    assert os.stat(root).st_mode & 0o777 == 0o700 and len(_kept(local)) == len(h.ssts)
    # a root that is a link (another user could point it anywhere) turns the feature off
    other = tmp_path / "other-local"
    Path(_root(other)).parent.mkdir(parents=True)
    os.symlink(root, _root(other))
    rec = LocalRecovery(str(other))
    assert rec.take(h, f"{base}/job", str(tmp_path), lambda f, p: True) == set()
    assert rec.sweep() == []


def test_the_sweep_never_follows_a_link(tmp_path):
    victim = tmp_path / "victim" / "0-127"
    victim.mkdir(parents=True)
    (victim / "data").write_text("keep me")
    old = os.stat(victim).st_mtime
    rec = LocalRecovery(str(tmp_path / "local"), clock=lambda: old + MAX_AGE_S + 1)
    os.makedirs(rec.root, mode=0o700)
    os.symlink(tmp_path / "victim", os.path.join(rec.root, "planted"))
    assert rec.sweep() == []
    assert (victim / "data").read_text() == "keep me"


def test_a_job_of_the_same_id_elsewhere_never_takes_anothers_files(tmp_path):
    base, local, h, want = _materialized(tmp_path)
    other = new_base(tmp_path / "other")
    coord, (b,) = _job(other, local)  # same job id, same machine, another directory
    _fill(b, 500, tag="o")
    b.materialize(force=True).result(timeout=60)
    coord.trigger_checkpoint().result()
    coord.shutdown()
    coord, (r,) = _job(base, local)  # the first job's copy is still whole
    assert r._table.recovery.taken == len(h.ssts) and r.dump() == want
    coord.shutdown()


def _handle(job: str, lo: int, hi: int, names: list[str]) -> RocksDBHandle:
    files = tuple(UploadedFile(f"{n}.sst", f"mat/{n}.sst", 1, 0) for n in names)
    return RocksDBHandle(job, d.KeyGroupRange(lo, hi), (), files,
                         UploadedFile("b", "mat/b.bundle", 1, 0))


def test_a_rescale_drops_overlapping_ranges_and_old_folders_are_swept(tmp_path):
    now = [1_000_000.0]
    rec = LocalRecovery(str(tmp_path), clock=lambda: now[0])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for n in ("a", "b", "c"):
        (ckpt / f"{n}.sst").write_bytes(n.encode())
    url = "file:///dfs/job"
    rec.keep(str(ckpt), _handle("job", 0, 63, ["a"]), url)
    rec.keep(str(ckpt), _handle("job", 64, 127, ["b"]), url)
    rec.keep(str(ckpt), _handle("job", 0, 42, ["c"]), url)  # rescaled 2 -> 3
    job_dir = os.path.join(rec.root, os.listdir(rec.root)[0])
    assert sorted(os.listdir(job_dir)) == ["0-42", "64-127"]
    assert os.listdir(os.path.join(job_dir, "0-42")) == ["c.sst"]
    dest = tmp_path / "dest"
    dest.mkdir()
    got = rec.take(_handle("job", 64, 127, ["b"]), url, str(dest), lambda f, p: True)
    assert got == {"b.sst"} and (dest / "b.sst").read_bytes() == b"b"
    now[0] = os.stat(os.path.join(job_dir, "0-42")).st_mtime + MAX_AGE_S + 1
    assert len(rec.sweep()) == 2
    assert os.listdir(rec.root) == []
