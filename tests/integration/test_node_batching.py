"""Batching in one node actor (FLIP-158 "Implementation notes") on a real Ray cluster."""

from __future__ import annotations

import os
import time

import pytest
import ray

from dstl_ray import KeyGroupRange, PersistError, StateChangelogClient, key_group_range_for_subtask


def _dstl_files(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                  if f.endswith(".dstl"))


def test_eight_writers_one_file_per_checkpoint(tree_factory, namespace, tmp_path):
    # a long delay: the batch must go out because every registered writer is pending
    tree = tree_factory(base=f"file://{tmp_path}/dfs", persist_delay_s=5.0)
    client = StateChangelogClient("job8", namespace=namespace)
    writers = [client.create_writer(f"op{i}", key_group_range_for_subtask(64, 8, i))
               for i in range(8)]
    expected = [dict() for _ in writers]
    handles = []
    for cp in range(4):
        for i, w in enumerate(writers):
            for kg in w.key_group_range:
                v = f"cp{cp}-w{i}-kg{kg}".encode()
                w.append(kg, v)
                expected[i].setdefault(kg, []).append(v)
        t0 = time.monotonic()
        handles = [f.result(timeout=30) for f in [w.persist_durably(0) for w in writers]]
        assert time.monotonic() - t0 < 4.0, "batch waited for the delay"
        assert len(_dstl_files(tmp_path / "dfs")) == cp + 1  # exactly ONE new file
    for i, h in enumerate(handles):
        assert h.read_all() == expected[i]
        for kg in writers[i].key_group_range:
            assert list(h.get_state_changes(kg)) == expected[i][kg]
    root = [s for s in tree.status() if s["name"] == client.node_name][0]
    assert root["files_flushed"] == 4 and root["batches"] == 4 and root["requests"] == 32
    client.close()


def test_persist_delay_sends_a_partial_batch(tree_factory, namespace, tmp_path):
    tree_factory(base=f"file://{tmp_path}/dfs", persist_delay_s=0.3)
    client = StateChangelogClient("jobd", namespace=namespace)
    w1 = client.create_writer("a", KeyGroupRange(0, 0))
    client.create_writer("b", KeyGroupRange(0, 0))  # registered, never asks
    w1.append(0, b"x")
    t0 = time.monotonic()
    h = w1.persist_durably(0).result(timeout=30)
    elapsed = time.monotonic() - t0
    assert 0.25 <= elapsed < 5.0
    assert list(h.get_state_changes(0)) == [b"x"]


def test_size_threshold_sends_at_once(tree_factory, namespace, tmp_path):
    tree_factory(base=f"file://{tmp_path}/dfs", persist_delay_s=10.0,
                 persist_size_threshold=1000)
    client = StateChangelogClient("jobs", namespace=namespace)
    w1 = client.create_writer("a", KeyGroupRange(0, 0))
    client.create_writer("b", KeyGroupRange(0, 0))  # never asks: only size can trigger
    w1.append(0, b"x" * 2000)
    t0 = time.monotonic()
    h = w1.persist_durably(0).result(timeout=30)
    assert time.monotonic() - t0 < 5.0
    assert list(h.get_state_changes(0)) == [b"x" * 2000]


def test_node_actor_killed_fails_persist_and_next_checkpoint_succeeds(
        tree_factory, namespace, tmp_path):
    tree = tree_factory(base=f"file://{tmp_path}/dfs", persist_delay_s=2.0)
    client = StateChangelogClient("jobk", namespace=namespace)
    w1 = client.create_writer("a", KeyGroupRange(0, 1))
    client.create_writer("b", KeyGroupRange(0, 1))  # keeps the batch waiting
    w1.append(0, b"before-kill")
    fut = w1.persist_durably(0)
    time.sleep(0.3)
    ray.kill(tree.node(client.node_name), no_restart=False)  # Ray restarts it
    with pytest.raises(PersistError):
        fut.result(timeout=30)
    w1.append(1, b"after-kill")
    deadline = time.monotonic() + 60
    while True:
        try:
            h = w1.persist_durably(0).result(timeout=30)
            break
        except PersistError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert list(h.get_state_changes(0)) == [b"before-kill"]
    assert list(h.get_state_changes(1)) == [b"after-kill"]


def test_restarted_node_relearns_its_writers(tree_factory, namespace, tmp_path):
    """After Ray restarts a node actor, the writers' next requests register them again, so
    the all-pending trigger works without waiting for the persist delay."""
    tree = tree_factory(base=f"file://{tmp_path}/dfs", persist_delay_s=3.0)
    client = StateChangelogClient("jobr", namespace=namespace)
    writers = [client.create_writer(f"w{i}", KeyGroupRange(0, 0)) for i in range(3)]
    node = tree.node(client.node_name)
    before = ray.get(node.status.remote())
    assert before["writers"] == 3
    ray.kill(node, no_restart=False)

    def status():
        deadline = time.monotonic() + 60
        while True:  # until the new incarnation answers
            try:
                st = ray.get(node.status.remote(), timeout=10)
                if st["incarnation"] != before["incarnation"]:
                    return st
            except Exception:  # noqa: BLE001 - restarting
                pass
            assert time.monotonic() < deadline
            time.sleep(0.3)

    assert status()["writers"] == 0  # a fresh incarnation
    for w in writers:
        w.append(0, b"x")
    # the first checkpoint after the restart may wait for the delay (or fail over)...
    for w in writers:
        try:
            w.persist_durably(0).result(timeout=30)
        except PersistError:
            pass
    assert status()["writers"] == 3
    # ...the next one goes out as soon as every writer asked
    for w in writers:
        w.append(0, b"y")
    t0 = time.monotonic()
    handles = [f.result(timeout=30) for f in [w.persist_durably(0) for w in writers]]
    assert time.monotonic() - t0 < 2.5
    assert all(list(h.get_state_changes(0)) == [b"x", b"y"] for h in handles)


def test_unused_preemptive_upload_is_deleted_by_its_node(tree_factory, namespace, tmp_path):
    """A pre-emptive upload no checkpoint used is deleted by the node that wrote it once the
    writer truncates past it; uploads given out in handles stay."""
    tree_factory(base=f"file://{tmp_path}/dfs", persist_delay_s=0.01,
                 preemptive_persist_threshold=2000)
    client = StateChangelogClient("jobp", namespace=namespace)
    w = client.create_writer("op", KeyGroupRange(0, 0))
    w.append(0, b"a" * 3000)  # pre-emptive upload 1
    w.wait_uploads(30)
    h = w.persist_durably(0).result(timeout=30)  # reuses it: no new file
    assert len(_dstl_files(tmp_path / "dfs")) == 1 and w.preemptive_uploads == 1
    w.append(0, b"b" * 3000)  # pre-emptive upload 2: never used by a checkpoint
    w.wait_uploads(30)
    assert len(_dstl_files(tmp_path / "dfs")) == 2
    w.truncate(before=w.last_appended_sqn())
    deadline = time.monotonic() + 10
    while len(_dstl_files(tmp_path / "dfs")) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _dstl_files(tmp_path / "dfs")
    assert ["file://" + p for p in left] == h.file_paths()
