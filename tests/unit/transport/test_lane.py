"""The local lane (dstl_ray.transport.lane, dstl_ray.node.lane_server) without Ray: a real
Unix socket between a client and a server on an asyncio loop in a thread, as in a node
actor. Calls reach the handlers in order, results and errors come back to the right call, a
wrong token is refused, and a lane that breaks fails every call in flight."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Iterator

import pytest

from dstl_ray.errors import DstlError, NodeUnavailableError, PersistError
from dstl_ray.node.lane_server import LaneServer
from dstl_ray.transport.lane import Lane, LaneClosedError, encode, machine_id, open_lane


class _Loop:
    """An asyncio loop in a thread, as a node actor's."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class _Unpicklable(Exception):
    def __init__(self, a, b):  # pickle calls __init__ with args=(msg,): fails
        super().__init__(f"{a}/{b}")
        self.lock = threading.Lock()


@pytest.fixture
def served() -> Iterator[tuple[LaneServer, _Loop, list]]:
    loop = _Loop()
    seen: list = []
    release = asyncio.Event()

    async def persist_many(requests):
        seen.append(("persist_many", list(requests)))
        if requests == ["hold"]:
            await release.wait()
        if requests == ["fail"]:
            raise PersistError("no space left")
        if requests == ["odd"]:
            raise _Unpicklable(1, 2)
        return [f"seg-{r}" for r in requests]

    async def mark(job_id, source, checkpoint_id, caller=None, named=None):
        seen.append(("mark", job_id, source, checkpoint_id, named))

    server = LaneServer("node-a", {"persist_many": persist_many, "mark": mark})
    loop.run(server.start())
    server.release = lambda: loop.loop.call_soon_threadsafe(release.set)  # type: ignore[attr-defined]
    yield server, loop, seen
    loop.run(server.close())
    loop.stop()


def test_calls_reach_the_handlers_in_order_and_answer_their_callers(served):
    server, _loop, seen = served
    info = server.info()
    assert info["machine"] == machine_id() and oct(os.stat(os.path.dirname(info["path"]))
                                                   .st_mode)[-3:] == "700"
    lane = open_lane(info, "node-a")
    assert isinstance(lane, Lane)
    futs = [lane.call("persist_many", [f"r{i}"]) for i in range(50)]
    futs.append(lane.call("mark", "job", "log1", 7, None, 3))
    assert [f.result(5) for f in futs[:-1]] == [[f"seg-r{i}"] for i in range(50)]
    assert futs[-1].result(5) is None
    assert seen[:50] == [("persist_many", [f"r{i}"]) for i in range(50)]
    assert seen[50] == ("mark", "job", "log1", 7, 3)
    assert server.stats() == {"calls": 51, "connections": 1, "refused": 0}
    lane.close()


def test_errors_come_back_to_their_call_even_when_they_do_not_pickle(served):
    server, _loop, _seen = served
    lane = open_lane(server.info(), "node-a")
    with pytest.raises(PersistError, match="no space left"):
        lane.call("persist_many", ["fail"]).result(5)
    with pytest.raises(DstlError, match="_Unpicklable: 1/2"):
        lane.call("persist_many", ["odd"]).result(5)
    assert lane.call("persist_many", ["ok"]).result(5) == ["seg-ok"]  # still usable
    with pytest.raises(DstlError, match="carries"):
        lane.call("register_writer", "x")  # only persist_many and mark go by lane
    lane.close()


def test_a_slow_call_does_not_hold_up_the_next(served):
    server, _loop, _seen = served
    lane = open_lane(server.info(), "node-a")
    held = lane.call("persist_many", ["hold"])
    assert lane.call("persist_many", ["quick"]).result(5) == ["seg-quick"]
    assert not held.done()
    server.release()
    assert held.result(5) == ["seg-hold"]
    lane.close()


def test_a_wrong_token_is_refused(served):
    server, _loop, seen = served
    info = dict(server.info(), token="0" * 32)
    with pytest.raises(DstlError, match="refused"):
        Lane(info["path"], info["token"], "node-a")
    assert open_lane(info, "node-a") is None  # the transport then uses Ray
    assert server.stats()["refused"] == 2 and not seen


def test_a_garbage_frame_closes_that_connection_only(served):
    server, _loop, _seen = served
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.info()["path"])
    s.sendall(b"\xff" * 8 + b"junk")  # a length no frame has
    s.settimeout(5)
    assert s.recv(1) == b""  # closed by the server
    s.close()
    lane = open_lane(server.info(), "node-a")
    assert lane.call("persist_many", ["ok"]).result(5) == ["seg-ok"]
    lane.close()


def test_a_lane_that_breaks_fails_its_calls_in_flight(served):
    server, loop, _seen = served
    lane = open_lane(server.info(), "node-a")
    held = lane.call("persist_many", ["hold"])
    loop.run(server.close())  # the server stops listening; the connection stays up
    lane._sock.shutdown(socket.SHUT_RDWR)  # the node process dies: the socket goes
    with pytest.raises(LaneClosedError) as e:
        held.result(5)
    assert isinstance(e.value, NodeUnavailableError)  # the transport finds its node again
    with pytest.raises(LaneClosedError):
        lane.call("persist_many", ["after"])  # nothing sent: the caller goes by Ray
    lane.close()


def test_no_lane_to_another_machine_or_a_missing_socket(served):
    server, _loop, _seen = served
    assert open_lane(dict(server.info(), machine="elsewhere/boot"), "node-a") is None
    assert open_lane(dict(server.info(), path="/nonexistent/lane.sock"), "node-a") is None


def test_frames_carry_large_values():
    data = os.urandom(3 << 20)
    frame = encode((1, True, [data]))
    assert len(frame) > 3 << 20 and frame[:8] == (len(frame) - 8).to_bytes(8, "big")


class _TwoArgs(Exception):
    def __init__(self, a, b):  # pickles, but unpickling calls __init__ with one argument
        super().__init__(f"{a}-{b}")


def test_an_answer_the_writer_cannot_read_fails_that_call_only():
    from dstl_ray.transport.lane import dump_answer, load_answer

    ok, value = load_answer(False, dump_answer(_TwoArgs(1, 2)))
    assert not ok and isinstance(value, DstlError) and "could not be read" in str(value)
    assert load_answer(True, dump_answer(["seg"])) == (True, ["seg"])
