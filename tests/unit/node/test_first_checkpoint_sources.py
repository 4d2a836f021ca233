"""Before a job's first checkpoint at a node, a batch waits for the sources registered for
that job (issue 16 item 11); only for the first: a registered source that never sends must
not hold every later checkpoint up to persist_max_wait_s."""

from __future__ import annotations

import asyncio

from dstl_ray import ChangelogConfig
from dstl_ray.node import ChangelogNode
from dstl_ray.transport.sender import Caller

C = Caller("ns")


def _node(tmp_path) -> ChangelogNode:
    return ChangelogNode("n0", "root", f"file://{tmp_path}", ChangelogConfig())


def test_only_the_first_checkpoint_waits_for_registered_sources(tmp_path):
    node = _node(tmp_path)

    async def run() -> None:
        for log in ("a", "b", "x"):  # x registers and never sends
            await node.register_writer(log, "J", C)
        await node.register_writer("o", "other", C)
        await node.register_source("child", ["J"])
        await node.register_source("child2", ["other"])
        await node.mark("J", "a", 0, C)
        assert node._batching.late_for("J", 0) == {"b", "x", "child"}
        await node.mark("J", "b", 0, C)
        await node.mark("J", "child", 0, C)
        assert node._batching.late_for("J", 0) == {"x"}
        for log in ("a", "b", "child"):
            await node.mark("J", log, 1, C)
        assert node._batching.late_for("J", 1) == set()  # x is not waited for again
        await node.mark("J", "a", 2, C)
        assert node._batching.late_for("J", 2) == {"b", "child"}  # those of checkpoint 1

    asyncio.run(run())


def test_a_childs_jobs_are_learned_from_its_requests_too(tmp_path):
    """A parent restarted (or that dropped the child as idle) learns the child's jobs from
    what it sends, not only from its registration."""
    node = _node(tmp_path)

    async def run() -> None:
        await node.register_source("child")  # no job list: an older child, a lost one
        assert node._sources.child_jobs.get("child", frozenset()) == frozenset()
        await node.mark("J", "child", 0, C)
        assert node._sources.child_jobs["child"] == {"J"}

    asyncio.run(run())
