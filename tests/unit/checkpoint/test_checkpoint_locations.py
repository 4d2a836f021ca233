"""Checkpoint locations made ahead (dstl_ray.checkpoint.locations): ``begin_checkpoint``
makes ``chk-n`` while the snapshots are taken, the commit writes into it, and a location
that never gets its metadata does not stay behind. New directories on file:// are durable in
their parents."""

from __future__ import annotations

import os
import time

import pytest

import dstl_ray as d
from dstl_ray.errors import CheckpointDeclinedError
from dstl_ray.storage import local as local_mod
from dstl_ray.storage.deleter import flush_deletes
from dstl_ray.storage.local import LocalStorage

from ..ckpt_util import MAXP, FailingTransport, client

JOB = "locs"


def _job(tmp_path, transport=None):
    base = f"file://{tmp_path}/dfs"
    coord = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=2)
    b = d.ChangelogKeyedStateBackend(
        client(JOB, base, transport(JOB, base) if transport else None), "op",
        d.KeyGroupRange(0, MAXP - 1), MAXP, materialization_interval=None)
    return coord, b


def _chk(tmp_path) -> dict[str, list[str]]:
    """Each chk-n directory of the job, with what it holds (once the background discards
    ran)."""
    assert flush_deletes(30)
    job = tmp_path / "dfs" / JOB
    return {n: sorted(os.listdir(job / n)) for n in sorted(os.listdir(job))
            if n.startswith("chk-")}


def _wait_made(path, timeout=10.0) -> None:
    end = time.monotonic() + timeout
    while not path.is_dir():
        assert time.monotonic() < end, f"{path} was not made"
        time.sleep(0.005)


def test_a_begun_location_is_made_before_the_commit_and_holds_its_metadata(tmp_path):
    coord, b = _job(tmp_path)
    b.value_state("v").update("k", 1)
    coord.begin_checkpoint(1)
    _wait_made(tmp_path / "dfs" / JOB / "chk-1")  # before any snapshot was taken
    coord.complete_checkpoint(1, [b.snapshot().result(timeout=30)])
    assert _chk(tmp_path) == {"chk-1": ["_metadata"]}
    assert not coord.locations._begun and not coord.locations._ready  # nothing of it left
    b.close()
    coord.shutdown()


def test_a_location_that_never_completes_goes_when_a_newer_checkpoint_completes(tmp_path):
    """A micro-batch that failed and was not retried: its chk-n stays empty for good."""
    coord, b = _job(tmp_path)
    coord.begin_checkpoint(1)
    _wait_made(tmp_path / "dfs" / JOB / "chk-1")
    coord.begin_checkpoint(2)
    coord.complete_checkpoint(2, [b.snapshot().result(timeout=30)])
    assert _chk(tmp_path) == {"chk-2": ["_metadata"]}
    b.close()
    coord.shutdown()


def test_a_declined_checkpoint_leaves_no_location(tmp_path):
    """The trigger makes the location too (Flink's trigger does); declining the checkpoint
    removes it, as Flink discards a failed checkpoint's location."""
    coord, b = _job(tmp_path, FailingTransport)
    coord.register_backend(b)
    b.value_state("v").update("k", 1)
    pc = coord.trigger_checkpoint()
    with pytest.raises(CheckpointDeclinedError, match="DFS unavailable"):
        pc.future.result(timeout=30)
    assert _chk(tmp_path) == {}
    coord.shutdown()


def test_shutdown_removes_the_locations_never_completed(tmp_path):
    coord, b = _job(tmp_path)
    coord.complete_checkpoint(1, [b.snapshot().result(timeout=30)])
    coord.begin_checkpoint(2)
    _wait_made(tmp_path / "dfs" / JOB / "chk-2")
    b.close()
    coord.shutdown()
    assert _chk(tmp_path) == {"chk-1": ["_metadata"]}


