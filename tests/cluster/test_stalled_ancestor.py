"""A stalled (paused) ancestor: requests carry a deadline that every level honours, so one
level flushes the batch (not every level at once), and the ancestor, once it runs again,
writes nothing for a batch its child gave up on."""

from __future__ import annotations

import os
import signal
import time

import ray

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
