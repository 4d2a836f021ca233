"""Writer semantics (FLIP-158 "API") on the in-process DirectTransport over memory://."""

from __future__ import annotations

import concurrent.futures
import threading
import uuid

import pytest

from dstl_ray import (
    ChangelogConfig,
    DirectTransport,
    InvalidValueError,
    KeyGroupError,
    KeyGroupRange,
    PersistError,
    SqnError,
    StateChangelogClient,
    WriterClosedError,
)
from dstl_ray.storage.registry import get_storage


def make(config: ChangelogConfig | None = None, transport_cls=DirectTransport):
    base = f"memory://w-{uuid.uuid4().hex}"
    t = transport_cls("job", base, config)
    return t, StateChangelogClient("job", transport=t)


def test_sqn_boundaries_and_handle_ranges():
    _, c = make()
    w = c.create_writer("op", KeyGroupRange(0, 3))
    assert w.last_appended_sqn() == 0  # nothing appended: no new changeset
    w.append(0, b"a")
    assert w.last_appended_sqn() == 1
    assert w.last_appended_sqn() == 1  # empty open changeset does not advance
    w.append(1, b"b")
    h = w.persist_durably(after=0).result(timeout=10)
    assert (h.sqn_from, h.sqn_to) == (0, 2)
    assert list(h.get_state_changes(0)) == [b"a"]
    assert list(h.get_state_changes(1)) == [b"b"]
    h2 = w.persist_durably(after=1).result(timeout=10)
    assert list(h2.get_state_changes(0)) == [] and list(h2.get_state_changes(1)) == [b"b"]
    assert list(h2.get_state_changes(3)) == [] and list(h2.get_state_changes(99)) == []


def test_persist_reuses_uploads_and_sends_only_new_changes():
    t, c = make()
    w = c.create_writer("op", KeyGroupRange(0, 0))
    w.append(0, b"a")
    h1 = w.persist_durably(0).result(timeout=10)
    w.append(0, b"b")
    h2 = w.persist_durably(0).result(timeout=10)
    assert len(t.files) == 2  # one new file for "b" only
    assert h1.segments[0] in h2.segments
    assert list(h2.get_state_changes(0)) == [b"a", b"b"]
    h3 = w.persist_durably(0).result(timeout=10)  # nothing new: no upload at all
    assert len(t.files) == 2 and h3.segments == h2.segments


def test_empty_persist_gives_empty_handle():
    _, c = make()
    w = c.create_writer("op", KeyGroupRange(0, 0))
    h = w.persist_durably(0).result(timeout=10)
    assert h.is_empty() and list(h.get_state_changes(0)) == []


def test_bad_input_raises_specific_errors():
    _, c = make()
    w = c.create_writer("op", KeyGroupRange(4, 7))
    with pytest.raises(KeyGroupError, match="outside"):
        w.append(3, b"x")
    with pytest.raises(KeyGroupError):
        w.append(8, b"x")
    with pytest.raises(InvalidValueError, match="bytes"):
        w.append(4, "text")  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError):
        w.append(4, bytearray(b"x"))  # type: ignore[arg-type]
    w.append(4, b"x")
    assert w.last_appended_sqn() == 1
    with pytest.raises(SqnError, match="beyond the last appended sqn 1"):
        w.persist_durably(after=5)
    with pytest.raises(SqnError, match="beyond"):
        w.truncate(before=2)
    with pytest.raises(SqnError):
        w.persist_durably(after=-1)
    w.close()
    with pytest.raises(WriterClosedError):
        w.append(4, b"y")
    with pytest.raises(WriterClosedError):
        w.persist_durably(0)
    with pytest.raises(KeyGroupError):
        c.create_writer("op", (0, 1))  # type: ignore[arg-type]


def test_truncate_drops_and_persist_before_truncation_is_refused():
    _, c = make()
    w = c.create_writer("op", KeyGroupRange(0, 0))
    for v in (b"a", b"b", b"c"):
        w.append(0, v)
        w.last_appended_sqn()
    w.truncate(before=2)
    assert w.retained_sqns() == [3]
    with pytest.raises(SqnError, match="truncated"):
        w.persist_durably(after=1)
    h = w.persist_durably(after=2).result(timeout=10)
    assert list(h.get_state_changes(0)) == [b"c"]


