"""A writer process's lane to its node actor (dstl_ray.transport.lane_holder) through the
real transport (RayNodeTransport) and a real lane server, Ray's calls answered by a stand-in
node handle: finding the node again keeps a lane that still leads to its process, retires
one that does not (its calls in flight still answered), a lane whose process Ray holds dead
is cut, and a mark behind a stopped node is dropped unsent by the persist deadline."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray

from dstl_ray import ChangelogConfig
from dstl_ray.errors import PersistError
from dstl_ray.format.changelog import BlockIndex, EncodedSection
from dstl_ray.format.segment import Segment
from dstl_ray.node.lane_server import LaneServer
from dstl_ray.transport import lane_watch
from dstl_ray.transport import ray as transport_mod
from dstl_ray.transport.base import PersistRequest
from dstl_ray.transport.lane import LaneClosedError
from dstl_ray.transport.sender import Caller

BIG = 16 << 20


def _req(tag: str, size: int = 8) -> PersistRequest:
    log = bytes(range(16))
    body = os.urandom(size)
    section = EncodedSection(log, body, (BlockIndex(log, 3, 1, 2, 0, len(body)),), 1, 2, 0)
    return PersistRequest("J", section, tag, (), 7)


def _seg(tag: str) -> Segment:
    return Segment(f"dstl/node-a/{tag}.dstl", 0, 8, 1, 2, "dstl-node-a")


class _Server:
    """A node actor's lane server on a loop of its own, which the test can block."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.seen: list[str] = []
        self.hold = threading.Event()
        self.released: list = []

        async def persist_many(requests):
            tags = [r.source for r in requests]
            self.seen.extend(tags)
            if "hold" in tags:
                await asyncio.to_thread(self.hold.wait, 30)
            return [_seg(t) for t in tags]

        async def mark(job_id, source, checkpoint_id, caller=None, named=None):
            self.seen.append(f"mark-{checkpoint_id}")

        async def release(requests, results):
            self.released.append(([r.source for r in requests], results))

        self.server = LaneServer("dstl-node-a", {"persist_many": persist_many, "mark": mark},
                                 release=release)
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)

    def stall(self, seconds: float) -> None:
        self.loop.call_soon_threadsafe(time.sleep, seconds)

    def stop(self) -> None:
        self.hold.set()
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class _Ref:
    def __init__(self, get: Callable[[], Any]) -> None:
        self.get = get

    def future(self) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            fut.set_result(self.get())
        except Exception as e:  # noqa: BLE001
            fut.set_exception(e)
        return fut


class _Handle:
    """The node actor's Ray handle: each method's ``remote()`` gives a ref ray.get reads."""

    def __init__(self, server: _Server, config: ChangelogConfig, base: str) -> None:
        self.lane_info = server.server.info()
        self.register_timeouts = 0  # this many register_writer calls time out
        self.released: list = []

        def method(fn: Callable[..., Any]) -> Any:
            return types.SimpleNamespace(remote=lambda *a: _Ref(lambda: fn(*a)))

        def register_writer(*args: Any) -> bool:
            if self.register_timeouts:
                self.register_timeouts -= 1
                raise ray.exceptions.GetTimeoutError("the node is stalled")
            return False

        self.info = method(lambda: {"base_path": base, "config": config.to_dict()})
        self.lane = method(lambda: self.lane_info)
        self.register_writer = method(register_writer)
        self.unregister_writer = method(lambda *a: None)
        self.release = method(lambda *a: self.released.append(a))


@pytest.fixture
def writer(tmp_path, monkeypatch) -> Iterator[types.SimpleNamespace]:
    monkeypatch.setattr(lane_watch, "LANE_CHECK_S", 0.05)
    ray_says = {"state": ("ALIVE", os.getpid())}  # Ray's actor table for the node's actor
    monkeypatch.setattr(lane_watch, "ray_actor_state", lambda handle: ray_says["state"])
    server = _Server()
    handle = _Handle(server, ChangelogConfig(persist_timeout_s=2.0), f"file://{tmp_path}")
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: handle)
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref.get())
    monkeypatch.setattr(transport_mod, "current_caller", lambda ns=None: Caller("ns"))
    t = transport_mod.RayNodeTransport("J", "ns", node_name="dstl-node-a")
    others: list[_Server] = []
    yield types.SimpleNamespace(t=t, server=server, handle=handle, others=others,
                                ray_says=ray_says)
    t.close()
    for s in [server, *others]:
        s.stop()


