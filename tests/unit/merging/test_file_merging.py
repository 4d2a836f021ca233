"""File merging of materialized state (FLIP-306) on real files: restore equals the oracle
(also after rescale and failover take-over), nothing referenced is ever deleted, nothing
unreferenced stays, a lost subsume notification is made good by the next, compaction."""

from __future__ import annotations

import concurrent.futures
import os
import time

import pytest

import dstl_ray as d
from dstl_ray.checkpoint.recovery import restore_backends
from dstl_ray.merging.pool import FileMergingOptions
from dstl_ray.storage.deleter import flush_deletes

from ..ckpt_util import MAXP, Oracle, client, dump_all


def _job(base, parallelism, *, mode, retained=2, **mopts):
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP, retained=retained)
    bs = coord.restore(client("job", base), "op", parallelism, materialization_interval=0.0,
                       file_merging=FileMergingOptions(mode, **mopts))
    return coord, bs


def _fill(oracle, bs, r, keys=40):
    for i in range(keys):
        oracle.put(bs, f"k{i}", f"r{r}-{i}")
        if i % 4 == 0:
            oracle.map_put(bs, f"k{i}", r % 3, [r, i])


def _checkpoint(coord, bs):
    cc = coord.trigger_checkpoint().result(timeout=30)
    for b in bs:
        b.wait_materialization(30)
    return cc


def _rounds(oracle, coord, bs, rounds):
    for r in rounds:
        _fill(oracle, bs, r)
        _checkpoint(coord, bs)


def _running(tmp_path, parallelism, rounds):
    """A job merging across checkpoints after ``rounds`` of updates and checkpoints."""
    base = f"file://{tmp_path}/dfs"
    coord, bs = _job(base, parallelism, mode="across_checkpoints")
    oracle = Oracle()
    _rounds(oracle, coord, bs, range(rounds))
    return base, coord, bs, oracle


def _shared_on_disk(tmp_path) -> set[str]:
    assert flush_deletes(30)  # the deletes decided so far (they run in the background)
    root = tmp_path / "dfs" / "job" / "shared"
    return {"file://" + os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs}


def _referenced_shared(coord) -> set[str]:
    return {u for c in coord.completed_checkpoints() for u in c.files.values()
            if "/shared/" in u}


def _no_leftovers(tmp_path, coord, bs, timeout=10.0):
    """Storage holds exactly the merged files retained checkpoints name, plus those holding
    a live subtask's current state (a compaction's copy is named by the next checkpoint).
    Subsume notifications run right after a checkpoint's future resolves: allow a moment."""
    deadline = time.monotonic() + timeout
    while True:
        on_disk = _shared_on_disk(tmp_path)
        ref = _referenced_shared(coord) | {u for b in bs for u in b._files.base_files.values()
                                           if "/shared/" in u}
        if on_disk == ref or time.monotonic() > deadline:
            assert on_disk == ref
            return on_disk
        time.sleep(0.05)


def _restored_state(base, parallelism, cc):
    bs = restore_backends(client("reader", base), cc, "op", parallelism, MAXP,
                                     materialization_interval=None)
    try:
        return dump_all(bs)
    finally:
        for b in bs:
            b.close()


def _settle(coord, bs):
    """Stop materializing, then two checkpoints: every live segment is named by a retained
    checkpoint and everything older is subsumed."""
    for b in bs:
        b.materialization_interval = None
    _checkpoint(coord, bs)
    _checkpoint(coord, bs)


@pytest.mark.parametrize("mode", ["within_checkpoint", "across_checkpoints"])
def test_restore_from_merged_files_equals_the_oracle_and_nothing_leaks(tmp_path, mode):
    base = f"file://{tmp_path}/dfs"
    coord, bs = _job(base, 2, mode=mode, retained=3)
    oracle, expected = Oracle(), {}
    for r in range(10):
        _fill(oracle, bs, r)
        cc = _checkpoint(coord, bs)
        expected[cc.checkpoint_id] = oracle.copy()
        # no file is deleted while a retained checkpoint names one of its segments
        for c in coord.completed_checkpoints():
            missing = [u for u in c.files.values() if not os.path.exists(u[len("file://"):])]
            assert not missing, (c.checkpoint_id, missing)
        assert all(b.owned_dir and b.owned_dir.startswith("shared/") for b in bs)
    for c in coord.completed_checkpoints():
        assert _restored_state(base, 2, c) == expected[c.checkpoint_id]
    stats = [b.file_merging_stats() for b in bs]
    segments = sum(s["segments_written"] for s in stats)
    created = sum(s["files_created"] for s in stats)
    assert segments >= 10
    if mode == "across_checkpoints":
        assert created <= segments // 2, stats  # appended; rolled when mostly dead
    else:
        assert created == segments
    _settle(coord, bs)
    _no_leftovers(tmp_path, coord, bs)
    coord.shutdown()


