"""A child node's lane to a parent that is stalled (its loop blocked, as by a GC pause or
SIGSTOP) but ALIVE in Ray (docs/architecture.md "Write path" 4): a forward that runs out of
its budget makes the child flush the batch itself, but keeps the lane (the next batch goes
on it, no new connection); an answer that comes after the child stopped listening is
released without breaking the lane; a mark queued behind a stalled parent is dropped unsent
once it would be late."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import types
from typing import Any

import pytest

from dstl_ray import ChangelogConfig
from dstl_ray.format.changelog import EncodedSection
from dstl_ray.format.segment import Segment
from dstl_ray.node import ChangelogNode
from dstl_ray.node import routing as routing_mod
from dstl_ray.node.lane_server import LaneServer
from dstl_ray.transport.base import PersistRequest
from dstl_ray.transport.sender import Caller

BIG = 16 << 20  # far beyond a Unix socket's buffers


class _Release:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def remote(self, *args: Any) -> concurrent.futures.Future:
        self.calls.append(args)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(True)
        return fut


class _Parent:
    """The parent node actor: a lane server on a loop of its own, which the test can block,
    and its actor handle (``lane()`` and ``release()``)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.seen: list[tuple] = []
        self.hold = threading.Event()
        self.released: list[tuple] = []

        async def persist_batch(requests, source, budget_s=None, sent_at=None):
            tags = [r.source for r in requests]
            self.seen.append(("persist_batch", tags))
            if "hold" in tags:
                await asyncio.to_thread(self.hold.wait, 30)
            return [Segment(f"dstl/parent/{t}.dstl", 0, 5, 0, 0, "parent") for t in tags]

        async def mark(job_id, source, checkpoint_id, caller=None, named=None):
            self.seen.append(("mark", job_id, source, checkpoint_id))

        self.server = LaneServer("parent", {"persist_batch": persist_batch, "mark": mark})
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        info = self.server.info()

        async def lane_info():
            return info

        self.lane = types.SimpleNamespace(remote=lane_info)
        self.release = _Release(self.released)

    def stall(self, seconds: float) -> None:
        self.loop.call_soon_threadsafe(time.sleep, seconds)

    def stop(self) -> None:
        self.hold.set()
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _request(tag: str, size: int = 5) -> PersistRequest:
    log = bytes([len(tag)]) * 16
    section = EncodedSection(log_id=log, data=b"x" * size, index=(), sqn_min=0, sqn_max=0,
                             flags=0)
    return PersistRequest(job_id="j", section=section, source=tag, checkpoint_id=3)


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.setattr(routing_mod, "REPLY_GRACE_S", 0.05)
    parent = _Parent()
    node = ChangelogNode("n1", "child", f"file://{tmp_path}", ChangelogConfig(),
                         parent="parent", level=1)
    node._peers.handles["parent"] = parent
    node._peers.actor_state = lambda handle: ("ALIVE", os.getpid())  # stalled, not gone

    async def open_lane():
        assert node._peers.lane("parent") is None  # the first call opens it
        await node._peers._opening["parent"]
        lane = node._peers.lane("parent")
        assert lane is not None
        return lane

    yield types.SimpleNamespace(node=node, parent=parent, open_lane=open_lane)
    node._peers.close()
    parent.stop()


async def _until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def test_a_forward_past_its_budget_keeps_the_lane_to_a_stalled_parent(tree):
    """Before the fix any failed forward dropped the peer: its lane retired and the next
    batch went by Ray while a new lane opened, although the parent was only stalled."""
    node, router = tree.node, tree.node._router

    async def run() -> None:
        lane = await tree.open_lane()
        tree.parent.stall(1.5)
        reqs = [_request("a"), _request("b")]
        deadline = router._now() + router.flush_reserve() + routing_mod.REPLY_GRACE_S + 0.3
        results = await router.forward_or_flush(reqs, 10, None, deadline)
        assert [x.flushed_by for x in results] == ["child", "child"]  # flushed it itself
        assert node.counters.forward_failures == 1
        assert node._peers.lanes.get("parent") is lane and lane.closed is None
        # the parent, running again, answers late: its segments are released, unused
        await _until(lambda: tree.parent.released, "the late answer was not released")
        assert sorted(a[1] for a in tree.parent.released) == [
            "dstl/parent/a.dstl", "dstl/parent/b.dstl"]
        segs = await router.forward("parent", [_request("c")], 5.0)  # on the same lane
        assert [s.path for s in segs] == ["dstl/parent/c.dstl"]
        assert node._peers.lanes.get("parent") is lane
        assert tree.parent.server.stats()["connections"] == 1

    asyncio.run(run())


def test_an_answer_after_the_child_stopped_listening_is_released_and_the_lane_lives(
        tree, monkeypatch):
    """The child's wait for a late answer ends (LATE_ANSWER_WAIT_S) and cancels the call's
    future. Before the fix the answer, when it came, raised InvalidStateError in the lane's
    reader: the lane closed (failing every call in flight on it) and the answer was dropped,
    its file kept until the job's next recovery."""
    monkeypatch.setattr(routing_mod, "LATE_ANSWER_WAIT_S", 0.2)
    node, router = tree.node, tree.node._router

    async def run() -> None:
        lane = await tree.open_lane()
        with pytest.raises(asyncio.TimeoutError):
            await router.forward("parent", [_request("hold")], 0.05)
        await _until(lambda: not router.late_answers, "the child never stopped listening")
        tree.parent.hold.set()  # now the parent answers
        await _until(lambda: tree.parent.released, "the answer was not released")
        assert [a[1] for a in tree.parent.released] == ["dstl/parent/hold.dstl"]
        assert lane.closed is None and node._peers.lanes.get("parent") is lane
        segs = await router.forward("parent", [_request("after")], 5.0)
        assert [s.path for s in segs] == ["dstl/parent/after.dstl"]

    asyncio.run(run())


def test_a_mark_queued_behind_a_stalled_parent_is_dropped_unsent(tree, monkeypatch):
    """A batch larger than the socket's buffers is on its way to a stalled parent, and a
    mark is queued behind it. Before the fix a mark had no deadline: it went up whenever the
    parent read again, however stale."""
    node = tree.node
    monkeypatch.setattr(node._router, "request_budget", lambda: 0.5)

    async def run() -> None:
        await tree.open_lane()
        tree.parent.stall(3.0)
        await asyncio.sleep(0.1)
        big, by_lane = node._peers.send("parent", "persist_batch", [_request("big", BIG)],
                                        "child", 30.0, time.time(), timeout_s=30)
        assert by_lane
        await node.mark("j", "w1", 3, Caller("ns"), None)
        assert node.counters.marks_by_lane == 1
        await asyncio.wrap_future(big)  # the parent took the batch, after its stall
        await asyncio.sleep(0.5)
        assert ("persist_batch", ["big"]) in tree.parent.seen
        assert not [s for s in tree.parent.seen if s[0] == "mark"], tree.parent.seen

    asyncio.run(run())
