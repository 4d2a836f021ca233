"""A stalled receiver costs lateness, never a broken lane (docs/architecture.md "Write path"
2): a node actor's loop blocked (a blocking call, as a GC pause or SIGSTOP would) with a
frame larger than the socket's buffers queued. The sender never blocks its caller, nothing
times out on a fixed send timeout, a call fails only by its own deadline (a frame not begun
by then is dropped unsent), and an answer the server cannot deliver is released there."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import struct
import termios
import threading
import time
from collections.abc import Iterator

import pytest

from dstl_ray.errors import DeadlineError
from dstl_ray.format.changelog import BlockIndex, EncodedSection
from dstl_ray.format.segment import Segment
from dstl_ray.node.lane_server import LaneServer
from dstl_ray.transport import lane as lane_mod
from dstl_ray.transport.base import PersistRequest
from dstl_ray.transport.lane import LaneClosedError, open_lane
from dstl_ray.transport.sender import Caller

BIG = 16 << 20  # far beyond a Unix socket's buffers


def _req(tag: str, size: int = 8) -> PersistRequest:
    log = bytes(range(16))
    body = os.urandom(size)
    section = EncodedSection(log, body, (BlockIndex(log, 3, 1, 2, 0, len(body)),), 1, 2, 0)
    return PersistRequest("job", section, tag, (), 7, Caller("ns"), 4, "inc-1", 6)


def _seg(tag: str) -> Segment:
    return Segment(f"dstl/node-a/{tag}.dstl", 0, 8, 1, 2, "node-a")


class _Node:
    """A LaneServer on its own asyncio loop thread, as in a node actor, whose loop can be
    blocked (stalled) for a while; it records calls and released answers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.seen: list[str] = []
        self.released: list[tuple[list[str], list]] = []
        self.hold = threading.Event()

        async def persist_many(requests):
            tags = [r.source for r in requests]
            self.seen.extend(tags)
            if tags == ["hold"]:
                await asyncio.to_thread(self.hold.wait, 30)
            return [_seg(t) for t in tags]

        async def release(requests, results):
            self.released.append(([r.source for r in requests], results))

        self.server = LaneServer("node-a", {"persist_many": persist_many}, release=release)
        self.run(self.server.start())

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def stall(self, seconds: float) -> None:
        """Block the node's loop: it reads nothing and answers nothing meanwhile."""
        self.loop.call_soon_threadsafe(time.sleep, seconds)

    def stop(self) -> None:
        self.hold.set()
        self.run(self.server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def node() -> Iterator[_Node]:
    n = _Node()
    yield n
    n.stop()


def test_a_stall_longer_than_any_send_timeout_costs_lateness_not_the_lane(node, monkeypatch):
    """Before the fix the lane's sends timed out (SO_SNDTIMEO, 5 s documented, about 10 s in
    effect; 0.5 s here so the test is short) and the lane closed, failing both calls with
    LaneClosedError while the node went on to execute the big one and drop its answer."""
    monkeypatch.setattr(lane_mod, "SEND_TIMEOUT_S", 0.5, raising=False)
    lane = open_lane(node.server.info(), "node-a")
    reqs = [_req("big", BIG)], [_req("after")]
    node.stall(3.0)
    time.sleep(0.1)
    t0 = time.monotonic()
    big = lane.call("persist_many", reqs[0])
    after = lane.call("persist_many", reqs[1])
    assert time.monotonic() - t0 < 1.5, "the caller never waits for a stalled node"
    assert big.result(20) == [_seg("big")] and after.result(20) == [_seg("after")]
    assert lane.closed is None and node.seen == ["big", "after"]
    assert node.server.stats()["undelivered"] == 0 and not node.released
    lane.close()


def test_submit_waits_out_a_stall_in_the_sender_thread(node, monkeypatch):
    monkeypatch.setattr(lane_mod, "SEND_TIMEOUT_S", 0.5, raising=False)
    lane = open_lane(node.server.info(), "node-a")
    node.stall(2.0)
    time.sleep(0.1)
    futs = [lane.submit("persist_many", [_req(f"s{i}", BIG // 4)]) for i in range(4)]
    assert [f.result(20) for f in futs] == [[_seg(f"s{i}")] for i in range(4)]
    assert lane.closed is None
    lane.close()


def test_a_frame_not_begun_by_its_deadline_is_dropped_unsent(node):
    """Only the call whose deadline passed fails (DeadlineError), and the node never sees
    it; the call in the middle of its frame and the one with a later deadline complete."""
    lane = open_lane(node.server.info(), "node-a")
    reqs = [_req("big", BIG)], [_req("short")], [_req("long")]
    node.stall(3.0)
    time.sleep(0.1)
    now = time.monotonic()
    big = lane.call("persist_many", reqs[0], deadline=now + 1.0)  # begun at once: it goes
    short = lane.call("persist_many", reqs[1], deadline=now + 1.0)
    long = lane.call("persist_many", reqs[2], deadline=now + 30)
    with pytest.raises(DeadlineError, match="not sent"):
        short.result(10)
    assert big.result(20) == [_seg("big")] and long.result(20) == [_seg("long")]
    assert node.seen == ["big", "long"] and lane.closed is None
    lane.close()


def test_an_answer_that_cannot_be_delivered_is_released_at_the_node(node):
    """The caller's process dies with a call in flight: the node finishes the call and,
    unable to answer, releases the segments it wrote for it (before: dropped, the file
    stayed until the job's next recovery)."""
    lane = open_lane(node.server.info(), "node-a")
    held = lane.call("persist_many", [_req("hold")])
    deadline = time.monotonic() + 5
    while "hold" not in node.seen:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    lane._sock.shutdown(socket.SHUT_RDWR)  # the caller's process dies
    with pytest.raises(LaneClosedError):
        held.result(5)
    node.hold.set()
    deadline = time.monotonic() + 5
    while not node.released:
        assert time.monotonic() < deadline, "the undelivered answer was not released"
        time.sleep(0.01)
    assert node.released == [(["hold"], [_seg("hold")])]
    assert node.server.stats()["undelivered"] == 1
    lane.close()


def _wait(cond, what: str, timeout: float = 30.0) -> None:  # (generous: a loaded machine)
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("how", ["cut", "close"])
def test_an_answer_in_the_socket_buffer_when_the_lane_closes_is_read_not_dropped(node, how):
    """The node wrote an answer (the kernel took it, so the node counts it delivered) that
    the writer had not read yet when it closed the lane. Before the fix the close shut the
    socket both ways at once and failed the call: the answer was thrown away with the
    buffer, nobody released its segments (released == [], undelivered == 0), and the file
    stayed until the job's next recovery. Now it is read and reaches its caller."""
    lane = open_lane(node.server.info(), "node-a")
    gate, busy = threading.Event(), threading.Event()
    first = lane.call("persist_many", [_req("first")])

    def hold_the_reader(_f):  # the reader thread runs this: it reads nothing meanwhile
        busy.set()
        gate.wait(10)

    first.add_done_callback(hold_the_reader)
    held = lane.call("persist_many", [_req("hold")])
    _wait(busy.is_set, "the first answer never came")
    _wait(lambda: "hold" in node.seen, "the node never took the call")
    node.hold.set()
    _wait(lambda: not node.server._tasks, "the node did not answer")  # in the buffer now
    closer = threading.Thread(target=lane.close, args=(0 if how == "cut" else 0.2,))
    closer.start()
    time.sleep(0.3)
    gate.set()
    closer.join(5)
    assert held.result(5) == [_seg("hold")]
    assert not node.released and node.server.stats()["undelivered"] == 0


def test_closing_shuts_the_write_side_and_reads_the_answers_still_coming(node):
    """close() waits for the node to answer what it read, then for its end of the stream:
    the server must not close its side (dropping the answers in flight) at the writer's
    end of stream."""
    lane = open_lane(node.server.info(), "node-a")
    held = lane.call("persist_many", [_req("hold")])
    _wait(lambda: "hold" in node.seen, "the node never took the call")
    threading.Timer(0.5, node.hold.set).start()
    t0 = time.monotonic()
    lane.close(drain_s=10)
    assert time.monotonic() - t0 < 5
    assert held.result(0) == [_seg("hold")]
    assert node.server.stats()["undelivered"] == 0 and not node.released


def test_an_answer_after_the_drain_is_released_once_at_the_node(node):
    lane = open_lane(node.server.info(), "node-a")
    held = lane.call("persist_many", [_req("hold")])
    _wait(lambda: "hold" in node.seen, "the node never took the call")
    lane.close(drain_s=0.3)  # the read side is shut: the node cannot deliver it any more
    with pytest.raises(LaneClosedError):
        held.result(5)
    node.hold.set()
    _wait(lambda: node.released, "the undelivered answer was not released")
    time.sleep(0.2)
    assert node.released == [(["hold"], [_seg("hold")])]


def test_an_answer_to_a_cancelled_call_goes_to_the_late_hook_and_the_lane_lives(node):
    """A caller that stopped waiting cancels its future (routing's late-answer wait does).
    Before the fix the reader's set_result raised InvalidStateError, which closed the whole
    lane, failed every other call in flight and dropped the answer: its segments leaked."""
    lane = open_lane(node.server.info(), "node-a")
    late: list = []
    lane.late = lambda method, sent, results: late.append(
        (method, [s.log_id for s in sent], results))
    held = lane.call("persist_many", [_req("hold")])
    _wait(lambda: "hold" in node.seen, "the node never took the call")
    assert held.cancel()
    other = lane.call("persist_many", [_req("hold")])  # (held too: answered right after)
    node.hold.set()
    assert other.result(5) == [_seg("hold")]
    _wait(lambda: late, "the cancelled call's answer went nowhere")
    assert late == [("persist_many", [bytes(range(16)).hex()], [_seg("hold")])]
    assert lane.closed is None
    assert lane.call("persist_many", [_req("after")]).result(5) == [_seg("after")]
    lane.close()


def test_an_answer_that_does_not_encode_is_released_and_answered_with_the_error():
    """The call succeeded (the node wrote the segment) but its answer could not be encoded:
    before the fix an error answer went out and nothing was released."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    released: list = []

    async def persist_many(requests):
        return [object()]  # no segment, no error: not encodable

    async def release(requests, results):
        released.append(([r.source for r in requests], results))

    server = LaneServer("node-a", {"persist_many": persist_many}, release=release)
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        lane = open_lane(server.info(), "node-a")
        with pytest.raises(Exception, match="could not encode its answer"):
            lane.call("persist_many", [_req("odd")]).result(5)
        assert len(released) == 1 and released[0][0] == ["odd"]
        assert lane.closed is None
        lane.close()
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_a_call_cancelled_while_its_answer_waits_for_the_socket_is_released(node):
    """An answer larger than the socket takes, to a writer that reads nothing (a raw
    socket): the call's task is cancelled while it waits to drain (the node shutting down).
    Before the fix the CancelledError skipped the release."""
    from dstl_ray.transport.lane import frame, hello_bytes
    from dstl_ray.transport.lane_codec import encode_call

    many = [_req(f"r{i}") for i in range(20000)]  # an answer of a few MiB
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(node.server.info()["path"])
    s.settimeout(5)
    s.sendall(hello_bytes(node.server.token))
    assert s.recv(2) == b"OK"
    s.sendall(frame(encode_call(1, "persist_many", (many,))))
    _wait(lambda: len(node.seen) == len(many), "the node never took the call")
    # the answer's first bytes are in our socket (FIONREAD), the rest stuck behind them
    _wait(lambda: struct.unpack("i", fcntl.ioctl(s.fileno(), termios.FIONREAD,
                                                 b"\0" * 4))[0] > 0,
          "the node never began its answer")
    time.sleep(0.2)
    assert node.server._tasks

    async def cancel():
        for t in list(node.server._tasks):
            t.cancel()

    node.run(cancel())
    _wait(lambda: node.released, "the cancelled call's answer was not released")
    assert node.released[0][0] == [f"r{i}" for i in range(len(many))]
    s.close()
