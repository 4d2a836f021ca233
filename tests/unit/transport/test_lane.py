"""The local lane (dstl_ray.transport.lane, dstl_ray.node.lane_server) without Ray: a real
Unix socket between a client and a server on an asyncio loop in a thread, as in a node
actor. Calls reach the handlers in order, results and errors come back to the right call, a
wrong token is refused, and a lane that breaks fails every call in flight."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

from dstl_ray.errors import (
    DeadlineError,
    DstlError,
    FencedError,
    NodeUnavailableError,
    PersistError,
    StorageError,
)
from dstl_ray.node.lane_server import LaneServer
from dstl_ray.transport.lane import Lane, LaneClosedError, frame, machine_id, open_lane
from dstl_ray.transport.lane_codec import (
    HELLO,
    decode_answer,
    decode_call,
    encode_answer,
    encode_call,
)
from dstl_ray.transport.sender import Caller

from .lane_util import _Loop, _Node, _req, _seg


def test_calls_reach_the_handlers_in_order_and_answer_their_callers(served):
    server, _loop, seen = served
    info = server.info()
    assert info["machine"] == machine_id() and oct(os.stat(os.path.dirname(info["path"]))
                                                   .st_mode)[-3:] == "700"
    lane = open_lane(info, "node-a")
    assert isinstance(lane, Lane)
    futs = [lane.call("persist_many", [_req(f"r{i}")]) for i in range(50)]
    futs.append(lane.call("mark", "job", "log1", 7, None, 3))
    assert [f.result(5) for f in futs[:-1]] == [[_seg(f"r{i}")] for i in range(50)]
    assert futs[-1].result(5) is None
    assert seen[:50] == [("persist_many", [f"r{i}"]) for i in range(50)]
    assert seen[50] == ("mark", "job", "log1", 7, 3)
    assert server.stats() == {"calls": 51, "connections": 1, "tcp_connections": 0,
                              "refused": 0, "undelivered": 0}
    lane.close()


def test_errors_come_back_to_their_call_as_their_class(served):
    server, _loop, _seen = served
    lane = open_lane(server.info(), "node-a")
    with pytest.raises(PersistError, match="no space left"):
        lane.call("persist_many", [_req("fail")]).result(5)
    with pytest.raises(DstlError, match="_Unpicklable: 1/2"):
        lane.call("persist_many", [_req("odd")]).result(5)
    (e,) = lane.call("persist_many", [_req("fenced")]).result(5)  # a per-request error
    assert type(e) is FencedError and str(e) == "job is fenced"
    assert lane.call("persist_many", [_req("ok")]).result(5) == [_seg("ok")]  # still usable
    with pytest.raises(DstlError, match="carries"):
        lane.call("register_writer", "x")  # only persist_many and mark go by lane
    assert lane.closed is None  # a call that does not encode leaves the lane as it was
    assert lane.call("persist_many", [_req("after")]).result(5) == [_seg("after")]
    lane.close()


def test_a_slow_call_does_not_hold_up_the_next(served):
    server, _loop, _seen = served
    lane = open_lane(server.info(), "node-a")
    held = lane.call("persist_many", [_req("hold")])
    assert lane.call("persist_many", [_req("quick")]).result(5) == [_seg("quick")]
    assert not held.done()
    server.release()
    assert held.result(5) == [_seg("hold")]
    lane.close()


def test_a_wrong_token_is_refused(served):
    server, _loop, seen = served
    info = dict(server.info(), token="0" * 32)
    with pytest.raises(DstlError, match="refused"):
        Lane(info["path"], info["token"], "node-a")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a pickle instead of the hello
    s.connect(info["path"])
    s.settimeout(5)
    s.sendall(frame(HELLO + server.token.encode()))  # a frame, not the raw hello
    assert s.recv(2) == b"NO"
    s.close()
    assert open_lane(info, "node-a") is None  # the transport then uses Ray
    assert server.stats()["refused"] == 3 and not seen


def test_a_peer_of_the_earlier_protocol_is_refused_and_goes_by_ray(served, caplog):
    """Protocol /1 sent a section's index as JSON lists, /2 packs it: a writer or child node
    of the other version is refused at the hello (before it sends a call the node would read
    wrongly), logged as a protocol mismatch (not as a bad token), and its transport uses
    Ray calls instead (whose requests pickle alike in both versions)."""
    server, _loop, seen = served
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.info()["path"])
    s.settimeout(5)
    s.sendall(b"DSTL-LANE/1" + server.token.encode())
    assert s.recv(2) == b"NO"
    s.close()
    assert HELLO == b"DSTL-LANE/2" and server.stats()["refused"] == 1 and not seen
    assert "of protocol DSTL-LANE/1 refused (this node speaks DSTL-LANE/2)" in caplog.text


def test_a_garbage_frame_closes_that_connection_only(served):
    server, _loop, _seen = served
    from dstl_ray.transport.lane import hello_bytes

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.info()["path"])
    s.settimeout(5)
    s.sendall(hello_bytes(server.info()["token"]))
    assert s.recv(2) == b"OK"
    s.sendall(b"\xff" * 8 + b"junk")  # a length no frame has
    assert s.recv(1) == b""  # closed by the server
    s.close()
    lane = open_lane(server.info(), "node-a")
    assert lane.call("persist_many", [_req("ok")]).result(5) == [_seg("ok")]
    lane.close()


def test_a_lane_that_breaks_fails_its_calls_in_flight(served):
    server, loop, _seen = served
    lane = open_lane(server.info(), "node-a")
    held = lane.call("persist_many", [_req("hold")])
    loop.run(server.close())  # the server stops listening; the connection stays up
    lane._sock.shutdown(socket.SHUT_RDWR)  # the node process dies: the socket goes
    with pytest.raises(LaneClosedError) as e:
        held.result(5)
    assert isinstance(e.value, NodeUnavailableError)  # the transport finds its node again
    with pytest.raises(LaneClosedError):
        lane.call("persist_many", [_req("after")])  # nothing sent: the caller goes by Ray
    lane.close()


def test_no_lane_to_another_machine_or_a_missing_socket(served):
    server, _loop, _seen = served
    assert open_lane(dict(server.info(), machine="elsewhere/boot"), "node-a") is None
    assert open_lane(dict(server.info(), path="/nonexistent/lane.sock"), "node-a") is None


def test_calls_and_answers_round_trip_without_pickle():
    big = os.urandom(3 << 20)
    reqs = [_req("a"), _req("b", big)]
    call_id, method, (got,) = decode_call(encode_call(9, "persist_many", (reqs,)))
    assert (call_id, method) == (9, "persist_many") and got == reqs
    assert decode_call(encode_call(2, "mark", ("job", "log", 4, Caller("ns"), None))) == (
        2, "mark", ("job", "log", 4, Caller("ns"), None))
    answer = [_seg("a"), PersistError("disk full")]
    cid, ok, value = decode_answer(encode_answer(9, True, answer))
    assert (cid, ok) == (9, True) and value[0] == _seg("a")
    assert type(value[1]) is PersistError and str(value[1]) == "disk full"
    assert decode_answer(encode_answer(3, True, None)) == (3, True, None)
    cid, ok, value = decode_answer(encode_answer(4, False, KeyError("x")))
    assert not ok and type(value) is DstlError and "KeyError" in str(value)
    # a child node's batch: its requests, its name, its budget and when it sent it
    for budget, sent in ((2.5, 1700000000.25), (float("inf"), 3), (None, None)):
        _, method, args = decode_call(encode_call(7, "persist_batch", (reqs, "node-b", budget,
                                                                       sent)))
        assert method == "persist_batch" and args == (reqs, "node-b", budget,
                                                      None if sent is None else float(sent))
    cid, ok, value = decode_answer(encode_answer(7, True, [StorageError("s3 down"),
                                                           DeadlineError("late")]))
    # the child flushes these itself (routing.flush_failed): their classes must survive
    assert [type(v) for v in value] == [StorageError, DeadlineError]


@pytest.mark.parametrize("body", [b"", b"\x00\x00\x00\x05{}", b"\x00\x00\x00\x02{}junk",
                                  b"\x00\x00\x00\x09{\"b\":[99]}"])
def test_malformed_frames_are_refused_by_name(body):
    with pytest.raises(DstlError, match="malformed lane frame"):
        decode_call(body)


def test_a_call_with_bad_fields_is_answered_with_the_error():
    import json
    import struct

    head = json.dumps({"id": 4, "m": "persist_batch", "r": [], "a": ["n", True, None],
                       "b": []}).encode()
    with pytest.raises(DstlError, match="budget") as e:
        decode_call(struct.pack(">I", len(head)) + head)
    assert e.value.call_id == 4

    head = json.dumps({"id": 5, "m": "mark", "a": ["job", 3, 4, None, None], "b": []}).encode()
    with pytest.raises(DstlError, match="source") as e:
        decode_call(struct.pack(">I", len(head)) + head)
    assert e.value.call_id == 5  # the server answers call 5 with it; the lane lives on
    head = json.dumps({"id": 6, "m": "exec", "b": []}).encode()
    with pytest.raises(DstlError, match="carries") as e:
        decode_call(struct.pack(">I", len(head)) + head)
    assert e.value.call_id == 6


def test_close_waits_for_the_calls_in_flight(served):
    server, _loop, _seen = served
    lane = open_lane(server.info(), "node-a")
    held = lane.call("persist_many", [_req("hold")])
    threading.Timer(0.3, server.release).start()
    lane.close(drain_s=5)  # the answer names a durable segment: wait for it
    assert held.result(0) == [_seg("hold")]


def test_concurrent_starts_listen_once():
    import tempfile

    from dstl_ray.node.lane_server import DIR_PREFIX

    def mine() -> set[str]:
        return {d for d in os.listdir(tempfile.gettempdir())
                if d.startswith(f"{DIR_PREFIX}{os.getpid()}-")}

    before = mine()
    loop = _Loop()
    server = LaneServer("node-b", {})

    async def three():
        await asyncio.gather(server.start(), server.start(), server.start())

    loop.run(three())
    assert len(mine() - before) == 1  # one directory, one server
    loop.run(server.close())
    assert mine() == before
    loop.stop()


def test_the_server_answers_a_bad_call_and_keeps_the_connection(served):
    import json
    import struct

    from dstl_ray.transport.lane import hello_bytes

    server, _loop, seen = served
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.info()["path"])
    s.settimeout(5)
    s.sendall(hello_bytes(server.token))
    assert s.recv(2) == b"OK"
    head = json.dumps({"id": 5, "m": "mark", "a": ["job", 3, 4, None, None], "b": []}).encode()
    s.sendall(frame(struct.pack(">I", len(head)) + head))
    s.sendall(frame(encode_call(6, "mark", ("job", "log", 4, None, None))))

    def answer():
        n = int.from_bytes(s.recv(8, socket.MSG_WAITALL), "big")
        return decode_answer(s.recv(n, socket.MSG_WAITALL))

    got = dict((cid, (ok, v)) for cid, ok, v in (answer(), answer()))
    assert got[5][0] is False and "source" in str(got[5][1])
    assert got[6] == (True, None) and ("mark", "job", "log", 4, None) in seen
    s.close()


def test_submit_sends_from_the_lanes_thread_in_order_and_a_break_fails_the_queued(served):
    """A node actor's loop only queues (Lane.submit): the lane's sender thread sends, in
    submission order; a call that does not encode raises at once, nothing queued."""
    server, _loop, seen = served
    lane = open_lane(server.info(), "node-a")
    futs = [lane.submit("persist_many", [_req(f"s{i}")]) for i in range(40)]
    futs.append(lane.submit("mark", "job", "node-b", 7, None, None))
    assert [f.result(5) for f in futs[:-1]] == [[_seg(f"s{i}")] for i in range(40)]
    assert futs[-1].result(5) is None and seen[40] == ("mark", "job", "node-b", 7, None)
    assert seen[:40] == [("persist_many", [f"s{i}"]) for i in range(40)]
    with pytest.raises(DstlError, match="carries"):
        lane.submit("register_writer", "x")
    held = lane.submit("persist_many", [_req("hold")])
    time.sleep(0.2)
    lane._sock.shutdown(socket.SHUT_RDWR)  # the node process dies
    with pytest.raises(LaneClosedError):
        held.result(5)
    with pytest.raises(LaneClosedError):
        lane.submit("persist_many", [_req("after")])  # nothing queued: by Ray
    lane.close()


def test_peers_open_lanes_in_the_background_and_retire_them_after_their_answers(served):
    """No call waits for a lane: the first finds none and starts opening it; a dropped lane
    still delivers the answers in flight (late answers are released by their receiver),
    then closes; a peer without a lane is asked again only after LANE_RETRY_S."""
    from dstl_ray.node import peers as peers_mod

    server, loop, _seen = served
    now = [0.0]
    nodes = {"node-a": _Node(server.info()), "node-x": _Node(None)}
    p = peers_mod.Peers("ns", clock=lambda: now[0])
    p.actor = nodes.__getitem__  # type: ignore[method-assign]

    async def opened(name):
        first = p.lane(name)
        task = p._opening.get(name)
        if task is not None:
            await task
        return first, p.lane(name)

    first, lane = loop.run(opened("node-a"))
    assert first is None and isinstance(lane, Lane)
    held = lane.submit("persist_many", [_req("hold")])
    time.sleep(0.1)
    loop.run(asyncio.sleep(0))
    p.drop("node-a")  # (as after another call failed)
    # retiring: it takes no new calls, but is not cut off
    assert "node-a" not in p.lanes and lane.closed is not None and not lane.done
    server.release()
    assert held.result(5) == [_seg("hold")]
    deadline = time.monotonic() + 5
    while not lane.done:  # ended once nothing is in flight
        assert time.monotonic() < deadline
        time.sleep(0.02)
    first, again = loop.run(opened("node-a"))  # a new one after the drop
    assert first is None and isinstance(again, Lane) and again is not lane
    again._sock.shutdown(socket.SHUT_RDWR)  # it breaks (the peer restarted)
    deadline = time.monotonic() + 5
    while again.closed is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    _, third = loop.run(opened("node-a"))  # a broken lane is replaced on the next call
    assert isinstance(third, Lane) and third is not again
    assert loop.run(opened("node-x")) == (None, None)  # offers none: Ray calls
    loop.run(opened("node-x"))
    assert nodes["node-x"].asked == 1  # not asked again at once
    now[0] += peers_mod.LANE_RETRY_S
    loop.run(opened("node-x"))
    assert nodes["node-x"].asked == 2
    p.close()
    assert not p.lanes