def test_uploaded_changes_leave_memory_and_are_named_by_later_handles():
    """Once an upload succeeds only its segment is kept: memory holds what is not durable
    yet, not every change since the last materialization (a bulk load held it all)."""
    _, c = make()
    w = c.create_writer("op", KeyGroupRange(0, 1))
    for i in range(100):
        w.append(i % 2, bytes(1000) + bytes([i]))
    h1 = w.persist_durably(0).result(timeout=10)
    assert w.retained_bytes() == 0 and len(w.retained_sqns()) == 1
    w.append(0, b"tail")
    assert w.retained_bytes() > 0
    h2 = w.persist_durably(0).result(timeout=10)
    assert w.retained_bytes() == 0
    assert h2.segments[0] == h1.segments[0]  # the first upload is named, never re-sent
    got = list(h2.get_state_changes(0))
    assert len(got) == 51 and got[-1] == b"tail" and got[0] == bytes(1000) + bytes([0])


class FlakyTransport(DirectTransport):
    """Fails the first ``fail`` sends, like a node actor that died mid-request."""

    fail = 1

    def send(self, request):
        if self.fail > 0:
            self.fail -= 1
            f: concurrent.futures.Future = concurrent.futures.Future()
            f.set_exception(RuntimeError("node actor died"))
            return f
        return super().send(request)


def test_failed_upload_keeps_changes_and_next_persist_resends():
    _, c = make(transport_cls=FlakyTransport)
    w = c.create_writer("op", KeyGroupRange(0, 1))
    w.append(0, b"a")
    w.append(1, b"b")
    fut = w.persist_durably(0)
    with pytest.raises(PersistError, match="node actor died"):
        fut.result(timeout=10)
    w.append(0, b"c")
    h = w.persist_durably(0).result(timeout=10)
    assert list(h.get_state_changes(0)) == [b"a", b"c"]
    assert list(h.get_state_changes(1)) == [b"b"]


def test_preemptive_persist_is_reused_then_discarded_if_unused():
    cfg = ChangelogConfig(preemptive_persist_threshold=1000)
    t, c = make(cfg)
    st = get_storage(t.base_path)
    w = c.create_writer("op", KeyGroupRange(0, 0))
    for i in range(30):
        w.append(0, bytes(100) + bytes([i]))
    assert w.preemptive_uploads >= 2
    w.wait_uploads(10)
    n_before = len(st.list_files(t.job_path))
    assert n_before == w.preemptive_uploads
    w.append(0, b"tail")
    h = w.persist_durably(0).result(timeout=10)
    assert len(st.list_files(t.job_path)) == n_before + 1  # only the tail is new
    assert list(h.get_state_changes(0))[-1] == b"tail" and len(list(h.get_state_changes(0))) == 31
    # a pre-emptive upload that no checkpoint ever used is deleted once truncated
    for i in range(12):
        w.append(0, bytes(100) + bytes([i]))
    pre = w.preemptive_uploads
    w.wait_uploads(10)
    sqn = w.last_appended_sqn()
    files_with_unused = set(st.list_files(t.job_path))
    w.truncate(before=sqn)
    assert t.flush_releases(10)  # the delete runs in the background (off the caller's lock)
    left = set(st.list_files(t.job_path))
    assert pre > 0 and len(files_with_unused - left) == 1
    # the files the handle uses are still there
    assert set(h.file_paths()) <= left


def test_close_discards_unused_uploads_but_keeps_used_ones():
    cfg = ChangelogConfig(preemptive_persist_threshold=500)
    t, c = make(cfg)
    st = get_storage(t.base_path)
    w = c.create_writer("op", KeyGroupRange(0, 0))
    w.append(0, b"x" * 600)  # pre-emptive upload
    h = w.persist_durably(0).result(timeout=10)  # uses it
    w.append(0, b"y" * 600)  # another pre-emptive upload, never used
    w.wait_uploads(10)
    assert len(st.list_files(t.job_path)) == 2
    w.close()
    assert st.list_files(t.job_path) == h.file_paths()


