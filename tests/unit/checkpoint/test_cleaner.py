"""Subsumed checkpoints go in the background (dstl_ray.checkpoint.cleaner, Flink's
CheckpointsCleaner): completing a checkpoint does not wait for the deletes; flushing the
deleter waits for them and the file deletes they hand over; shutdown waits for them; a
crashed driver's queued discards never run and the next run's recovery deletes what they
would have."""

from __future__ import annotations

import os
import threading

import dstl_ray as d
from dstl_ray.checkpoint import cleaner as cleaner_mod
from dstl_ray.storage.deleter import flush_deletes

from ..ckpt_util import MAXP, client, files, referenced

JOB = "clean"


def _chk_dirs(tmp_path) -> list[str]:
    return sorted(n for n in os.listdir(tmp_path / "dfs" / JOB) if n.startswith("chk-"))


class _Gate:
    """Holds every metadata delete until opened; remembers their order."""

    def __init__(self, monkeypatch) -> None:
        self.open = threading.Event()
        self.urls: list[str] = []
        real = cleaner_mod.delete_metadata

        def held(url: str) -> None:
            self.urls.append(url)
            assert self.open.wait(30), "the test never opened the gate"
            real(url)

        monkeypatch.setattr(cleaner_mod, "delete_metadata", held)


def _setup(tmp_path):
    base = f"file://{tmp_path}/dfs"
    coord = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=1,
                                    lease_ttl_s=1.0)
    b = d.ChangelogKeyedStateBackend(client(JOB, base), "op", d.KeyGroupRange(0, MAXP - 1),
                                     MAXP, materialization_interval=None)
    return base, coord, b


def _complete(coord, b, n: int) -> None:
    b.value_state("v").update("k", n)
    coord.complete_checkpoint(n, [b.snapshot().result(timeout=30)])


def test_completing_does_not_wait_for_the_subsumed_checkpoints_to_go(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    base, coord, b = _setup(tmp_path)
    try:
        for n in (1, 2, 3):  # 2 subsumes 1 (its delete is held), 3 subsumes 2 (queued)
            _complete(coord, b, n)
        assert coord.latest_checkpoint().checkpoint_id == 3
        assert [c.checkpoint_id for c in coord.completed_checkpoints()] == [3]
        assert _chk_dirs(tmp_path) == ["chk-1", "chk-2", "chk-3"]  # nothing deleted yet
        assert not flush_deletes(timeout=0.2)
        gate.open.set()
        assert flush_deletes(timeout=30)
        assert _chk_dirs(tmp_path) == ["chk-3"]
        assert sorted(u.split("/")[-2] for u in gate.urls) == ["chk-1", "chk-2"]
        # the files only chk-1 and chk-2 named went with them (deletes they handed over)
        assert files(base, JOB) == referenced(coord)
    finally:
        gate.open.set()
        b.close()
        coord.shutdown()


def test_shutdown_waits_for_the_queued_discards(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    _, coord, b = _setup(tmp_path)
    for n in (1, 2, 3):
        _complete(coord, b, n)
    threading.Timer(0.3, gate.open.set).start()
    b.close()
    coord.shutdown()
    assert _chk_dirs(tmp_path) == ["chk-3"]


def test_a_crashed_drivers_queued_discards_never_run_and_recovery_deletes_them(
        tmp_path, monkeypatch):
    base, coord, b = _setup(tmp_path)
    _complete(coord, b, 1)
    real_check, waiting, go = coord.lease.check, threading.Event(), threading.Event()

    def held(force: bool = False) -> None:  # the discard's guard waits for the crash
        if threading.current_thread().name.startswith("dstl-delete"):
            waiting.set()
            assert go.wait(30)
        real_check(force)

    monkeypatch.setattr(coord.lease, "check", held)
    _complete(coord, b, 2)  # subsumes 1: its discard is handed over, held in its guard
    assert waiting.wait(30)
    coord.abandon()  # the driver dies before the discard ran
    go.set()
    assert flush_deletes(timeout=30)
    assert _chk_dirs(tmp_path) == ["chk-1", "chk-2"]  # the discard deleted nothing
    assert coord.registry.deleter.stats.fenced >= 1
    b.close()

    nxt = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=1,
                                  lease_ttl_s=1.0)
    try:
        restored = nxt.restore(client(JOB, base), "op", 1)
        assert restored[0].value_state("v").value("k") == 2
        assert _chk_dirs(tmp_path) == ["chk-2"]  # the next run's recovery deleted chk-1
        assert files(base, JOB) == referenced(nxt)
        for r in restored:
            r.close()
    finally:
        nxt.shutdown()