def test_a_crashed_drivers_location_goes_with_the_next_runs_orphans(tmp_path):
    """A driver that dies between making chk-n and its metadata leaves chk-n empty; the
    next run's restore (its orphan cleanup) removes it and keeps the checkpoints."""
    base = f"file://{tmp_path}/dfs"
    coord, b = _job(tmp_path)
    coord.register_backend(b)
    b.value_state("v").update("k", 1)
    coord.trigger_checkpoint().result(timeout=30)  # chk-1
    coord.begin_checkpoint(2)
    _wait_made(tmp_path / "dfs" / JOB / "chk-2")
    coord.abandon()  # the driver dies
    (tmp_path / "dfs" / JOB / "chk-9" / "x").mkdir(parents=True)  # not empty: stays
    assert sorted(_chk(tmp_path)) == ["chk-1", "chk-2", "chk-9"]
    nxt = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=2,
                                  lease_ttl_s=0.5)
    restored = nxt.restore(client(JOB, base), "op", 1)
    assert restored[0].value_state("v").value("k") == 1
    assert _chk(tmp_path) == {"chk-1": ["_metadata"], "chk-9": ["x"]}
    nxt.shutdown()


def test_the_cleanup_spares_this_runs_locations_and_never_fails_a_restore(tmp_path):
    from dstl_ray.checkpoint.locations import remove_abandoned_locations
    from dstl_ray.errors import StorageError

    for n in (3, 4, 12):
        (tmp_path / "job" / f"chk-{n}").mkdir(parents=True)
    (tmp_path / "job" / "chk-x").mkdir()  # not a location's name
    st, checks = LocalStorage(), []
    tried = remove_abandoned_locations(f"file://{tmp_path}/job", st,
                                       lambda: checks.append(1), spare=lambda n: n == 4)
    assert sorted(os.listdir(tmp_path / "job")) == ["chk-4", "chk-x"]
    assert len(tried) == len(checks) == 2  # a lease check before each removal

    class Unlistable(LocalStorage):
        def list_dirs(self, path):
            raise StorageError(f"cannot list directories of {path}: injected")

    assert remove_abandoned_locations(f"file://{tmp_path}/job", Unlistable(),
                                      lambda: None) == []
    assert sorted(os.listdir(tmp_path / "job")) == ["chk-4", "chk-x"]


def test_a_location_begun_again_for_a_retained_checkpoint_is_left_whole(tmp_path):
    """Beginning an id that is complete already (a caller's mistake) makes nothing, and the
    location's later removal leaves a directory that holds a checkpoint as it is."""
    coord, b = _job(tmp_path)
    coord.complete_checkpoint(1, [b.snapshot().result(timeout=30)])
    coord.begin_checkpoint(1)
    with pytest.raises(CheckpointDeclinedError, match="already complete"):
        coord.complete_checkpoint(1, [b.snapshot().result(timeout=30)])
    coord.complete_checkpoint(2, [b.snapshot().result(timeout=30)])
    assert _chk(tmp_path) == {"chk-1": ["_metadata"], "chk-2": ["_metadata"]}
    b.close()
    coord.shutdown()


def test_a_location_does_not_wait_behind_commits_waiting_for_the_commit_lock(tmp_path):
    """Commits wait for their location holding the commit lock: were locations made on the
    coordinator's executor, a location queued behind commits waiting for that lock would
    never be made (max_concurrent=1: three threads, all taken here)."""
    import threading

    coord, b = _job(tmp_path)
    coord.max_concurrent = 1
    snap = b.snapshot().result(timeout=30)
    create, reached, go = coord.metadata._create, threading.Event(), threading.Event()

    def held(url, data):
        if url.endswith("chk-10/_metadata"):
            reached.set()
            go.wait(30)
        return create(url, data)

    coord.metadata._create = held
    done: dict[int, object] = {}

    def complete(n):
        try:
            done[n] = coord.complete_checkpoint(n, [snap]).checkpoint_id
        except CheckpointDeclinedError as e:  # 12 took the commit lock before 11: subsumed
            done[n] = str(e)

    threads = [threading.Thread(target=complete, args=(n,), daemon=True) for n in (10, 11, 12)]
    threads[0].start()
    assert reached.wait(10)
    for t in threads[1:]:
        t.start()
    coord.begin_checkpoint(13)
    _wait_made(tmp_path / "dfs" / JOB / "chk-13")  # made while every commit waits
    go.set()
    for t in threads:
        t.join(30)
    # every commit went through once its location was there (which of 11 and 12 took the
    # lock first is the threads' race; 11 after 12 is subsumed, as the FLIP has it)
    assert done[10] == 10 and done[12] == 12
    assert done[11] == 11 or "checkpoint 12 completed first" in str(done[11]), done
    coord.complete_checkpoint(13, [snap])
    b.close()
    coord.shutdown()