def test_rescale_writes_copies_and_the_old_directories_go(tmp_path):
    base, coord, bs, oracle = _running(tmp_path, 2, 4)
    old_dirs = {b.owned_dir for b in bs}
    coord.shutdown()
    # restart at parallelism 3: state comes from the old subtasks' files
    coord, bs = _job(base, 3, mode="across_checkpoints")
    assert dump_all(bs) == oracle.copy()
    assert not old_dirs & {b.owned_dir for b in bs}
    for b in bs:  # each new subtask wrote its own copy at once (FLIP-306 4.2)
        b.wait_materialization(30)
        assert b.file_merging_stats()["segments_written"] == 1
    _rounds(oracle, coord, bs, range(4, 7))
    _settle(coord, bs)
    assert _restored_state(base, 3, coord.latest_checkpoint()) == oracle.copy()
    on_disk = _no_leftovers(tmp_path, coord, bs)
    assert not [u for u in on_disk if any(f"/shared/{o}/" in u for o in old_dirs)]
    coord.shutdown()


def test_failover_takes_the_directory_over(tmp_path):
    base, coord, bs, oracle = _running(tmp_path, 2, 5)
    dirs = sorted(b.owned_dir for b in bs)
    before = _shared_on_disk(tmp_path)
    for b in bs:  # the subtasks die (no close: nothing is cleaned up by them)
        b._stop.set()
    coord.abandon()  # and so does the driver
    coord2, bs2 = _job(base, 2, mode="across_checkpoints")
    assert sorted(b.owned_dir for b in bs2) == dirs
    assert dump_all(bs2) == oracle.copy()
    assert sum(b.file_merging_stats()["adopted"] for b in bs2) >= 1
    _rounds(oracle, coord2, bs2, range(5, 9))
    _settle(coord2, bs2)
    on_disk = _no_leftovers(tmp_path, coord2, bs2)
    assert not before & on_disk, "files taken over were freed once subsumed"
    assert _restored_state(base, 2, coord2.latest_checkpoint()) == oracle.copy()
    coord2.shutdown()


def test_a_lost_subsume_notification_is_made_good_by_the_next(tmp_path, monkeypatch):
    base = f"file://{tmp_path}/dfs"
    coord, bs = _job(base, 1, mode="within_checkpoint", retained=1)
    b = bs[0]
    real = type(b).notify_checkpoint_subsumed
    calls = {"n": 0}

    def lossy(self, watermark):
        calls["n"] += 1
        if calls["n"] % 4:  # three of every four notifications are lost
            return None
        return real(self, watermark)

    monkeypatch.setattr(type(b), "notify_checkpoint_subsumed", lossy)
    oracle = Oracle()
    peak = 0
    for r in range(12):
        _fill(oracle, bs, r)
        _checkpoint(coord, bs)
        peak = max(peak, len(_shared_on_disk(tmp_path)))
    assert peak <= 6, peak  # freed in bulk by every fourth notification
    monkeypatch.setattr(type(b), "notify_checkpoint_subsumed", real)
    _settle(coord, bs)
    _no_leftovers(tmp_path, coord, bs)
    assert _restored_state(base, 1, coord.latest_checkpoint()) == oracle.copy()
    coord.shutdown()


def test_space_amplification_compacts_the_state_of_a_quiet_subtask(tmp_path):
    base = f"file://{tmp_path}/dfs"
    coord, bs = _job(base, 1, mode="across_checkpoints", max_space_amplification=1.5,
                     retained=1)
    oracle = Oracle()
    _rounds(oracle, coord, bs, range(2))
    # nothing changes any more: the old segment dies, the open file holds dead bytes next
    # to the current state, which is copied into a fresh file
    for _ in range(4):
        _checkpoint(coord, bs)
    st = bs[0].file_merging_stats()
    assert st["compactions"] >= 1, st
    _settle(coord, bs)
    st = bs[0].file_merging_stats()
    assert st["amplification"] is not None and st["amplification"] <= 1.5, st
    _no_leftovers(tmp_path, coord, bs)
    assert _restored_state(base, 1, coord.latest_checkpoint()) == oracle.copy()
    coord.shutdown()