class _HeldTransport(DirectTransport):
    """Writes each request only once ``gate`` is set (a slow upload)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def send(self, request):
        out: concurrent.futures.Future = concurrent.futures.Future()

        def later() -> None:
            self.gate.wait(30)
            try:
                out.set_result(DirectTransport.send(self, request).result(30))
            except BaseException as e:  # noqa: BLE001 - the writer learns it
                out.set_exception(e)

        threading.Thread(target=later, daemon=True).start()
        return out


def test_wait_uploads_waits_for_one_truncated_while_in_flight():
    """An upload whose changes were truncated while it was in flight is in no upload list
    any more, yet it lands later (and then is released, or its handle comes in late):
    ``wait_uploads`` (a backend's close) waits for it, so nothing lands after a close."""
    t, c = make(ChangelogConfig(preemptive_persist_threshold=500), _HeldTransport)
    st = get_storage(t.base_path)
    w = c.create_writer("op", KeyGroupRange(0, 0))
    w.append(0, b"x" * 600)  # a pre-emptive upload, held
    assert w.preemptive_uploads == 1
    w.truncate(before=w.last_appended_sqn())  # materialized while it uploads
    threading.Timer(0.2, t.gate.set).start()
    w.wait_uploads(10)
    assert t.gate.is_set()
    w.close()
    assert t.flush_releases(10)
    assert st.list_files(t.job_path) == []  # landed, then deleted as unused


def test_writers_are_isolated():
    _, c = make()
    w1 = c.create_writer("a", KeyGroupRange(0, 1))
    w2 = c.create_writer("b", KeyGroupRange(0, 1))
    assert w1.log_id != w2.log_id
    w1.append(0, b"1")
    w2.append(0, b"2")
    h1, h2 = w1.persist_durably(0).result(), w2.persist_durably(0).result()
    assert list(h1.get_state_changes(0)) == [b"1"] and list(h2.get_state_changes(0)) == [b"2"]


def test_requests_carry_the_newest_checkpoint_the_log_made_a_handle_for():
    """``named`` tells a node how far a dead writer's sections may be named: the newest
    checkpoint id, and unknown for good once a handle was made without one."""
    from dstl_ray.merging.pool import UNKNOWN_USE

    sent = []

    class Recording(DirectTransport):
        def send(self, request):
            sent.append(request)
            return super().send(request)

    _, c = make(transport_cls=Recording)
    w = c.create_writer("op", KeyGroupRange(0, 0))
    w.append(0, b"a")
    w.persist_durably(0, checkpoint_id=3).result(timeout=10)
    w.append(0, b"b")
    w.persist_durably(0, checkpoint_id=5).result(timeout=10)
    w.persist_durably(0, checkpoint_id=4).result(timeout=10)  # nothing new: no request
    assert [r.named for r in sent] == [3, 5] and w.named == 5
    w.append(0, b"c")
    w.persist_durably(0).result(timeout=10)  # a handle for an unknown checkpoint
    w.append(0, b"d")
    w.persist_durably(0, checkpoint_id=9).result(timeout=10)
    assert [r.named for r in sent][2:] == [UNKNOWN_USE, UNKNOWN_USE]


def test_append_all_is_append_of_each_and_a_bad_entry_appends_nothing():
    _, c = make()
    one, bulk = (c.create_writer(op, KeyGroupRange(4, 7)) for op in ("one", "bulk"))
    entries = [(4 + i % 4, b"v%d" % i) for i in range(50)]
    for kg, v in entries:
        one.append(kg, v)
    bulk.append_all(entries)
    assert one.last_appended_sqn() == bulk.last_appended_sqn() == 1
    got = [one.persist_durably(0).result(timeout=10), bulk.persist_durably(0).result(timeout=10)]
    assert [[list(h.get_state_changes(kg)) for kg in range(4, 8)] for h in got] == [
        [[v for k, v in entries if k == kg] for kg in range(4, 8)]] * 2
    with pytest.raises(KeyGroupError, match="outside"):
        bulk.append_all([(4, b"ok"), (8, b"x")])
    with pytest.raises(InvalidValueError, match="bytes"):
        bulk.append_all([(4, b"ok"), (5, "text")])  # type: ignore[list-item]
    assert bulk.last_appended_sqn() == 1  # nothing of either was appended
    bulk.close()
    with pytest.raises(WriterClosedError):
        bulk.append_all([(4, b"y")])
