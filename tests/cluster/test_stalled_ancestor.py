"""A stalled (paused) ancestor: requests carry a deadline that every level honours, so one
level flushes the batch (not every level at once), and the ancestor, once it runs again,
writes nothing for a batch its child gave up on."""

from __future__ import annotations

import os
import signal
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from experiments.workload import place_writers, verify

from .test_tree import by_name, dstl_files


def test_a_stalled_root_costs_one_file_and_writes_nothing_late(tree_factory, namespace,
                                                              tmp_path):
    tree = tree_factory(base=f"file://{tmp_path}/dfs", branching_factor=2,
                        persist_delay_s=0.01, upload_timeout_s=0.5, max_attempts=2,
                        retry_delay_s=0.1, flush_bytes=1 << 20)
    st = by_name(tree)
    leaf = next(s for s in st.values() if s["level"] == 2)
    root_pid = st[tree.root]["pid"]
    actors = place_writers("stall", namespace, [leaf["node_id"]], per_node=2)
    os.kill(root_pid, signal.SIGSTOP)
    try:
        r = ray.get(actors[0].checkpoint.remote(20, 100), timeout=90)
        assert r["ok"], r
        assert len(dstl_files(tmp_path / "dfs")) == 1, "one level flushed it, not every level"
    finally:
        os.kill(root_pid, signal.SIGCONT)
    named = {seg.split("/")[-1] for h in r["handles"] for seg in _paths(h)}
    deadline = time.monotonic() + 15
    while True:  # the root works off the stale batch: nothing new may stay
        on_disk = {p.split("/")[-1] for p in dstl_files(tmp_path / "dfs")}
        if on_disk == named or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert on_disk == named
    deadline = time.monotonic() + 20
    while by_name(tree)[tree.root]["requests_from_children"] == 0:
        assert time.monotonic() < deadline, "the stale batch never reached the root"
        time.sleep(0.2)
    root = by_name(tree)[tree.root]
    assert root["deadline_expired"] >= 1 and root["files_flushed"] == 0, root
    assert {p.split("/")[-1] for p in dstl_files(tmp_path / "dfs")} == named
    assert verify(actors, [r["handles"]]) == 2 * 20


def _paths(handle_json: str) -> list[str]:
    from dstl_ray import StateChangelogHandle

    return [s.path for s in StateChangelogHandle.from_json(handle_json).segments]


STALL_S = 12.0  # longer than the old lane send timeout in effect (5 s documented, ~10 s)


def test_a_parent_stalled_over_its_lane_is_late_not_skipped(tree_factory, namespace, tmp_path):
    """A leaf forwards a batch larger than the socket's buffers over its lane to a parent
    stopped (SIGSTOP) for longer than the lane's old send timeout. Before the fix the send
    timed out, the lane broke and failed the forward, so the leaf flushed the batch itself
    (forward_failures 1) while the parent, resumed, executed what it had read and dropped
    the answer. Now the batch goes up late, within its deadline: no failure, no new lane,
    and the job directory holds only the files the handles name."""
    tree = tree_factory(base=f"file://{tmp_path}/dfs", branching_factor=2,
                        persist_delay_s=0.01, upload_timeout_s=5.0, max_attempts=2,
                        retry_delay_s=0.1, flush_bytes=64 << 20)
    st = by_name(tree)
    leaf = next(s for s in st.values() if s["level"] == 2)
    parent = st[leaf["parent"]]
    actors = place_writers("lanestall", namespace, [leaf["node_id"]], per_node=2)
    for _ in range(3):  # the first forward goes by Ray and opens the lane
        assert ray.get(actors[0].checkpoint.remote(5, 100), timeout=60)["ok"]
    before = by_name(tree)
    assert before[leaf["name"]]["forwards_by_lane"] > 0, before[leaf["name"]]
    os.kill(parent["pid"], signal.SIGSTOP)
    try:
        pending = actors[0].checkpoint.remote(8, 512 << 10)  # 8 MiB per checkpoint
        time.sleep(STALL_S)
    finally:
        os.kill(parent["pid"], signal.SIGCONT)
    r = ray.get(pending, timeout=120)
    assert r["ok"], r
    assert r["latency_ms"] > (STALL_S - 1) * 1000, "it waited for the stalled parent"
    after = by_name(tree)
    lf, pa = after[leaf["name"]], after[parent["name"]]
    assert lf["forward_failures"] == before[leaf["name"]]["forward_failures"] == 0, lf
    assert lf["forwards_by_lane"] > before[leaf["name"]]["forwards_by_lane"], lf
    assert pa["lane"]["connections"] == before[parent["name"]]["lane"]["connections"], pa
    assert lf["lane"]["cut"] == 0 and pa["lane"]["cut"] == 0
    _no_leak(tmp_path, r)
    assert verify(actors, [r["handles"]]) == 2 * (3 * 5 + 8)


