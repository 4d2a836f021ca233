"""Finding a writer process's node actor (dstl_ray.transport.node_lookup), Ray's calls
injected: a restarting actor is waited for, a lookup marked stale finds the node again and
registers the process's writers there first, a failed registration is retried once after
finding the node again, and a refusal is not retried."""

from __future__ import annotations

import types
from typing import Any

import pytest
import ray

from dstl_ray.errors import FencedError, NamespaceError, NodeUnavailableError
from dstl_ray.transport.node_lookup import NodeLookup, get_while_restarting


class _Node:
    """A node actor's handle: ``remote()`` answers at once (a ref that is its value)."""

    def __init__(self, name: str, fail: list[BaseException] | None = None) -> None:
        self.name = name
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail = fail or []  # register_writer raises these first, one a call

        def register_writer(*args: Any) -> Any:
            self.calls.append(("register_writer", args))
            if self.fail:
                raise self.fail.pop(0)
            return False

        self.register_writer = types.SimpleNamespace(remote=register_writer)
        self.unregister_writer = types.SimpleNamespace(
            remote=lambda *a: self.calls.append(("unregister_writer", a)))


def _get(ref: Any, timeout: float) -> Any:
    return ref


class _Resolver:
    """The node by name, a new incarnation each time (as Ray restarts it)."""

    def __init__(self, *nodes: _Node) -> None:
        self.nodes = list(nodes)
        self.calls = 0

    def __call__(self) -> tuple[str, Any, str]:
        node = self.nodes[min(self.calls, len(self.nodes) - 1)]
        self.calls += 1
        return node.name, node, "pinned"


def test_get_while_restarting_calls_again_until_the_actor_is_back():
    errors = [ray.exceptions.ActorUnavailableError("restarting", None)] * 3
    calls: list[int] = []

    def get(ref: Any, timeout: float) -> Any:
        if errors:
            raise errors.pop()
        return ref

    assert get_while_restarting(lambda: calls.append(1) or "info", get=get,
                                sleep=lambda s: None) == "info"
    assert len(calls) == 4


def test_get_while_restarting_gives_up_at_the_timeout_with_the_last_error():
    def get(ref: Any, timeout: float) -> Any:
        raise ray.exceptions.ActorUnavailableError("still restarting", None)

    with pytest.raises(ray.exceptions.ActorUnavailableError, match="still restarting"):
        get_while_restarting(lambda: "ref", timeout=0.0, get=get, sleep=lambda s: None)


def test_get_while_restarting_does_not_wait_out_another_error():
    def get(ref: Any, timeout: float) -> Any:
        raise ray.exceptions.ActorDiedError()

    with pytest.raises(ray.exceptions.ActorDiedError):
        get_while_restarting(lambda: "ref", get=get, sleep=lambda s: pytest.fail("waited"))


def test_a_stale_lookup_finds_the_node_again_and_registers_the_writers_there_first():
    old, new = _Node("n"), _Node("n")
    found: list[Any] = []
    lookup = NodeLookup("J", "caller", _Resolver(old, new), get=_get, found=found.append)
    assert lookup.connect() is old and lookup.node_name == "n" and not lookup.stale
    lookup.register("w1")
    lookup.register("w2")
    assert lookup.current() is old and found == []  # not stale: nothing asked again
    lookup.mark_stale()
    assert lookup.stale
    assert lookup.current() is new and found == [new] and not lookup.stale
    assert new.calls == [("register_writer", ("w1", "J", "caller")),
                         ("register_writer", ("w2", "J", "caller"))]


def test_writers_are_registered_again_at_once_under_one_deadline():
    """A stalled node costs the sender one wait for all its writers, not one per writer."""
    waits: list[Any] = []

    def get(ref: Any, timeout: float) -> Any:
        waits.append((ref, timeout))
        return ref

    old, new = _Node("n"), _Node("n")
    lookup = NodeLookup("J", None, _Resolver(old, new), get=get)
    lookup.connect()
    for w in ("w1", "w2", "w3"):
        lookup.register(w)
    waits.clear()
    lookup.mark_stale()
    assert lookup.current() is new
    assert len(waits) == 1 and len(waits[0][0]) == 3 and waits[0][1] == 60.0


def test_a_registration_that_fails_finds_the_node_again_and_tries_once_more():
    first = _Node("n", fail=[ray.exceptions.ActorDiedError()])
    second = _Node("n")
    lookup = NodeLookup("J", None, _Resolver(first, second), get=_get)
    lookup.connect()
    lookup.register("w1")
    assert [c[1][0] for c in second.calls] == ["w1"]  # once: the old node never took it


def test_a_registration_failing_twice_names_the_writer_and_the_node():
    node = _Node("dstl-node-x", fail=[ray.exceptions.ActorDiedError(),
                                      ray.exceptions.GetTimeoutError("stalled")])
    lookup = NodeLookup("J", None, _Resolver(node), get=_get)
    lookup.connect()
    with pytest.raises(NodeUnavailableError, match="writer w1 with node actor dstl-node-x"):
        lookup.register("w1")
    lookup.mark_stale()
    lookup.current()
    assert len(node.calls) == 2  # the writer that was refused is not registered again


@pytest.mark.parametrize("refusal", [NamespaceError("other namespace"),
                                     FencedError("fenced")])
def test_a_refusal_is_not_retried(refusal):
    node = _Node("n", fail=[refusal])
    lookup = NodeLookup("J", None, _Resolver(node), get=_get)
    lookup.connect()
    with pytest.raises(type(refusal)):
        lookup.register("w1")
    assert len(node.calls) == 1 and not lookup.stale


def test_the_node_saying_it_merges_files_is_remembered():
    node = _Node("n")
    node.register_writer = types.SimpleNamespace(remote=lambda *a: True)
    lookup = NodeLookup("J", None, _Resolver(node), get=_get)
    lookup.connect()
    assert not lookup.merges
    lookup.register("w1")
    assert lookup.merges


def test_unregister_forgets_the_writer_and_survives_a_dead_node():
    node = _Node("n")
    lookup = NodeLookup("J", None, _Resolver(node), get=_get)
    lookup.connect()
    lookup.register("w1")
    lookup.unregister("w1")
    assert node.calls[-1] == ("unregister_writer", ("w1", None))
    node.unregister_writer = types.SimpleNamespace(remote=lambda *a: 1 / 0)
    lookup.unregister("w1")  # best effort: no error
    lookup.mark_stale()
    lookup.current()
    assert [c for c in node.calls if c[0] == "register_writer"] == [
        ("register_writer", ("w1", "J", None, -1))]


def test_a_registration_while_the_node_restarts_waits_for_it():
    """A client made right after its node was killed: its first calls may find the actor
    restarting. Before, the registration tried twice at once and failed."""
    node = _Node("n", fail=[ray.exceptions.ActorUnavailableError("restarting", None)] * 3)
    lookup = NodeLookup("J", None, _Resolver(node), get=_get)
    lookup.connect()
    lookup.register("w1")
    assert len(node.calls) == 4 and not lookup.stale


def test_a_failed_re_registration_leaves_the_lookup_stale():
    """Found again, but the node did not take the writers: asked again next time, never
    used as if it knew them."""
    node = _Node("n")
    lookup = NodeLookup("J", None, _Resolver(node), get=_get)
    lookup.connect()
    lookup.register("w1")
    lookup.mark_stale()
    node.fail = [ray.exceptions.ActorDiedError()]
    with pytest.raises(ray.exceptions.ActorDiedError):
        lookup.current()
    assert lookup.stale
    assert lookup.current() is node and not lookup.stale
