"""A lane is tied to the process it was opened to (dstl_ray.node.peers): once Ray's actor
table holds the peer's actor dead (its Ray node declared dead while the old process still
runs) or restarted in another process, the lane is cut at once, open or retiring. Its calls
in flight fail (the child flushes itself), and the old process releases what it wrote for
them instead of answering a child that would release it at the wrong actor. A peer that is
only stalled stays ALIVE in Ray and keeps its lane."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import types

import pytest

from dstl_ray.format.changelog import BlockIndex, EncodedSection
from dstl_ray.format.segment import Segment
from dstl_ray.node import peers as peers_mod
from dstl_ray.node.lane_server import LaneServer
from dstl_ray.transport import lane_watch
from dstl_ray.transport.base import PersistRequest
from dstl_ray.transport.lane import LaneClosedError
from dstl_ray.transport.sender import Caller


def _req(tag: str) -> PersistRequest:
    log = bytes(range(16))
    section = EncodedSection(log, b"x" * 8, (BlockIndex(log, 3, 1, 2, 0, 8),), 1, 2, 0)
    return PersistRequest("job", section, tag, (), 7, Caller("ns"), 4, "inc-1", 6)


def _seg(tag: str) -> Segment:
    return Segment(f"dstl/node-a/{tag}.dstl", 0, 8, 1, 2, "node-a")


class _Handle:
    """What Peers asks of a node actor handle: ``lane.remote()``."""

    def __init__(self, info):
        async def remote():
            return info

        self.lane = types.SimpleNamespace(remote=remote)


def _wait(cond, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture
def zombie(monkeypatch):
    monkeypatch.setattr(lane_watch, "LANE_CHECK_S", 0.05)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    hold = threading.Event()
    released: list = []

    async def persist_many(requests):
        tags = [r.source for r in requests]
        if "hold" in tags[0]:
            await asyncio.to_thread(hold.wait, 30)
        return [_seg(t) for t in tags]

    async def release(requests, results):
        released.append(([r.source for r in requests], results))

    server = LaneServer("node-a", {"persist_many": persist_many}, release=release)

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(10)

    run(server.start())
    ray_says = {"state": ("ALIVE", os.getpid())}  # Ray's actor table for node-a's actor
    p = peers_mod.Peers("ns", actor_state=lambda handle: ray_says["lookup"](handle)
                        if "lookup" in ray_says else ray_says["state"])
    p.actor = {"node-a": _Handle(server.info())}.__getitem__  # type: ignore[method-assign]

    async def open_lane():
        assert p.lane("node-a") is None  # the first call opens it in the background
        await p._opening["node-a"]
        return p.lane("node-a")

    async def send(tag):
        return p.send("node-a", "persist_many", [_req(tag)], timeout_s=30)

    yield types.SimpleNamespace(p=p, run=run, open=lambda: run(open_lane()),
                                send=lambda tag: run(send(tag)), ray_says=ray_says, loop=loop,
                                hold=hold, released=released, server=server)
    hold.set()
    p.close()
    run(server.close())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.mark.parametrize("state", [("DEAD", 0), ("ALIVE", 1), ("RESTARTING", 0)])
def test_a_lane_to_a_process_that_is_no_longer_the_actor_is_cut(zombie, state):
    lane = zombie.open()
    assert lane is not None and lane.peer_pid == os.getpid()
    held, by_lane = zombie.send("hold")
    assert by_lane
    time.sleep(0.3)  # several checks: ALIVE with this pid, the lane stays
    assert zombie.p.lanes.get("node-a") is lane and zombie.p.cut == 0
    zombie.ray_says["state"] = state  # the node was declared dead / the actor restarted
    _wait(lambda: lane.closed is not None, "the lane to the zombie was not cut")
    _wait(lambda: zombie.p.cut == 1 and "node-a" not in zombie.p.lanes, "not forgotten")
    with pytest.raises(LaneClosedError):
        held.result(5)  # the child flushes this batch itself
    zombie.hold.set()  # the old process finishes the call: nobody may name its file
    _wait(lambda: zombie.released, "the zombie did not release the undelivered answer")
    assert zombie.released == [(["hold"], [_seg("hold")])]


def test_a_retiring_lane_is_cut_too(zombie):
    lane = zombie.open()
    held, _ = zombie.send("hold")
    zombie.p.drop("node-a")  # a call failed: the lane retires, delivering late answers
    time.sleep(0.3)
    assert not lane.done and lane in zombie.p.retiring
    zombie.ray_says["state"] = ("DEAD", 0)
    _wait(lambda: lane.done, "the retiring lane to the zombie was not cut")
    with pytest.raises(LaneClosedError):
        held.result(5)
    zombie.hold.set()
    _wait(lambda: zombie.released, "the zombie did not release the undelivered answer")


def test_an_unreadable_actor_table_keeps_the_lane(zombie):
    lane = zombie.open()
    zombie.ray_says["state"] = None  # GCS did not answer: nothing is concluded
    time.sleep(0.3)
    assert lane.closed is None and zombie.p.cut == 0
    fut, by_lane = zombie.send("quick")
    assert by_lane and fut.result(5) == [_seg("quick")]


@pytest.mark.parametrize("state", [("ALIVE", 0), ("", 0), ("PENDING_CREATION", 0)])
def test_an_entry_without_a_pid_or_a_known_state_keeps_the_lane(zombie, state):
    """Only DEAD or RESTARTING, or a nonzero pid other than the lane's, cut a lane. Before
    the fix anything but ALIVE with the lane's pid did: an entry without a pid (the actor
    table is a private Ray API) cut every lane at every check, and each cut made the
    children flush their batches themselves."""
    lane = zombie.open()
    zombie.ray_says["state"] = state
    time.sleep(0.4)  # several checks
    assert lane.closed is None and zombie.p.cut == 0 and zombie.p.alive("node-a")
    fut, by_lane = zombie.send("quick")
    assert by_lane and fut.result(5) == [_seg("quick")]


def test_a_hung_lookup_blocks_only_the_watchs_own_thread(zombie, monkeypatch):
    """Ray's actor-table lookup has no timeout of its own (an unreachable GCS). Before the
    fix every check ran it in the loop's default executor under a wait_for: each check
    that timed out left a thread blocked there, until uploads, appends and releases, which
    use that executor too, waited behind them. Now one thread of the watch's own looks up,
    one lookup at a time."""
    monkeypatch.setattr(peers_mod, "LANE_OPEN_TIMEOUT_S", 0.1)  # (the old check's wait_for)
    lane = zombie.open()
    hung, threads = threading.Event(), []

    def lookup(handle):
        threads.append(threading.current_thread().name)
        hung.wait(30)
        return None

    zombie.ray_says["lookup"] = lookup
    try:
        time.sleep(1.5)  # thirty checks' time
        assert len(threads) == 1 and threads[0].startswith("dstl-"), threads
        # the loop's executor is free for the node's work (flush, release) meanwhile
        work = asyncio.run_coroutine_threadsafe(asyncio.to_thread(lambda: "done"), zombie.loop)
        assert work.result(2) == "done"
    finally:
        hung.set()
    del zombie.ray_says["lookup"]
    time.sleep(0.3)
    assert lane.closed is None and zombie.p.cut == 0
