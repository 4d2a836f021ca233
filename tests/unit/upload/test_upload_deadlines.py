"""Upload deadlines under load (Flink's RetryingExecutor): an attempt's timeout starts when it
starts running, a queued attempt past the upload's deadline never starts, and no attempt
leaves an object nobody names, on ``memory://`` with a one- or two-thread upload pool so
queueing is deterministic."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from dstl_ray import ChangelogConfig, StorageError, Uploader
from dstl_ray.storage.deleter import Deleter
from dstl_ray.storage.registry import get_storage
from dstl_ray.upload.uploader import attempt_path


class GateStorage:
    """memory:// storage whose writes to paths containing a gated word wait until the test
    opens that gate; records every write that started."""

    def __init__(self) -> None:
        self.base = f"memory://deadline-{uuid.uuid4().hex[:8]}"
        self.inner = get_storage(self.base)
        self.gates: dict[str, threading.Event] = {}
        self.started: list[str] = []
        self.running = threading.Condition()

    def gate(self, word: str) -> threading.Event:
        self.gates[word] = threading.Event()
        return self.gates[word]

    def wait_started(self, path: str, timeout: float = 10.0) -> None:
        with self.running:
            assert self.running.wait_for(lambda: path in self.started, timeout), path

    def write_file(self, path: str, data: bytes) -> None:
        with self.running:
            self.started.append(path)
            self.running.notify_all()
        for word, ev in self.gates.items():
            if word in path:
                assert ev.wait(30), f"gate {word} never opened"
        self.inner.write_file(path, data)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def read_file(self, path: str) -> bytes:
        return self.inner.read_file(path)

    def list_files(self, prefix: str) -> list[str]:
        return self.inner.list_files(prefix)


def _cfg(**kw) -> ChangelogConfig:
    return ChangelogConfig(**{"upload_timeout_s": 0.5, "max_attempts": 3,
                              "retry_delay_s": 0.01, **kw})


def _in_thread(fn, *args):
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_time_queued_for_a_thread_does_not_count_against_the_attempt():
    """The only upload thread is busy for 1 s (twice the attempt timeout) while another
    upload's first attempt waits for it: that attempt must not time out. Before, its timeout
    ran from submission, so it timed out in the queue and a retry (``-a2``) won."""
    st = GateStorage()
    hold = st.gate("hold")
    up = Uploader(st, _cfg(), max_workers=1, deleter=Deleter(workers=0))
    busy, _ = _in_thread(up.write, f"{st.base}/hold.dstl", b"h")
    st.wait_started(f"{st.base}/hold.dstl")
    path = f"{st.base}/f.dstl"
    t, out = _in_thread(up.write, path, b"queued")
    time.sleep(1.0)  # f's attempt waits in the queue for twice its timeout
    assert path not in st.started
    hold.set()
    t.join(10)
    busy.join(10)
    assert out.get("value") == path, out  # the first attempt won: no timeout, no retry
    assert st.started.count(path) == 1 and attempt_path(path, 2) not in st.started
    assert st.read_file(path) == b"queued"


def test_an_attempt_still_queued_at_the_upload_deadline_never_starts():
    """The upload's deadline (max_attempts x (timeout + delay) = 0.33 s) passes while its
    attempt waits for a thread: the upload fails naming the deadline, and the attempt never
    writes, even once a thread is free. Before, every queued attempt ran later and wrote an
    object (deleted afterwards, if cleanup got to it)."""
    st = GateStorage()
    hold = st.gate("hold")
    up = Uploader(st, _cfg(upload_timeout_s=0.1, max_attempts=3, retry_delay_s=0.01),
                  max_workers=1, deleter=Deleter(workers=0))
    busy, _ = _in_thread(up.write, f"{st.base}/hold.dstl", b"h")
    st.wait_started(f"{st.base}/hold.dstl")
    path = f"{st.base}/late.dstl"
    t0 = time.monotonic()
    with pytest.raises(StorageError) as e:
        up.write(path, b"never")
    assert time.monotonic() - t0 < 5.0
    assert path in str(e.value) and "deadline" in str(e.value)
    hold.set()
    busy.join(10)
    up.write(f"{st.base}/after.dstl", b"a")  # the pool drained: queued work ran or was gone
    assert not [p for p in st.started if "late" in p]
    assert not [p for p in st.list_files(st.base) if "late" in p]
    assert up.stats.skipped >= 1


def test_a_timed_out_attempt_that_lands_first_wins():
    """Flink's RetryingExecutor: the first attempt to complete wins, even if it timed out
    (the retry is still running or waiting): no object is written for nothing."""
    st = GateStorage()
    slow = st.gate("w.dstl")  # attempt 1 only: attempt 2 is w-a2.dstl
    retry = st.gate("w-a2")
    up = Uploader(st, _cfg(upload_timeout_s=0.2), max_workers=2,
                  deleter=Deleter(workers=0))
    path = f"{st.base}/w.dstl"
    t, out = _in_thread(up.write, path, b"w")
    st.wait_started(attempt_path(path, 2))  # attempt 1 timed out, the retry runs
    slow.set()  # attempt 1 lands first
    t.join(10)
    retry.set()
    assert out.get("value") == path, out
    assert up.stats.late_wins == 1 and up.stats.timeouts == 1
    deadline = time.monotonic() + 10
    while st.list_files(st.base) != [path]:  # the retry's object is deleted when it lands
        assert time.monotonic() < deadline, st.list_files(st.base)
        time.sleep(0.02)


def test_close_under_load_still_deletes_a_late_loser():
    """A timed-out attempt lands after its upload was won by a retry while every upload
    thread is busy, then the uploader closes. Its object must still be deleted. Before,
    the cleanup queued behind the uploads on the same pool and close() cancelled it: the
    object stayed, named by nothing."""
    st = GateStorage()
    slow_a1 = st.gate("t.dstl")  # attempt 1 of t (t-a2.dstl is not gated)
    gate_u, gate_v = st.gate("u.dstl"), st.gate("v.dstl")
    up = Uploader(st, _cfg(upload_timeout_s=0.2), max_workers=2)
    t_path = f"{st.base}/t.dstl"
    won = up.write(t_path, b"t")  # attempt 1 hangs: the retry wins on the second thread
    assert won == attempt_path(t_path, 2)
    writers = [_in_thread(up.write, f"{st.base}/u.dstl", b"u")[0],  # second thread busy
               _in_thread(up.write, f"{st.base}/v.dstl", b"v")[0]]  # queued
    st.wait_started(f"{st.base}/u.dstl")
    time.sleep(0.05)
    slow_a1.set()  # t's attempt 1 lands late; its thread then takes v's (held) attempt
    st.wait_started(f"{st.base}/v.dstl")
    up.close()
    gate_u.set()
    gate_v.set()
    for w in writers:
        w.join(10)
    assert up.deleter.flush(10)
    assert t_path not in st.list_files(st.base)
    assert up.stats.losers_deleted >= 1


def test_hedge_delay_starts_when_the_attempt_starts():
    """A hedge is for a slow store, not a busy pool: an attempt that waited for a thread
    longer than the hedge delay but then runs fast is not hedged."""
    st = GateStorage()
    hold = st.gate("hold")
    up = Uploader(st, _cfg(upload_timeout_s=2.0, hedge_delay_s=0.1), max_workers=1,
                  deleter=Deleter(workers=0))
    busy, _ = _in_thread(up.write, f"{st.base}/hold.dstl", b"h")
    st.wait_started(f"{st.base}/hold.dstl")
    hedged0 = up.stats.hedged  # the held upload's own hedge (queued behind it)
    path = f"{st.base}/q.dstl"
    t, out = _in_thread(up.write, path, b"q")
    time.sleep(0.5)
    hold.set()
    t.join(10)
    busy.join(10)
    assert out.get("value") == path
    assert attempt_path(path, 2) not in st.started
    assert up.stats.hedged - hedged0 <= 1  # at most the held upload's hedge
