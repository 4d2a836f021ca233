"""Dead writers' sections in merged changelog files (dstl_ray.node.dead_writers), without Ray:
records, the bound, fencing, the skip after a node restart, and a node's whole round."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
import uuid

import pytest

from dstl_ray import ChangelogConfig, DirectTransport, KeyGroupRange, PersistError
from dstl_ray.errors import FencedError
from dstl_ray.log.writer import StateChangelogWriter
from dstl_ray.merging.pool import UNKNOWN_USE
from dstl_ray.node import ChangelogNode
from dstl_ray.node import dead_writer_check as node_mod
from dstl_ray.node.dead_writers import RESTART_MARGIN_S, DeadWriters, bounds_of
from dstl_ray.transport.sender import Caller

ALIVE, DEAD = Caller("ns", "01000000", True), Caller("ns", "02000000", True)
ON = dict(file_merging="across_checkpoints", dead_writer_check_s=3600)


def test_records_fence_and_bounds():
    d = DeadWriters()
    d.registered("a", "J", DEAD, -1)
    d.reported("a", "J", DEAD, 7)
    d.registered("b", "J", DEAD, None)  # registered again without saying: unknown
    d.registered("c", "J", ALIVE, -1)
    assert d.candidates() == {"01000000", "02000000"}
    answer = d.fence(DEAD.ray_job)
    with pytest.raises(FencedError):
        d.check(DEAD)
    d.check(ALIVE)
    other = {"started": d.started, "records": {"a": ("J", 9, time.time())}}  # newer elsewhere
    bounds, skipped = bounds_of([answer, other])
    assert bounds == {"J": {"a": 9, "b": UNKNOWN_USE}} and skipped == 0
    d.forget(DEAD.ray_job, bounds)
    assert set(d.records) == {"c"}
    assert d.bounds_for("J") == {"a": 9, "b": UNKNOWN_USE}
    # a later round (one interrupted half-way) sees what this node applied already
    assert d.fence(DEAD.ray_job)["records"] == {"a": ("J", 9, float("inf")),
                                                "b": ("J", UNKNOWN_USE, float("inf"))}


def test_a_record_keeps_the_largest_named_and_unknown_for_good():
    d = DeadWriters()
    d.registered("a", "J", DEAD, -1)
    d.reported("a", "J", DEAD, 5)  # a mark
    d.reported("a", "J", DEAD, 4)  # a request queued before it, arriving after
    assert d.records["a"].bound == 5
    d.reported("a", "J", DEAD, UNKNOWN_USE)
    d.reported("a", "J", DEAD, 9)
    assert d.records["a"].bound == UNKNOWN_USE
    d.registered("b", "J", DEAD, None)  # registered again: unknown until it reports
    assert d.records["b"].bound == UNKNOWN_USE
    d.reported("b", "J", DEAD, 3)
    assert d.records["b"].bound == 3


def test_only_driver_processes_are_recorded():
    """A Ray actor or task may outlive its job (detached) or die before it: its job's death
    says nothing about it."""
    d = DeadWriters()
    d.registered("a", "J", Caller("ns", "03000000", False), -1)
    d.registered("b", "J", Caller("ns", "", True), -1)
    d.registered("c", "J", None, -1)
    assert d.records == {}


def test_a_log_is_kept_when_a_node_started_after_its_first_record():
    """A node restarted since may have lost the log's newest record: keep it for good."""
    old = {"started": 0.0, "records": {"a": ("J", 3, 1000.0)}}
    restarted = {"started": 1000.0 + RESTART_MARGIN_S / 2, "records": {}}
    assert bounds_of([old, restarted]) == ({"J": {"a": UNKNOWN_USE}}, 1)
    later = {"started": 1000.0 - 2 * RESTART_MARGIN_S, "records": {}}
    assert bounds_of([old, later]) == ({"J": {"a": 3}}, 0)


