"""Retains and releases at the node actor that wrote a segment (dstl_ray.transport.retention),
Ray's calls injected: a retain a node may not have taken fails, a gone node's is skipped, a
release goes to the writing node in the background and never raises, and a late answer's
segments are released unused."""

from __future__ import annotations

import types
from typing import Any

import pytest
import ray

from dstl_ray.errors import HandleError, NamespaceError, NodeUnavailableError
from dstl_ray.format.segment import Segment
from dstl_ray.storage.deleter import Deleter
from dstl_ray.transport.retention import Retention

SEG = Segment("dstl/n/f.dstl", 16, 10, 1, 2, flushed_by="dstl-node-x")


class _Node:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.retain = types.SimpleNamespace(
            remote=lambda *a: self.calls.append(("retain", a)) or "ref")
        self.release = types.SimpleNamespace(
            remote=lambda *a: self.calls.append(("release", a)))


def _retention(node: Any, get: Any = lambda ref, timeout: ref) -> Retention:
    def find(name: str) -> Any:
        if node is None:
            raise ValueError(f"no actor {name}")
        return node

    return Retention("ns", "J", "caller", find_actor=find, get=get,
                     deleter=Deleter(workers=0))


def test_a_retain_goes_to_the_node_that_wrote_the_segment():
    node = _Node()
    _retention(node).retain(SEG, "w2", "inc-1")
    assert node.calls == [("retain", ("J", SEG.path, 16, "w2", "caller", "inc-1"))]


@pytest.mark.parametrize("error, fails", [
    (ray.exceptions.ActorUnavailableError("connection lost", None), NodeUnavailableError),
    (ray.exceptions.GetTimeoutError("slow"), NodeUnavailableError),
    (NamespaceError("not yours"), NamespaceError),
    (ray.exceptions.ActorDiedError(), None),  # restarted: it forgot its files
    # the node raised: alive, the retain not taken (Ray re-raises a remote HandleError as a
    # RayTaskError that is a ValueError too: once read as "no such actor", skipped)
    (ray.exceptions.RayTaskError("retain", "tb", HandleError("bad path")).as_instanceof_cause(),
     NodeUnavailableError),
    (HandleError("bad path"), NodeUnavailableError),
])
def test_what_a_failed_retain_means(error, fails):
    def get(ref: Any, timeout: float) -> Any:
        raise error

    r = _retention(_Node(), get)
    if fails is None:
        r.retain(SEG, "w2")
    else:
        with pytest.raises(fails):
            r.retain(SEG, "w2")


def test_a_retain_at_a_node_that_is_gone_is_skipped():
    _retention(None).retain(SEG, "w2")  # no actor of that name: never deletes


def test_a_release_reaches_the_writing_node_and_a_failure_is_swallowed():
    node = _Node()
    r = _retention(node)
    r.release(SEG, "w1", True, 7)
    assert node.calls == [("release", ("J", SEG.path, "w1", True, "caller", 16, 7))]
    _retention(None).release(SEG, "w1", False)  # (logged)
    assert r.flush(1.0)


def test_a_late_answers_segments_are_released_unused():
    node = _Node()
    r = _retention(node)
    r.release_unused("dstl-node-x", [("w1", SEG), ("w2", SEG)])
    assert r.released_unused == 2
    assert [c[1][2:4] for c in node.calls] == [("w1", False), ("w2", False)]