def test_a_writers_node_stalled_over_its_lane_is_late_not_declined(tree_factory, namespace,
                                                                  tmp_path):
    """Two persist calls of one writer process over its lane to its node actor, stopped
    (SIGSTOP) for longer than the lane's old send timeout: a small one the node took, then
    one larger than the socket's buffers. Before the fix the second send timed out and the
    lane broke, failing the first call (its checkpoint declined where a Ray call would only
    have been late). Now both complete, late, and nothing leaks."""
    tree = tree_factory(base=f"file://{tmp_path}/dfs", branching_factor=2,
                        persist_delay_s=0.01, upload_timeout_s=5.0, max_attempts=2,
                        retry_delay_s=0.1, flush_bytes=64 << 20)
    st = by_name(tree)
    node = st[tree.root]
    helper = _TwoCalls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node["node_id"], soft=False)).remote(namespace)
    assert ray.get(helper.warm.remote(), timeout=60)  # the lane is open
    os.kill(node["pid"], signal.SIGSTOP)
    try:
        pending = helper.two_calls.remote(8 << 20)
        time.sleep(STALL_S)
    finally:
        os.kill(node["pid"], signal.SIGCONT)
    out = ray.get(pending, timeout=120)
    assert out["errors"] == [], out
    assert out["lane_closed"] is None, out
    named = set(out["files"])
    deadline = time.monotonic() + 15
    while {p.split("/")[-1] for p in dstl_files(tmp_path / "dfs")} != named:
        assert time.monotonic() < deadline, (dstl_files(tmp_path / "dfs"), named)
        time.sleep(0.2)
    ray.get(helper.close.remote(), timeout=30)


@ray.remote(num_cpus=0)
class _TwoCalls:
    """A writer process with two writers whose persist calls go out one after the other."""

    def __init__(self, namespace: str) -> None:
        from dstl_ray import StateChangelogClient, key_group_range_for_subtask

        self.client = StateChangelogClient("twocalls", namespace=namespace)
        self.writers = [self.client.create_writer(
            f"op-{i}", key_group_range_for_subtask(128, 2, i)) for i in range(2)]

    def warm(self) -> bool:
        for w in self.writers:
            w.append(w.key_group_range.start, b"warm")
            w.persist_durably(0).result(timeout=30)
        return self.client.transport.lane is not None

    def two_calls(self, big: int) -> dict:
        small, large = self.writers
        small.append(small.key_group_range.start, b"small")
        first = small.persist_durably(0)
        time.sleep(1.0)  # the small call is on the node's side of the socket
        large.append(large.key_group_range.start, os.urandom(big))
        second = large.persist_durably(0)
        errors, files = [], []
        for f in (first, second):
            try:
                files += [s.path.split("/")[-1] for s in f.result(timeout=110).segments]
            except Exception as e:  # noqa: BLE001 - reported to the test
                errors.append(f"{type(e).__name__}: {e}")
        lane = self.client.transport.lane
        return {"errors": errors, "files": files,
                "lane_closed": None if lane is None or lane.closed is None
                else str(lane.closed)}

    def close(self) -> None:
        self.client.close()


def _no_leak(tmp_path, r) -> None:
    named = {seg.split("/")[-1] for h in r["handles"] for seg in _paths(h)}
    deadline = time.monotonic() + 15
    while True:  # late answers are released: only what the handles name may stay
        on_disk = {p.split("/")[-1] for p in dstl_files(tmp_path / "dfs")}
        if on_disk == named or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert on_disk == named