def test_a_nodes_round_fences_and_releases_its_merged_files(tmp_path, monkeypatch):
    node = ChangelogNode("n0", "root", f"file://{tmp_path}", ChangelogConfig(**ON))
    monkeypatch.setattr(node_mod, "list_node_actors", lambda ns: ["root"])
    dead_now: set[str] = set()
    monkeypatch.setattr(node_mod, "dead_ray_job_ids", lambda ids: dead_now & set(ids))

    async def run() -> str:
        assert await node.register_writer("dead", "J", DEAD, -1) is True
        await node.register_writer("live", "J", ALIVE, -1)
        await node.mark("J", "dead", 5, DEAD, named=5)
        dead_now.add(DEAD.ray_job)
        ff = node._flush.job_files("J")
        rel, base = await asyncio.to_thread(ff.append, b"x" * 64, [("dead", 0), ("dead", 32)])
        assert await node.release_dead_writers() == 1
        with pytest.raises(FencedError):  # the process (or a zombie of it) is refused
            await node.mark("J", "dead", 6, DEAD, named=6)
        await asyncio.to_thread(ff.subsumed, 4)
        assert os.path.exists(tmp_path / "J" / rel), "checkpoint 5 may still name it"
        await asyncio.to_thread(ff.subsumed, 5)
        assert await node.release_dead_writers() == 0  # nothing left to do
        return rel

    rel = asyncio.run(run())
    assert not os.path.exists(tmp_path / "J" / rel)
    st = node._dead
    assert st.released == 1 and "dead" not in st.records and "live" in st.records


def test_an_unreachable_node_puts_the_round_off_until_it_reaches_every_node(tmp_path,
                                                                           monkeypatch):
    node = ChangelogNode("n0", "root", f"file://{tmp_path}", ChangelogConfig(**ON))
    dead_now: set[str] = set()
    monkeypatch.setattr(node_mod, "dead_ray_job_ids", lambda ids: dead_now & set(ids))

    def no_actor(name):
        raise ValueError(f"no actor {name}")

    monkeypatch.setattr(node._peers, "actor", no_actor)

    names = ["root", "gone"]
    monkeypatch.setattr(node_mod, "list_node_actors", lambda ns: list(names))

    async def run() -> tuple[int, int]:
        await node.register_writer("dead", "J", DEAD, -1)
        dead_now.add(DEAD.ray_job)
        first = await node.release_dead_writers()
        assert "dead" in node._dead.records and node.counters.dead_writer_rounds_failed == 1
        names.remove("gone")  # the node left the tree: the next round reaches every node
        return first, await node.release_dead_writers()

    # the first round fenced the Ray job here, then failed: it is tried again (before, a
    # fenced Ray job was no candidate any more, and its sections stayed for good)
    assert asyncio.run(run()) == (0, 1)
    assert "dead" not in node._dead.records


class _Marking(DirectTransport):
    """Writes directly, but takes marks like a tree that merges changelog files."""

    acked_marks = True

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.marks: list[tuple[str, int, int]] = []
        self.pending: concurrent.futures.Future = concurrent.futures.Future()

    def mark(self, log_id, checkpoint_id, named=None):
        self.marks.append((log_id, checkpoint_id, named))
        return self.pending


def test_a_handle_goes_out_only_after_the_node_took_the_mark():
    t = _Marking("job", f"memory://d-{uuid.uuid4().hex}")
    w = StateChangelogWriter(t, "job", "op", KeyGroupRange(0, 0))
    w.append(0, b"a")
    w.persist_durably(0, checkpoint_id=1).result(timeout=10)  # a request: no mark
    fut = w.persist_durably(0, checkpoint_id=2)  # nothing new: a mark, awaited
    assert t.marks == [(w.log_id, 2, 2)]
    time.sleep(0.2)
    assert not fut.done(), "the handle must wait for the mark"
    t.pending.set_result(None)
    assert fut.result(timeout=10).sqn_to == 1
    t.pending = concurrent.futures.Future()
    fut = w.persist_durably(0)  # no checkpoint id: the node must learn "unknown" too
    assert t.marks[-1] == (w.log_id, -1, UNKNOWN_USE)
    t.pending.set_exception(PersistError("node gone"))
    with pytest.raises(PersistError):
        fut.result(timeout=10)


@pytest.mark.parametrize("options, on", [
    (dict(file_merging="across_checkpoints"), True),  # on by default with merged files
    (dict(file_merging="across_checkpoints", dead_writer_check_s=0), False),
    (dict(), False),  # without merged files a writer's file goes with its own release
])
def test_records_are_kept_only_where_dead_writers_are_checked(tmp_path, monkeypatch, options,
                                                              on):
    monkeypatch.setattr(node_mod, "dead_ray_job_ids", lambda ids: set())
    node = ChangelogNode("n0", "root", f"file://{tmp_path}", ChangelogConfig(**options))

    async def run() -> bool:
        merged = await node.register_writer("w", "J", DEAD, -1)
        await node.mark("J", "w", 1, DEAD, named=1)
        if node._dead_writers._watch is not None:
            node._dead_writers._watch.cancel()
        return merged

    assert asyncio.run(run()) is on
    assert (node._dead.records["w"].bound == 1) if on else node._dead.records == {}


