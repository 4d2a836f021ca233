"""What the lane tests share (test_lane.py, test_host_lane.py): requests and segments, an
asyncio loop in a thread as a node actor's, a node handle for Peers, and ``served``: a lane
server on that loop, on a Unix socket and on TCP (loopback), registered as a fixture by this
directory's conftest.py."""

from __future__ import annotations

import asyncio
import threading
import types
from collections.abc import Iterator

import pytest

from dstl_ray.errors import FencedError, PersistError
from dstl_ray.format.changelog import BlockIndex, EncodedSection
from dstl_ray.format.segment import Segment
from dstl_ray.node.lane_server import LaneServer
from dstl_ray.transport.base import PersistRequest
from dstl_ray.transport.sender import Caller


def _req(tag: str, data: bytes | None = None) -> PersistRequest:
    log = bytes(range(16))
    body = data if data is not None else tag.encode()
    section = EncodedSection(log, body, (BlockIndex(log, 3, 1, 2, 0, len(body)),), 1, 2, 0)
    return PersistRequest("job", section, tag, (("traceparent", "00-ab-cd-01"),), 7,
                          Caller("ns", "01000000", True), 4, "inc-1", 6, "worker-1")


def _seg(tag: str) -> Segment:
    return Segment(f"dstl/node-a/{tag}.dstl", 0, len(tag), 1, 2, "node-a")


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
    def __init__(self, a, b):  # not a dstl_ray error: it comes back as a DstlError naming it
        super().__init__(f"{a}/{b}")
        self.lock = threading.Lock()


@pytest.fixture
def served() -> Iterator[tuple[LaneServer, _Loop, list]]:
    loop = _Loop()
    seen: list = []
    release = asyncio.Event()

    async def persist_many(requests):
        tags = [r.source for r in requests]
        seen.append(("persist_many", tags))
        if tags == ["hold"]:
            await release.wait()
        if tags == ["fail"]:
            raise PersistError("no space left")
        if tags == ["odd"]:
            raise _Unpicklable(1, 2)
        if tags == ["fenced"]:
            return [FencedError("job is fenced")]
        return [_seg(t) for t in tags]

    async def mark(job_id, source, checkpoint_id, caller=None, named=None):
        seen.append(("mark", job_id, source, checkpoint_id, named))

    async def persist_batch(requests, source, budget_s, sent_at):
        seen.append(("persist_batch", source, [r.source for r in requests]))
        return [_seg(r.source) for r in requests]

    # also on TCP (loopback), for the host lane's tests
    server = LaneServer("node-a", {"persist_many": persist_many, "mark": mark,
                                   "persist_batch": persist_batch}, tcp_host="127.0.0.1")
    loop.run(server.start())
    server.release = lambda: loop.loop.call_soon_threadsafe(release.set)  # type: ignore[attr-defined]
    yield server, loop, seen
    loop.run(server.close())
    loop.stop()


class _Node:
    """What Peers asks of a node actor handle: ``lane.remote()``."""

    def __init__(self, info):
        self.asked = 0

        async def remote():
            self.asked += 1
            return info

        self.lane = types.SimpleNamespace(remote=remote)
