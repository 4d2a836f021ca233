"""File deletes never run under a backend's lock or on a persist completion's thread: a
delete stuck on a slow object store must not hold up state access or checkpoints (they run
on the background deleter, dstl_ray.storage.deleter). Events, not timings: the delete is held until
the test lets it go, and state access must finish meanwhile."""

from __future__ import annotations

import threading

import dstl_ray as d
from dstl_ray.storage.deleter import Deleter
from dstl_ray.storage.registry import get_storage

from ..ckpt_util import MAXP, client, new_base

FULL = d.KeyGroupRange(0, MAXP - 1)


class HeldDeletes:
    """Wraps a storage (or a delete function): every delete waits until ``release``."""

    def __init__(self, inner=None) -> None:
        self.inner = inner
        self.started = threading.Event()
        self.release = threading.Event()
        self.deleted: list[str] = []

    def _hold(self) -> None:
        self.started.set()
        assert self.release.wait(30), (
            f"a held delete ran on thread {threading.current_thread().name!r}, which the "
            f"test itself waited on")

    def __call__(self, url: str) -> None:  # a registry's delete function
        self._hold()
        get_storage(url).delete(url)
        self.deleted.append(url)

    def delete(self, path: str) -> None:  # a storage's delete
        self._hold()
        self.inner.delete(path)
        self.deleted.append(path)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _returns_while_held(fn, held: HeldDeletes, what: str, timeout: float = 10.0) -> None:
    """``fn`` finishes while a delete is held (before: it waited for the delete)."""
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    finished = done.wait(timeout)
    assert not held.release.is_set()
    assert finished, f"{what} waited for a held delete"
    assert not errors, errors


def test_a_held_registry_delete_blocks_neither_state_access_nor_a_persist_completion():
    """A materialization unpins the changelog file it covers; the registry deletes it. That
    delete ran under the backend's lock (in _repin): ``update`` and the next snapshot's
    completion (which takes the lock to pin its files) waited for the store."""
    held = HeldDeletes()
    registry = d.SharedStateRegistry(delete=held)
    b = d.ChangelogKeyedStateBackend(client("job", new_base()), "op", FULL, MAXP,
                                     materialization_interval=None)
    try:
        b.attach_registry(registry)
        b.value_state("v").update("a", 1)
        b.snapshot().result(timeout=10)  # its changelog file is pinned, in no checkpoint
        b.value_state("v").update("a", 2)
        mat = b.materialize()  # covers that file: unpinned, unreferenced, deleted
        assert held.started.wait(10)
        _returns_while_held(lambda: b.value_state("v").update("k", 3), held, "update")
        _returns_while_held(lambda: b.snapshot().result(timeout=10), held,
                            "a snapshot's persist completion")
        held.release.set()
        mat.result(timeout=10)
        assert registry.flush(10) and len(held.deleted) == 1
        assert b.dump()["v"] == {"a": 2, "k": 3}
    finally:
        held.release.set()
        b.close()


def test_a_held_delete_of_an_unused_upload_blocks_no_state_access():
    """Truncation after a materialization releases a pre-emptive upload no checkpoint used;
    the direct transport deleted it right there, under the backend's lock."""
    base = new_base()
    t = d.DirectTransport("job", base, d.ChangelogConfig(preemptive_persist_threshold=1000))
    held = HeldDeletes(t.storage)
    t.storage = held
    b = d.ChangelogKeyedStateBackend(d.StateChangelogClient("job", transport=t), "op", FULL,
                                     MAXP, materialization_interval=None)
    try:
        for i in range(20):
            b.value_state("v").update(f"k{i}", "x" * 100)  # pre-emptive uploads
        b.writer.wait_uploads(10)
        assert b.writer.preemptive_uploads >= 1
        mat = b.materialize()
        assert held.started.wait(10)  # the unused upload's delete is running, held
        _returns_while_held(lambda: b.value_state("v").update("late", 1), held, "update")
        held.release.set()
        mat.result(timeout=10)
        assert t.flush_releases(10) and held.deleted
        left = set(get_storage(base).list_files(t.job_path))
        assert not left & set(held.deleted)
    finally:
        held.release.set()
        b.close()


def test_close_still_deletes_what_it_freed():
    """close() waits for the deletes it caused: the unused upload of a closing writer is
    gone when close returns (as when it was deleted in place)."""
    base = new_base()
    t = d.DirectTransport("job", base, d.ChangelogConfig(preemptive_persist_threshold=1000))
    b = d.ChangelogKeyedStateBackend(d.StateChangelogClient("job", transport=t), "op", FULL,
                                     MAXP, materialization_interval=None)
    for i in range(20):
        b.value_state("v").update(f"k{i}", "x" * 100)
    b.writer.wait_uploads(10)
    assert get_storage(base).list_files(t.job_path)
    b.close()
    assert get_storage(base).list_files(t.job_path) == []


def test_the_deleter_is_bounded_and_best_effort(caplog):
    """A full queue drops deletes (counted, logged) instead of making anybody wait; a failed
    delete is logged and counted; flush waits for what was handed over."""
    gate, running = threading.Event(), threading.Event()
    dl = Deleter(workers=1, max_pending=2)
    dl.submit(lambda: (running.set(), gate.wait(10)), "held")
    assert running.wait(10)  # the only worker holds it; the queue is empty
    ran: list[int] = []
    accepted = [dl.submit(lambda i=i: ran.append(i), f"f{i}") for i in range(4)]
    assert accepted == [True, True, False, False] and dl.stats.dropped == 2
    assert "dropped" in caplog.text
    assert not dl.flush(0.05)  # the held delete keeps flush waiting
    gate.set()
    assert dl.flush(10) and ran == [0, 1]

    def fail() -> None:
        raise OSError("503 SlowDown")

    dl.submit(fail, "memory://x/y.dstl")
    assert dl.flush(10) and dl.stats.failed == 1
    assert "cannot delete memory://x/y.dstl" in caplog.text


def test_the_deleter_works_in_a_forked_child():
    """Spark forks its Python workers from a daemon: the parent's delete threads are gone in
    the child, which must still delete (with threads of its own)."""
    import os

    dl = Deleter(workers=1)
    assert dl.submit(lambda: None, "warm-up") and dl.flush(10)  # a thread in the parent
    pid = os.fork()
    if pid == 0:  # the child: its exit status tells the parent
        ran: list[int] = []
        ok = dl.submit(lambda: ran.append(1), "in the child") and dl.flush(10) and ran == [1]
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_a_flush_waits_for_the_deletes_a_running_delete_hands_over():
    """A subsumed checkpoint's discard (one delete) releases its files (more deletes, handed
    over while it runs): a flush from before waits for those too."""
    deleter, done, gate = Deleter(workers=2), [], threading.Event()

    def child() -> None:
        assert gate.wait(10)
        done.append("child")

    def parent() -> None:
        deleter.submit(child, "child")
        done.append("parent")

    deleter.submit(parent, "parent")
    assert not deleter.flush(timeout=0.3)  # the child is held: the parent's flush waits
    gate.set()
    assert deleter.flush(timeout=10)
    assert sorted(done) == ["child", "parent"]