def test_a_second_round_with_a_higher_bound_raises_last_use(tmp_path):
    """Rounds may interleave (two nodes) or repeat after a half-way failure: a flush released
    at a lower bound gets the higher one."""
    from dstl_ray.merging.pool import FileMergingOptions
    from dstl_ray.merging.segments import FlushFiles
    from dstl_ray.storage.local import LocalStorage

    ff = FlushFiles(LocalStorage(fsync=False), f"file://{tmp_path}/job", "segments/n",
                    FileMergingOptions("across_checkpoints", max_file_size=1 << 20,
                                       max_space_amplification=1e6))
    rel, _ = ff.append(b"x" * 10, [("dead", 0)])
    ff.forget("dead", 3)
    ff.forget("dead", 9)
    ff.subsumed(5)
    assert os.path.exists(tmp_path / "job" / rel), "checkpoint 9 may name it"
    ff.subsumed(9)
    assert not os.path.exists(tmp_path / "job" / rel)


def test_a_fenced_jobs_actors_are_not_refused():
    """A detached actor of a dead driver's Ray job lives on: only the driver is fenced."""
    d = DeadWriters()
    d.fence(DEAD.ray_job)
    with pytest.raises(FencedError):
        d.check(DEAD)
    d.check(Caller("ns", DEAD.ray_job, False))


def test_a_node_that_missed_the_fence_looks_a_new_driver_up_first(tmp_path, monkeypatch):
    """A node restarted by Ray (or joining after a round) never got the fence: a process Ray
    took for dead must not register, persist or mark there."""
    node = ChangelogNode("n0", "root", f"file://{tmp_path}", ChangelogConfig(**ON))
    lookups: list[set[str]] = []

    def table(ids):
        lookups.append(set(ids))
        return {DEAD.ray_job} & set(ids)

    monkeypatch.setattr(node_mod, "dead_ray_job_ids", table)

    async def run() -> None:
        with pytest.raises(FencedError):
            await node.register_writer("z", "J", DEAD, None)
        with pytest.raises(FencedError):
            await node.mark("J", "z", 7, DEAD, named=7)
        await node.register_writer("a", "J", ALIVE, -1)
        await node.mark("J", "a", 1, ALIVE, named=1)  # looked up once only

    asyncio.run(run())
    assert lookups == [{DEAD.ray_job}, {ALIVE.ray_job}]


def test_a_stale_record_is_raised_to_the_newest_checkpoint_any_node_saw():
    """The writer moved to another node (its node failed) and named checkpoint 9 there; that
    node then left the tree with the newest record. The old record says 5: a bound of 5 would
    free sections checkpoint 9 names. Any node that saw checkpoint 9 of the job (another
    writer's request or mark) raises the bound: no checkpoint newer than any node saw can
    name a fenced writer's section."""
    old = DeadWriters()
    old.registered("a", "J", DEAD, -1)
    old.reported("a", "J", DEAD, 5)
    old.saw("J", 5)
    root = DeadWriters()
    root.saw("J", 9)  # the job's newest checkpoint, seen in another writer's request
    root.saw("K", 12)  # another job's checkpoints say nothing about J
    root.registered("b", "K", DEAD, -1)
    root.reported("b", "K", DEAD, UNKNOWN_USE)
    bounds, skipped = bounds_of([old.fence(DEAD.ray_job), root.fence(DEAD.ray_job)])
    assert bounds == {"J": {"a": 9}, "K": {"b": UNKNOWN_USE}} and skipped == 0


def test_a_round_bounds_by_the_newest_checkpoint_the_node_saw(tmp_path, monkeypatch):
    """Node-level: the dead writer's own record says 5, the job went on to checkpoint 9
    (another writer's mark here): its section stays until checkpoint 9 is subsumed."""
    node = ChangelogNode("n0", "root", f"file://{tmp_path}", ChangelogConfig(**ON))
    monkeypatch.setattr(node_mod, "list_node_actors", lambda ns: ["root"])
    dead_now: set[str] = set()
    monkeypatch.setattr(node_mod, "dead_ray_job_ids", lambda ids: dead_now & set(ids))

    async def run() -> tuple[str, bool]:
        await node.register_writer("dead", "J", DEAD, -1)
        await node.mark("J", "dead", 5, DEAD, named=5)
        await node.register_writer("live", "J", ALIVE, -1)
        await node.mark("J", "live", 9, ALIVE, named=9)
        dead_now.add(DEAD.ray_job)
        ff = node._flush.job_files("J")
        rel, _ = await asyncio.to_thread(ff.append, b"x" * 16, [("dead", 0)])
        assert await node.release_dead_writers() == 1
        await asyncio.to_thread(ff.subsumed, 8)
        kept = os.path.exists(tmp_path / "J" / rel)
        await asyncio.to_thread(ff.subsumed, 9)
        return rel, kept

    rel, kept = asyncio.run(run())
    assert kept, "checkpoint 9 may name the dead writer's section"
    assert not os.path.exists(tmp_path / "J" / rel)