def _wait(cond, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_finding_a_stalled_node_again_keeps_its_lane_and_the_calls_in_flight(writer):
    """A registration timed out against a node that is only stalled: the transport finds
    its node again. Before the fix that closed the lane (after 5 s, failing the persist
    calls in flight with LaneClosedError before their deadline) and opened another, asking
    the node for it while holding the transport's lock."""
    t, server = writer.t, writer.server
    lane = t.lane
    assert lane is not None
    held = t.send(_req("hold"))
    _wait(lambda: "hold" in server.seen, "the node never took the call")
    writer.handle.register_timeouts = 1
    t.register("w2")  # times out once: the transport finds its node again
    assert t.lane is lane and lane.closed is None
    assert t.send(_req("next")).result(5) == _seg("next")
    server.hold.set()
    assert held.result(5) == _seg("hold")
    assert server.server.stats()["connections"] == 1


def test_a_lane_to_another_process_is_retired_its_calls_still_answered(writer):
    """The actor now runs in another process (another lane server): a new lane is opened to
    it and the old one retires, delivering the answers of its calls in flight until their
    deadline, not cut off at once."""
    t, server = writer.t, writer.server
    old = t.lane
    held = t.send(_req("hold"))
    _wait(lambda: "hold" in server.seen, "the node never took the call")
    moved = _Server()
    writer.others.append(moved)
    writer.handle.lane_info = dict(moved.server.info(), pid=os.getpid() + 1)
    writer.handle.register_timeouts = 1
    t.register("w2")
    assert t.lane is not None and t.lane is not old and old.closed is not None
    assert t.send(_req("next")).result(5) == _seg("next") and moved.seen == ["next"]
    server.hold.set()
    assert held.result(5) == _seg("hold")  # answered over the retiring lane
    _wait(lambda: old.done, "the retired lane did not end")
    assert not server.released


def test_a_writer_lane_whose_process_ray_holds_dead_is_cut(writer):
    """Before the fix only node-to-node lanes were checked: a writer kept persisting to a
    zombie node (its Ray node declared dead while its process ran on)."""
    t, server = writer.t, writer.server
    lane = t.lane
    held = t.send(_req("hold"))
    _wait(lambda: "hold" in server.seen, "the node never took the call")
    writer.ray_says["state"] = ("DEAD", 0)
    _wait(lambda: lane.closed is not None, "the lane to the zombie was not cut")
    with pytest.raises(LaneClosedError):
        held.result(5)  # the writer sends these changes again with its next request
    assert t.lane is None
    server.hold.set()  # the zombie finishes: nobody gets its answer, it releases the file
    _wait(lambda: server.released, "the zombie did not release the undelivered answer")


def test_a_mark_behind_a_stopped_node_is_dropped_unsent_by_the_persist_deadline(writer):
    """A persist call larger than the socket's buffers is on its way to a stalled node and
    a mark is queued behind it. Before the fix marks had no deadline: it went whenever the
    node read again."""
    t, server = writer.t, writer.server
    t.register("w1")
    server.stall(4.0)
    time.sleep(0.1)
    big = t.send(_req("big", BIG))
    lane = t.lane
    _wait(lambda: any(o.sent for o in lane._queue), "the big frame never began")
    mark = t.mark("w1", 3)
    with pytest.raises(PersistError, match="DeadlineError"):
        mark.result(10)
    with pytest.raises(PersistError):
        big.result(10)  # (its persist deadline passed too: sent again with the next one)
    _wait(lambda: "big" in server.seen, "the node never took the call", timeout=15)
    time.sleep(0.5)
    assert "mark-3" not in server.seen


def _transport_threads() -> set[threading.Thread]:
    """The threads a transport starts: its lane's watch, its sender, its delivery thread."""
    return {th for th in threading.enumerate()
            if th.name == "dstl-writer-lane-watch" or th.name == "dstl-sender"
            or th.name.startswith("dstl-deliver")}


def test_a_closed_transport_leaves_no_thread_behind(writer, monkeypatch):
    """Tests open and close many transports. Before, a closed transport's lane-watch thread
    slept out its interval (5 s) and every transport's sender and delivery threads ran for
    the rest of the process; now close ends them all before it returns."""
    monkeypatch.setattr(lane_watch, "LANE_CHECK_S", 5.0)  # as in production
    before = _transport_threads()
    t = transport_mod.RayNodeTransport("J", "ns", node_name="dstl-node-a")
    assert t.lane is not None
    assert t.send(_req("a")).result(5) == _seg("a")
    t.register("w1")
    t.mark("w1", 3, named=3).result(5)
    started = _transport_threads() - before
    assert {th.name for th in started} >= {"dstl-writer-lane-watch", "dstl-sender"}
    t.close()
    assert [th.name for th in _transport_threads() - before if th.is_alive()] == []
    with pytest.raises(PersistError, match="closed"):
        t.send(_req("b")).result(5)


def test_closing_fails_what_is_still_waited_for_and_releases_its_late_answer(writer):
    """A persist call in flight when its transport closes fails as its deadline would, and
    its answer, when it comes, is released unused."""
    t, server = writer.t, writer.server
    held = t.send(_req("hold"))
    _wait(lambda: "hold" in server.seen, "the node never took the call")
    closing = threading.Thread(target=t.close)
    closing.start()
    with pytest.raises(PersistError, match="closed"):
        held.result(5)
    server.hold.set()
    closing.join(10)
    _wait(lambda: t.late_released == 1 or server.released, "the late answer was not released")


def test_a_mark_is_sent_by_the_sender_after_the_changes_queued_before_it(writer):
    """A checkpoint barrier with nothing to send only queues its mark: the caller never
    writes to the node's socket (before, each mark was sent from the barrier's thread,
    0.35 ms a writer before the barrier could answer), and the changes queued first go
    first, since a node's batch waits for them."""
    t, server = writer.t, writer.server
    calls: list[tuple[str, str]] = []
    call = t._channel.call

    def recording(method: str, *args: Any, **kw: Any) -> concurrent.futures.Future:
        calls.append((method, threading.current_thread().name))
        return call(method, *args, **kw)

    t._channel.call = recording
    t.register("w1")
    with t._cond:  # the sender cannot take anything until both are queued
        changes = t.send(_req("a"))
        mark = t.mark("w1", 3)
        assert calls == []  # the mark went nowhere from this thread
    changes.result(5)
    mark.result(5)
    assert calls == [("persist_many", "dstl-sender"), ("mark", "dstl-sender")]
    assert server.seen == ["a", "mark-3"]


def test_a_mark_that_cannot_be_sent_fails_and_an_awaited_one_leaves_no_deadline(writer):
    """The channel refuses a mark (its node gone): the mark fails with what happened, and
    an awaited one is no longer held to the persist deadline."""
    t = writer.t

    def refusing(method: str, *args: Any, **kw: Any) -> concurrent.futures.Future:
        raise LaneClosedError("the node is gone")

    t._channel.call = refusing
    t.register("w1")
    threads: list[str] = []
    for named in (None, 3):
        with t._cond:  # (the callback in before the sender can fail the mark)
            mark = t.mark("w1", 3, named=named)
            mark.add_done_callback(lambda f: threads.append(threading.current_thread().name))
        with pytest.raises(PersistError, match="not sent: the node is gone"):
            mark.result(5)
    assert t._marks.nearest() is None
    # failing a future runs writers' callbacks: never on the sender, which they may wait on
    _wait(lambda: len(threads) == 2, "a callback did not run")
    assert all(name.startswith("dstl-deliver") for name in threads), threads


def test_a_writer_that_unregisters_drops_its_marks_not_sent_yet(writer):
    """A mark that reached the node after its writer unregistered would leave the node a
    record of a writer that is gone: an unregistered log's marks never go, whether still
    queued or taken by the sender in its round just before the unregister."""
    t, server = writer.t, writer.server
    entered, permits = threading.Semaphore(0), threading.Semaphore(0)
    call = t._channel.call

    def held(method: str, *args: Any, **kw: Any) -> concurrent.futures.Future:
        if method == "persist_many":  # each round's batch waits for a permit
            entered.release()
            assert permits.acquire(timeout=5)
        return call(method, *args, **kw)

    t._channel.call = held
    for log_id in ("w1", "w2", "w3"):
        t.register(log_id)
    first = t.send(_req("a"))
    assert entered.acquire(timeout=5)
    gone, kept = t.mark("w1", 3, named=3), t.mark("w2", 3)  # queued
    t.unregister("w1")
    with t._cond:  # in the sender's next round, with w2's mark
        second = t.send(_req("b"))
        late = t.mark("w3", 4)
    permits.release()
    assert entered.acquire(timeout=5)  # the sender holds its round: "b" and two marks
    t.unregister("w3")
    permits.release()
    for m, log_id in ((gone, "w1"), (late, "w3")):
        with pytest.raises(PersistError, match=f"log {log_id} was closed"):
            m.result(5)
    kept.result(5)
    first.result(5)
    second.result(5)
    assert server.seen == ["a", "b", "mark-3"]  # w2's mark only


def test_closing_fails_the_marks_still_queued(writer):
    """Marks queued when the transport closes never go: each fails, awaited or not."""
    t = writer.t
    busy = threading.Event()

    def held(method: str, *args: Any, **kw: Any) -> concurrent.futures.Future:
        busy.set()  # the sender is here until the transport is closed
        _wait(lambda: t._closed, "the transport was not closed")
        return concurrent.futures.Future()

    t._channel.call = held
    t.send(_req("a"))
    assert busy.wait(5)
    marks = [t.mark("w1", 3), t.mark("w2", 3, named=3)]  # queued behind the busy sender
    t.close()
    for m in marks:
        with pytest.raises(PersistError, match="closed"):
            m.result(5)
    with pytest.raises(PersistError, match="closed"):
        t.mark("w3", 4).result(5)
