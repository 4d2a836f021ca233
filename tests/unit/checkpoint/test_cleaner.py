"""Subsumed checkpoints go in the background (dstl_ray.checkpoint.cleaner, Flink's
CheckpointsCleaner): completing a checkpoint does not wait for the deletes; shutdown waits
for them; a crashed driver's discards never run and the next run's recovery deletes what
they would have. What could meet an outstanding discard runs it first: a checkpoint id
written again after a drop (the old discard must not delete the new _metadata or drop its
references), a restore, a cancel. A discard the deleter cannot take runs at once, and the
subsumed watermark stays below every outstanding discard. Each test has its own deleter."""

from __future__ import annotations

import os
import threading
import time

import dstl_ray as d
from dstl_ray.checkpoint import cleaner as cleaner_mod
from dstl_ray.checkpoint.reader import read_states
from dstl_ray.state.registry import SharedStateRegistry
from dstl_ray.storage.deleter import Deleter
from dstl_ray.storage.registry import get_storage

from ..ckpt_util import MAXP, client, files, referenced

JOB = "clean"


def _chk_dirs(tmp_path) -> list[str]:
    return sorted(n for n in os.listdir(tmp_path / "dfs" / JOB) if n.startswith("chk-"))


class _Gate:
    """Holds every metadata delete of the background deleter until opened."""

    def __init__(self, monkeypatch) -> None:
        self.open = threading.Event()
        self.urls: list[str] = []
        real = cleaner_mod.delete_metadata

        def held(url: str) -> None:
            if threading.current_thread().name.startswith("dstl-delete"):
                self.urls.append(url)
                assert self.open.wait(30), "the test never opened the gate"
            real(url)

        monkeypatch.setattr(cleaner_mod, "delete_metadata", held)


def _setup(tmp_path, retained: int = 1, deleter: Deleter | None = None,
           **kwargs) -> tuple[str, d.CheckpointCoordinator, d.ChangelogKeyedStateBackend]:
    base = f"file://{tmp_path}/dfs"
    registry = SharedStateRegistry(list_files=get_storage(base).list_files,
                                   deleter=deleter or Deleter(workers=2))
    coord = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=retained,
                                    lease_ttl_s=1.0, registry=registry, **kwargs)
    b = d.ChangelogKeyedStateBackend(client(JOB, base), "op", d.KeyGroupRange(0, MAXP - 1),
                                     MAXP, materialization_interval=None)
    return base, coord, b


def _held_guards(coord, monkeypatch) -> threading.Event:
    """Holds the lease check of every discard the background deleter is about to run (so it
    stays handed over, not started) until the returned event is set."""
    real, go = coord.lease.check, threading.Event()

    def held(force: bool = False) -> None:
        if threading.current_thread().name.startswith("dstl-delete"):
            assert go.wait(30)
        real(force)

    monkeypatch.setattr(coord.lease, "check", held)
    return go


def _complete(coord, b, n: int) -> None:
    b.value_state("v").update("k", n)
    coord.complete_checkpoint(n, [b.snapshot().result(timeout=30)])


