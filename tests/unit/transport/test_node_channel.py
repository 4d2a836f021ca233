"""A writer's calls to its node actor (dstl_ray.transport.node_channel), the lane and Ray
injected: over the lane when there is one; a lane found closed sent nothing, so the call goes
by Ray and the node is found again before the next one."""

from __future__ import annotations

import concurrent.futures
import types
from typing import Any

from dstl_ray.transport.lane import LaneClosedError
from dstl_ray.transport.node_channel import NodeChannel
from dstl_ray.transport.node_lookup import NodeLookup


class _Lanes:
    def __init__(self, lane: Any) -> None:
        self.lane = lane
        self.refreshed: list[tuple[str, Any, Any]] = []
        self.closed = False

    def refresh(self, node: str, handle: Any, ask: Any) -> None:
        self.refreshed.append((node, handle, ask()))

    def discard(self, lane: Any) -> None:
        if self.lane is lane:
            self.lane = None

    def close(self) -> None:
        self.closed = True


class _Lane:
    def __init__(self, closed: bool = False) -> None:
        self.closed = closed
        self.calls: list[tuple[str, tuple[Any, ...], float | None]] = []

    def call(self, method: str, *args: Any, deadline: float | None = None) -> Any:
        if self.closed:
            raise LaneClosedError("closed")
        self.calls.append((method, args, deadline))
        return "by lane"


class _Handle:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result("by ray")
        self.mark = types.SimpleNamespace(remote=lambda *a: self._ref("mark", a, done))
        self.lane = types.SimpleNamespace(remote=lambda: {"path": "p"})

    def _ref(self, method: str, args: tuple[Any, ...], done: Any) -> Any:
        self.calls.append((method, args))
        return types.SimpleNamespace(future=lambda: done)


def _channel(lane: Any) -> tuple[NodeChannel, NodeLookup, _Lanes, _Handle]:
    handle = _Handle()
    lookup = NodeLookup("J", None, lambda: ("n", handle, "pinned"),
                        get=lambda ref, timeout: ref)
    lanes = _Lanes(lane)
    channel = NodeChannel(lookup, lambda *a: None, get=lambda ref, timeout: ref, lanes=lanes)
    lookup.connect()
    return channel, lookup, lanes, handle


def test_a_call_goes_over_the_lane_when_there_is_one():
    lane = _Lane()
    channel, lookup, _, handle = _channel(lane)
    assert channel.call("mark", "J", "w1", 3, deadline=12.5) == "by lane"
    assert lane.calls == [("mark", ("J", "w1", 3), 12.5)] and handle.calls == []
    assert not lookup.stale


def test_a_closed_lane_sends_nothing_the_call_goes_by_ray_and_the_node_is_found_again():
    lane = _Lane(closed=True)
    channel, lookup, lanes, handle = _channel(lane)
    assert channel.call("mark", "J", "w1", 3).result() == "by ray"
    assert handle.calls == [("mark", ("J", "w1", 3))] and lanes.lane is None
    assert lookup.stale
    channel.call("mark", "J", "w1", 4)  # finds the node again first
    assert not lookup.stale


def test_without_a_lane_calls_go_by_ray():
    channel, _, _, handle = _channel(None)
    assert channel.call("mark", "J", "w1", 3).result() == "by ray"
    assert channel.lane is None


def test_refresh_asks_the_node_for_its_lane_and_close_closes_it():
    channel, _, lanes, handle = _channel(None)
    channel.refresh(handle)
    assert lanes.refreshed == [("n", handle, {"path": "p"})]
    channel.close()
    assert lanes.closed
