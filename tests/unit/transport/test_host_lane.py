"""The host lane (dstl_ray.transport.lane over TCP, dstl_ray.node.lane_server with
``tcp_host``) without Ray: a real TCP connection on loopback between a client and a server on
an asyncio loop in a thread, as between node actors on two hosts. The same frames, token and
failure semantics as the Unix lane: a peer on another machine is reached over TCP only when
asked for, a wrong token is refused, a lane that breaks fails its calls in flight, and peers
open host lanes to a node on another machine."""

from __future__ import annotations

import socket
import time

import pytest

from dstl_ray.errors import DstlError, NodeUnavailableError, PersistError
from dstl_ray.node import peers as peers_mod
from dstl_ray.node.lane_server import LaneServer
from dstl_ray.transport.lane import Lane, LaneClosedError, open_lane

from .lane_util import _Loop, _Node, _req, _seg

ELSEWHERE = "another-host/boot"  # a peer's machine id other than this one's


def remote(info: dict) -> dict:
    """``info`` as a node on another host offers it (its Unix socket is not ours)."""
    return dict(info, machine=ELSEWHERE)


def test_a_node_on_another_machine_is_reached_over_tcp_only_when_asked(served):
    server, _loop, seen = served
    info = remote(server.info())
    assert info["tcp"].startswith("tcp://127.0.0.1:")
    assert open_lane(info, "node-a") is None  # writers: Unix lanes only, else Ray
    lane = open_lane(info, "node-a", tcp=True)
    assert isinstance(lane, Lane) and lane.path == info["tcp"]
    futs = [lane.call("persist_many", [_req(f"r{i}")]) for i in range(30)]
    big = lane.call("persist_batch", [_req("big", b"x" * (4 << 20))], "node-b", 2.0, 1.0)
    assert [f.result(10) for f in futs] == [[_seg(f"r{i}")] for i in range(30)]
    assert big.result(10) == [_seg("big")]
    assert seen[:30] == [("persist_many", [f"r{i}"]) for i in range(30)]
    assert seen[30] == ("persist_batch", "node-b", ["big"])
    with pytest.raises(PersistError, match="no space left"):
        lane.call("persist_many", [_req("fail")]).result(5)
    assert (server.stats()["connections"], server.stats()["tcp_connections"]) == (1, 1)
    lane.close()


def test_a_wrong_token_is_refused_over_tcp(served):
    server, _loop, seen = served
    info = remote(dict(server.info(), token="0" * 32))
    with pytest.raises(DstlError, match="refused"):
        Lane(info["tcp"], info["token"], "node-a")
    assert open_lane(info, "node-a", tcp=True) is None  # the peer then uses Ray
    assert server.stats()["refused"] == 2 and not seen


def test_a_host_lane_that_breaks_fails_its_calls_in_flight(served):
    server, loop, _seen = served
    lane = open_lane(remote(server.info()), "node-a", tcp=True)
    held = lane.call("persist_many", [_req("hold")])
    loop.run(server.close())
    lane._sock.shutdown(socket.SHUT_RDWR)  # the peer's host is gone
    with pytest.raises(LaneClosedError) as e:
        held.result(5)
    assert isinstance(e.value, NodeUnavailableError)
    lane.close()


def test_no_host_lane_without_a_tcp_address_or_to_a_closed_port(served):
    server, _loop, _seen = served
    info = remote(server.info())
    assert open_lane({k: v for k, v in info.items() if k != "tcp"}, "node-a", tcp=True) is None
    assert open_lane(dict(info, tcp="unix:///tmp/x"), "node-a", tcp=True) is None
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert open_lane(dict(info, tcp=f"tcp://127.0.0.1:{port}"), "node-a", tcp=True) is None