def test_completing_does_not_wait_for_the_subsumed_checkpoints_to_go(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    base, coord, b = _setup(tmp_path)
    try:
        for n in (1, 2, 3):  # 2 subsumes 1, 3 subsumes 2: their deletes are held
            _complete(coord, b, n)
        assert [c.checkpoint_id for c in coord.completed_checkpoints()] == [3]
        assert _chk_dirs(tmp_path) == ["chk-1", "chk-2", "chk-3"]  # nothing deleted yet
        assert sorted(coord.cleaner.outstanding_ids()) == [1, 2]
        assert coord.subsumed_watermark() == 0  # below every _metadata still listed
        assert not coord.registry.flush(timeout=0.2)
        gate.open.set()
        assert coord.registry.flush(timeout=30)
        assert _chk_dirs(tmp_path) == ["chk-3"] and coord.cleaner.outstanding_ids() == []
        assert coord.subsumed_watermark() == 2
        # the files only chk-1 and chk-2 named went with them (deletes they handed over)
        assert files(base, JOB) == referenced(coord)
    finally:
        gate.open.set()
        b.close()
        coord.shutdown()


def test_shutdown_runs_the_outstanding_discards(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    _, coord, b = _setup(tmp_path)
    for n in (1, 2, 3):
        _complete(coord, b, n)
    threading.Timer(0.3, gate.open.set).start()
    coord.shutdown()
    assert _chk_dirs(tmp_path) == ["chk-3"] and coord.cleaner.outstanding_ids() == []
    b.close()


def test_an_id_written_again_is_never_deleted_by_its_old_discard(tmp_path, monkeypatch):
    """retained=1: completing 2 queues chk-1's discard; a replay drops 2 and completes 1
    again. The old discard runs before the new chk-1 is written, never after."""
    base, coord, b = _setup(tmp_path)
    gate = _held_guards(coord, monkeypatch)  # the background deleter takes no discard
    try:
        _complete(coord, b, 1)
        _complete(coord, b, 2)
        assert coord.drop_checkpoints_from(2) == [2]
        b.close()  # the job starts over from empty (nothing is retained): a new backend
        b = d.ChangelogKeyedStateBackend(client(JOB, base), "op",
                                         d.KeyGroupRange(0, MAXP - 1), MAXP,
                                         materialization_interval=None)
        _complete(coord, b, 1)
        assert [c.checkpoint_id for c in coord.completed_checkpoints()] == [1]
        assert coord.cleaner.outstanding_ids() == []
        gate.set()
        assert coord.registry.flush(timeout=30)
        assert _chk_dirs(tmp_path) == ["chk-1"]
        assert files(base, JOB) == referenced(coord)  # the new chk-1 and its files are there
        assert read_states(coord.latest_checkpoint().metadata_url, "op") == {"v": {"k": 1}}
    finally:
        gate.set()
        b.close()
        coord.shutdown()


def test_a_cancel_deletes_the_subsumed_checkpoints_too(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    base, coord, b = _setup(tmp_path, retained=2, deleter=Deleter(workers=1),
                            retention=d.CheckpointRetention.DELETE_ON_CANCELLATION)
    for n in range(1, 6):  # chk-1's discard is held, chk-2's and chk-3's queued behind it
        _complete(coord, b, n)
    b.close()
    threading.Timer(0.3, gate.open.set).start()
    coord.shutdown(cancel=True, timeout=0.1)  # (slow deletes: a flush would give up)
    assert _chk_dirs(tmp_path) == []
    nxt = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, lease_ttl_s=1.0)
    try:  # a new run of the job id starts empty: no older checkpoint was left to restore
        restored = nxt.restore(client(JOB, base), "op", 1)
        assert restored[0].value_state("v").value("k") is None
        for r in restored:
            r.close()
    finally:
        nxt.shutdown()


def test_a_discard_the_deleter_cannot_take_runs_at_once(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    deleter = Deleter(workers=1, max_pending=1)
    _, coord, b = _setup(tmp_path, deleter=deleter)
    try:
        _complete(coord, b, 1)
        _complete(coord, b, 2)
        while not gate.urls:  # 1's discard runs (held)
            time.sleep(0.01)
        _complete(coord, b, 3)  # 2's is queued
        _complete(coord, b, 4)  # the queue is full: 3's runs here
        assert deleter.stats.dropped >= 1
        assert sorted(coord.cleaner.outstanding_ids()) == [1, 2]
        gate.open.set()
        assert coord.registry.flush(timeout=30)
        assert _chk_dirs(tmp_path) == ["chk-4"] and coord.cleaner.outstanding_ids() == []
    finally:
        gate.open.set()
        b.close()
        coord.shutdown()


def test_a_crashed_drivers_queued_discards_never_run_and_recovery_deletes_them(
        tmp_path, monkeypatch):
    deleter = Deleter(workers=2)
    base, coord, b = _setup(tmp_path, deleter=deleter)
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
    fenced = deleter.stats.fenced
    coord.abandon()  # the driver dies before the discard ran
    go.set()
    assert deleter.flush(timeout=30)
    assert deleter.stats.fenced == fenced + 1
    assert _chk_dirs(tmp_path) == ["chk-1", "chk-2"]  # the discard deleted nothing
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