def test_fenced_ray_jobs_are_bounded(monkeypatch):
    from dstl_ray.node import dead_writers

    monkeypatch.setattr(dead_writers, "FENCED_MAX", 3)
    d = DeadWriters()
    for i in range(5):
        d.fence(f"0{i}000000")
    assert list(d.fenced) == ["02000000", "03000000", "04000000"]  # the oldest went


def test_bounds_of_a_job_never_served_here_are_dropped(tmp_path):
    """A round sends every log's bounds to every node; a node that never saw the job keeps
    them only until its idle-job sweep, and one that serves the job keeps them."""
    node = ChangelogNode("n0", "root", f"file://{tmp_path}", ChangelogConfig(**ON))

    async def run() -> None:
        await node.register_writer("w", "J", ALIVE, -1)
        await node.forget_logs(DEAD.ray_job, {"J": {"a": 3}, "K": {"b": 4}})
        node._jobs.forget_idle()

    asyncio.run(run())
    assert set(node._dead.dead_logs) == {"J"} and node._dead.bounds_for("J") == {"a": 3}


@pytest.mark.parametrize("error, fails", [("unavailable", True), ("died", False)])
def test_a_retain_the_flushing_node_may_not_have_taken_fails_the_restore(monkeypatch, error,
                                                                        fails):
    """A restored writer names the dead writer's sections: its node must know before a
    release round frees them. A node that is alive but unreachable (ActorUnavailableError)
    fails the restore, to be retried; a dead or restarted one forgot its files and never
    deletes them. Before, both were ignored: the dead writer's sections could be freed
    while the restored writer's checkpoints named them."""
    import ray

    from dstl_ray.errors import NodeUnavailableError
    from dstl_ray.format.segment import Segment
    from dstl_ray.transport.retention import Retention

    t = Retention("ns", "J", None)

    class Node:
        class retain:  # noqa: N801 - a Ray actor method
            @staticmethod
            def remote(*args):
                return "ref"

    def get(ref, timeout=None):
        if error == "unavailable":
            raise ray.exceptions.ActorUnavailableError("connection lost", None)
        raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: Node)
    monkeypatch.setattr(ray, "get", get)
    seg = Segment("segments/n/f.dstl", 0, 10, 1, 2, flushed_by="dstl-node-x")
    if fails:
        with pytest.raises(NodeUnavailableError, match="names segments/n/f.dstl"):
            t.retain(seg, "w2")
    else:
        t.retain(seg, "w2")


def test_a_new_drivers_calls_share_one_job_table_look_up(tmp_path, monkeypatch):
    """Many requests of a process first seen here (a persist_many) wait for one look-up of
    its Ray job, not one each."""
    node = ChangelogNode("n0", "root", f"file://{tmp_path}", ChangelogConfig(**ON))
    lookups: list[set[str]] = []

    def table(ids):
        lookups.append(set(ids))
        time.sleep(0.2)
        return set()

    monkeypatch.setattr(node_mod, "dead_ray_job_ids", table)

    async def run() -> None:
        await asyncio.gather(*(node.mark("J", f"w{i}", 1, ALIVE) for i in range(20)))

    asyncio.run(run())
    assert lookups == [{ALIVE.ray_job}]


def test_a_fenced_drivers_forwarded_requests_are_refused(tmp_path, monkeypatch):
    """A parent that missed the round's fence (restarted since) looks the forwarded
    request's driver up too: its sections would never be released."""
    from dstl_ray.format.changelog import Changeset, encode_section
    from dstl_ray.transport.base import PersistRequest

    node = ChangelogNode("n0", "root", f"file://{tmp_path}", ChangelogConfig(**ON))
    monkeypatch.setattr(node_mod, "dead_ray_job_ids", lambda ids: {DEAD.ray_job} & set(ids))
    sec = encode_section(uuid.uuid4().bytes, [Changeset(1, ((0, b"x"),))])
    req = PersistRequest("J", sec, "child", caller=DEAD, checkpoint_id=1)

    async def run() -> list:
        return await node.persist_batch([req], "child", None, None)

    (res,) = asyncio.run(run())
    assert isinstance(res, FencedError)
