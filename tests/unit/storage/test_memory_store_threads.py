"""``memory://`` is one dict per process that fsspec reads and writes without a lock. Before
the fix a listing (the job lease's epoch claims) failed with "dictionary changed size during
iteration" while a background thread (the checkpoint locations, the cleaner) wrote a file,
and two appends at once could drop one's bytes. Every call of ours on it now takes one lock
(dstl_ray.storage.fsspec._MEMORY)."""

from __future__ import annotations

import threading
import uuid

from dstl_ray.storage import fsspec as fsspec_storage
from dstl_ray.storage.registry import get_storage


def _base() -> str:
    return f"memory://threads-{uuid.uuid4().hex[:10]}"


def test_every_call_on_the_memory_store_waits_for_the_lock():
    """A write, a listing, a read and an append each block while another thread holds the
    store's lock, and go on once it is released."""
    base = _base()
    s = get_storage(base)
    s.write_file(f"{base}/a", b"x")
    calls = {"write": lambda: s.write_file(f"{base}/b", b"y"),
             "list": lambda: s.list_files(base),
             "read": lambda: s.read_file(f"{base}/a"),
             "append": lambda: s.append_file(f"{base}/log", b"z")}
    for name, call in calls.items():
        done = threading.Event()
        with fsspec_storage._MEMORY:
            t = threading.Thread(target=lambda c=call, d=done: (c(), d.set()), daemon=True)
            t.start()
            assert not done.wait(0.2), f"{name} did not wait for the memory store's lock"
        assert done.wait(5), f"{name} did not go on once the lock was released"
        t.join(5)


def test_listings_and_appends_while_other_threads_write():
    """Threads writing and appending while another lists: no listing fails, and every
    appended byte is there (an append reads the file, then writes it whole)."""
    base = _base()
    s = get_storage(base)
    errors: list[BaseException] = []
    stop = threading.Event()

    def lister() -> None:
        while not stop.is_set():
            try:
                s.list_files(base)
            except BaseException as e:  # noqa: BLE001 - the test reports it
                errors.append(e)
                return
            stop.wait(0.001)  # (the writers get the lock too)

    def writer(n: int) -> None:
        for i in range(300):
            s.write_file(f"{base}/w{n}/{i}", b"v" * 64)
            s.append_file(f"{base}/log", bytes([n]))

    threads = [threading.Thread(target=lister, daemon=True)]
    threads += [threading.Thread(target=writer, args=(n,), daemon=True) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(60)
    stop.set()
    threads[0].join(10)
    assert errors == []
    log = s.read_file(f"{base}/log")
    assert {n: log.count(bytes([n])) for n in range(3)} == {0: 300, 1: 300, 2: 300}
    assert len(s.list_files(base)) == 3 * 300 + 1