def test_merging_options_are_validated():
    with pytest.raises(d.ConfigError, match="file_merging"):
        d.ChangelogConfig(file_merging="sometimes")
    with pytest.raises(d.ConfigError, match="max_space_amplification"):
        d.ChangelogConfig(file_merging_max_space_amplification=0.5)
    with pytest.raises(d.ConfigError, match="max_file_pool_size"):
        FileMergingOptions("within_checkpoint", max_file_pool_size=0)
    with pytest.raises(d.ConfigError, match=r"s3:// makes an object visible"):
        FileMergingOptions("across_checkpoints").check_storage("s3://bucket/ckpt")
    FileMergingOptions("within_checkpoint").check_storage("s3://bucket/ckpt")
    cfg = d.ChangelogConfig.from_env({"DSTL_FILE_MERGING": "across_checkpoints",
                                      "DSTL_FILE_MERGING_MAX_FILE_SIZE": "1048576"})
    opts = FileMergingOptions.from_config(cfg)
    assert opts.across and opts.max_file_size == 1 << 20


def test_subtasks_in_other_processes_keep_their_directories(tmp_path):
    """The Spark path: backends the coordinator does not hold send snapshots (with their
    directory) and get the watermark with the next batch; the registry must not delete the
    merged files it counts, however unreferenced they look to it."""
    base = f"file://{tmp_path}/dfs"
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP, retained=2)
    bs = restore_backends(client("job", base), None, "op", 2, MAXP,
                          materialization_interval=0.0,
                          file_merging=FileMergingOptions("across_checkpoints"))
    oracle = Oracle()
    for n in range(1, 11):
        _fill(oracle, bs, n)
        for b in bs:
            b.notify_checkpoint_subsumed(coord.subsumed_watermark())
        snaps = [b.snapshot(checkpoint_id=n).result(timeout=30) for b in bs]
        assert all(s.owned_dir == b.owned_dir for s, b in zip(snaps, bs, strict=True))
        coord.complete_checkpoint(n, snaps)
        for b in bs:
            b.wait_materialization(30)
        for c in coord.completed_checkpoints():
            missing = [u for u in c.files.values() if not os.path.exists(u[len("file://"):])]
            assert not missing, (n, missing)
    assert _restored_state(base, 2, coord.latest_checkpoint()) == oracle.copy()
    for b in bs:
        b.close()


class _InlineExecutor(concurrent.futures.Executor):
    """Runs each task at once, in the caller: a forced materialization is durable before the
    backend's constructor returns (the order that lost state in the orphan cleanup)."""

    def submit(self, fn, /, *args, **kwargs):
        f: concurrent.futures.Future = concurrent.futures.Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001
            f.set_exception(e)
        return f


@pytest.mark.parametrize("mode", ["within_checkpoint", "across_checkpoints"])
def test_rescale_copies_written_during_restore_survive_its_orphan_cleanup(tmp_path, mode):
    """The new subtasks' own copies (forced materialization at a rescale) may be durable
    before the restore's orphan cleanup runs: they are live, never orphans."""
    base = f"file://{tmp_path}/dfs"
    coord, bs = _job(base, 2, mode=mode)
    oracle = Oracle()
    _rounds(oracle, coord, bs, range(3))
    coord.shutdown()
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP, retained=2)
    bs = coord.restore(client("job", base), "op", 3, materialization_interval=None,
                       file_merging=FileMergingOptions(mode), executor=_InlineExecutor())
    copies = {u for b in bs for u in b._files.base_files.values()}
    assert all(b.file_merging_stats()["segments_written"] == 1 for b in bs)
    gone = [u for u in copies if not os.path.exists(u[len("file://"):])]
    assert not gone, f"the restore's cleanup deleted the new subtasks' state: {gone}"
    _rounds(oracle, coord, bs, range(3, 5))
    assert _restored_state(base, 2, coord.latest_checkpoint()) == oracle.copy()
    coord.shutdown()