def test_peers_open_host_lanes_to_a_node_on_another_machine(served):
    """A node actor's peers (dstl_ray.node.peers) with host lanes on reach a parent on
    another machine over TCP; with them off, over Ray."""
    server, loop, _seen = served
    nodes = {"node-a": _Node(remote(server.info()))}

    async def opened(p, name):
        first = p.lane(name)
        task = p._opening.get(name)
        if task is not None:
            await task
        return first, p.lane(name)

    on = peers_mod.Peers("ns", tcp=True)
    on.actor = nodes.__getitem__  # type: ignore[method-assign]
    first, lane = loop.run(opened(on, "node-a"))
    assert first is None and isinstance(lane, Lane) and lane.path.startswith("tcp://")
    fut, by_lane = on.send("node-a", "persist_many", [_req("up")], timeout_s=5.0)
    assert by_lane and fut.result(5) == [_seg("up")]
    on.close()
    off = peers_mod.Peers("ns", clock=time.monotonic)
    off.actor = nodes.__getitem__  # type: ignore[method-assign]
    assert loop.run(opened(off, "node-a")) == (None, None)
    off.close()


def test_a_cut_host_lane_fails_its_calls_at_once_and_releases_their_late_answers(served):
    """Over TCP a cut cannot make the node's later answer fail there (the kernel here would
    take and drop it): the lane fails its calls in flight, reads on, and hands each answer
    still arriving to ``late`` (released), so every answer is released exactly once."""
    server, _loop, _seen = served
    late: list = []
    lane = open_lane(remote(server.info()), "node-a", lambda *a: late.append(a), tcp=True)
    held = lane.call("persist_many", [_req("hold")])
    time.sleep(0.2)  # the node has the call
    lane.cut("Ray holds its actor DEAD")
    with pytest.raises(LaneClosedError):
        held.result(1)
    server.release()
    deadline = time.monotonic() + 5
    while not (late and lane.done):  # the node answered, then closed its side
        assert time.monotonic() < deadline, (late, lane.done)
        time.sleep(0.02)
    (method, sent, results), = late
    assert method == "persist_many" and [s.job_id for s in sent] == ["job"]
    assert results == [_seg("hold")] and server.stats()["undelivered"] == 0


def test_the_lane_names_the_ray_node_and_the_watch_cuts_a_lane_whose_actor_moved():
    from dstl_ray.transport.lane_watch import gone

    loop = _Loop()
    server = LaneServer("node-a", {}, tcp_host="127.0.0.1", node_id="ray-node-1")
    try:
        loop.run(server.start())
        info = remote(server.info())
        assert info["node_id"] == "ray-node-1"
        lane = open_lane(info, "node-a", tcp=True)
        assert lane.peer_node == "ray-node-1"
        lane.close()
    finally:
        loop.run(server.close())
        loop.stop()
    pid = 4242
    assert gone(("ALIVE", pid, "ray-node-1"), pid, "ray-node-1") is None
    # restarted on a fresh host, with the pid it had on the lost one
    assert "node ray-node-2" in gone(("ALIVE", pid, "ray-node-2"), pid, "ray-node-1")
    assert gone(("ALIVE", pid, ""), pid, "ray-node-1") is None  # unknown: kept
    assert gone(("ALIVE", pid), pid, "ray-node-1") is None


def test_a_connection_that_does_not_say_the_token_in_time_is_dropped(served, monkeypatch):
    from dstl_ray.node import lane_server

    server, _loop, _seen = served
    monkeypatch.setattr(lane_server, "HELLO_TIMEOUT_S", 0.3)
    host, port = server.info()["tcp"][len("tcp://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(5)
        assert s.recv(2) == b""  # closed by the node, nothing said
    assert open_lane(remote(server.info()), "node-a", tcp=True) is not None


def test_a_host_lane_address_that_cannot_be_bound_leaves_the_unix_lane():
    loop = _Loop()
    server = LaneServer("node-a", {}, tcp_host="203.0.113.7")  # (TEST-NET: not this host's)
    try:
        loop.run(server.start())
        info = server.info()
        assert "tcp" not in info and open_lane(info, "node-a") is not None
    finally:
        loop.run(server.close())
        loop.stop()