def test_a_location_that_failed_ahead_is_made_by_the_commit_its_name_durable(tmp_path, synced,
                                                                              monkeypatch):
    coord, b = _job(tmp_path)
    coord.complete_checkpoint(1, [b.snapshot().result(timeout=30)])
    job = os.path.realpath(tmp_path / "dfs" / JOB)
    real, failed = local_mod._sync_dir, []

    def fail_once(directory):
        if not failed and os.path.realpath(directory) == job:
            failed.append(directory)
            raise OSError(5, "Input/output error (injected)")
        real(directory)

    monkeypatch.setattr(local_mod, "_sync_dir", fail_once)
    synced.clear()
    coord.begin_checkpoint(2)
    coord.complete_checkpoint(2, [b.snapshot().result(timeout=30)])
    assert failed and os.path.realpath(failed[0]) == job  # ahead: mkdir done, fsync failed
    assert synced.count(job) == 1  # the commit fsynced the job directory after all
    assert _chk(tmp_path) == {"chk-1": ["_metadata"], "chk-2": ["_metadata"]}
    b.close()
    coord.shutdown()


def test_a_fenced_driver_removes_no_location(tmp_path):
    from dstl_ray.checkpoint.locations import CheckpointLocations
    from dstl_ray.errors import JobLeaseError

    fenced = []

    def guard():
        if fenced:
            raise JobLeaseError("taken over")

    locs = CheckpointLocations(LocalStorage(), f"file://{tmp_path}/job", guard,
                               lambda url: None)
    locs.begin(1, f"file://{tmp_path}/job/chk-1/_metadata")
    _wait_made(tmp_path / "job" / "chk-1")
    fenced.append(True)
    locs.begin(2, f"file://{tmp_path}/job/chk-2/_metadata")  # makes nothing either
    locs.close()
    assert sorted(os.listdir(tmp_path / "job")) == ["chk-1"]


@pytest.fixture
def synced(monkeypatch) -> list[str]:
    """The directories LocalStorage fsyncs, in order."""
    seen: list[str] = []
    real = local_mod._sync_dir

    def record(directory: str) -> None:
        seen.append(os.path.realpath(directory))
        real(directory)

    monkeypatch.setattr(local_mod, "_sync_dir", record)
    return seen


def test_new_directories_are_durable_in_their_parents(tmp_path, synced):
    """A directory's name lives in its parent: each new one's parent is fsynced (an fsync
    of the new directory itself, after a file is linked in it, does not persist it)."""
    root = os.path.realpath(tmp_path)
    LocalStorage().make_dirs(f"file://{root}/a/b/c")
    assert synced == [root, f"{root}/a", f"{root}/a/b"]
    synced.clear()
    LocalStorage().make_dirs(f"file://{root}/a/b/c")  # there already: its name made durable
    assert synced == [f"{root}/a/b"]
    synced.clear()
    LocalStorage().create_file(f"file://{root}/a/x/_metadata", b"m")
    assert synced == [f"{root}/a", f"{root}/a/x"]  # the new chk-n, then its new name
    synced.clear()
    LocalStorage().write_file(f"file://{root}/y/z/f", b"f")
    assert synced == [root, f"{root}/y", f"{root}/y/z"]
    synced.clear()
    LocalStorage().append_file(f"file://{root}/w/seg", b"s")
    assert synced == [root, f"{root}/w"]


def test_relative_directories_are_made_too(tmp_path, monkeypatch, synced):
    monkeypatch.chdir(tmp_path)
    local_mod._make_dirs("rel/a/b", True)
    assert (tmp_path / "rel" / "a" / "b").is_dir()
    assert synced == [str(tmp_path.resolve()), str((tmp_path / "rel").resolve()),
                      str((tmp_path / "rel" / "a").resolve())]


def test_make_dirs_makes_an_existing_directorys_name_durable(tmp_path, synced):
    """Its maker may not have fsynced the parent yet: make_dirs (a chk-n ahead of its
    metadata) does, whoever made it."""
    (tmp_path / "there").mkdir()
    LocalStorage().make_dirs(f"file://{tmp_path}/there")
    assert synced == [str(tmp_path.resolve())]


def test_no_fsync_storage_syncs_no_directory(tmp_path, synced):
    LocalStorage(fsync=False).write_file(f"file://{tmp_path}/q/r/f", b"f")
    assert synced == [] and (tmp_path / "q" / "r" / "f").read_bytes() == b"f"
