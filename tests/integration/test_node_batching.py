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
    for f in [w.persist_durably(0) for w in writers]:
        try:
            f.result(timeout=30)
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


def test_dead_writer_is_no_longer_waited_for(tree_factory, namespace, tmp_path):
    """A writer process that dies never unregisters. After one delay-triggered batch the node
    drops sources silent for ``source_idle_s``; the next batch goes out as soon as every
    live writer asked, and a dropped writer that speaks again is counted again."""
    # a source counts as idle after max(source_idle_s, 4 delays); a node's delay is
    # persist_delay_s * (1 + height) <= 0.5 s on the session's 5-node tree: <= 2 s of silence
    tree = tree_factory(base=f"file://{tmp_path}/dfs", persist_delay_s=0.25, source_idle_s=0.5)
    client = StateChangelogClient("jobi", namespace=namespace)
    live = [client.create_writer(f"w{i}", KeyGroupRange(0, 0)) for i in range(2)]
    ghost = client.create_writer("ghost", KeyGroupRange(0, 0))  # "its process died"
    node = tree.node(client.node_name)
    time.sleep(2.2)  # the ghost is silent for longer than that

    def checkpoint(writers, value):
        for w in writers:
            w.append(0, value)
        t0 = time.monotonic()
        handles = [f.result(timeout=30) for f in [w.persist_durably(0) for w in writers]]
        return time.monotonic() - t0, handles

    assert checkpoint(live, b"a")[0] >= 0.2  # waited for the ghost: the delay sent it
    st = ray.get(node.status.remote())
    assert st["idle_sources_dropped"] == 1 and st["batch_triggers"]["delay"] == 1
    assert st["writers"] == 2
    checkpoint(live, b"b")  # every live writer pending: out at once, not by the timer
    triggers = ray.get(node.status.remote())["batch_triggers"]
    assert triggers["delay"] == 1 and triggers["all_pending"] >= 1
    _, (h,) = checkpoint([ghost], b"c")  # speaks again: a source again, nothing lost
    assert list(h.get_state_changes(0)) == [b"c"]
    client.close()


def test_a_late_request_of_the_same_checkpoint_joins_its_batch(tree_factory, namespace,
                                                                tmp_path):
    """The delay ends while a writer that took part in the previous checkpoint has not sent
    this one's request: the node waits for it (up to persist_max_wait_s), so the checkpoint
    stays ONE file. Without it this checkpoint was two files."""
    tree = tree_factory(base=f"file://{tmp_path}/dfs", persist_delay_s=0.02,
                        persist_max_wait_s=5.0)
    client = StateChangelogClient("jobl", namespace=namespace)
    ws = [client.create_writer(f"w{i}", KeyGroupRange(0, 0)) for i in range(3)]
    for w in ws:
        w.append(0, b"1")
    [f.result(timeout=30) for f in [w.persist_durably(0, checkpoint_id=1) for w in ws]]
    assert len(_dstl_files(tmp_path / "dfs")) == 1
    for w in ws:
        w.append(0, b"2")
    early = [w.persist_durably(0, checkpoint_id=2) for w in ws[:2]]
    time.sleep(0.6)  # 30 delays
    assert not any(f.done() for f in early)  # still waiting for ws[2]
    handles = [f.result(timeout=30) for f in [*early, ws[2].persist_durably(0, 2)]]
    assert len(_dstl_files(tmp_path / "dfs")) == 2  # one new file for checkpoint 2
    assert all(list(h.get_state_changes(0)) == [b"1", b"2"] for h in handles)
    st = ray.get(tree.node(client.node_name).status.remote())
    assert st["waits_for_late"] == 1
    client.close()


def test_a_writer_with_nothing_new_does_not_hold_up_the_batch(tree_factory, namespace,
                                                                tmp_path):
    """A writer whose changes are all durable marks the checkpoint instead of sending; the
    batch of the others goes out at once, not after the (long) delay."""
    tree = tree_factory(base=f"file://{tmp_path}/dfs", persist_delay_s=5.0)
    client = StateChangelogClient("jobm", namespace=namespace)
    busy, idle = (client.create_writer(n, KeyGroupRange(0, 0)) for n in ("busy", "idle"))
    for w in (busy, idle):
        w.append(0, b"1")
    [f.result(timeout=30) for f in [w.persist_durably(0, checkpoint_id=1)
                                    for w in (busy, idle)]]
    busy.append(0, b"2")
    t0 = time.monotonic()
    h_idle = idle.persist_durably(0, checkpoint_id=2).result(timeout=30)  # reuses, marks
    h_busy = busy.persist_durably(0, checkpoint_id=2).result(timeout=30)
    assert time.monotonic() - t0 < 2.5
    assert list(h_busy.get_state_changes(0)) == [b"1", b"2"]
    assert list(h_idle.get_state_changes(0)) == [b"1"]
    st = ray.get(tree.node(client.node_name).status.remote())
    assert st["batch_triggers"]["delay"] == 0
    client.close()


def test_persist_results_are_delivered_off_rays_event_thread(tree_factory, namespace,
                                                             tmp_path):
    """Persist results reach writers, backends and users' callbacks on the transport's own
    thread, never on Ray's event thread. There, a callback that waits for a lock held by a
    thread inside a Ray call (a materialization releasing uploads to their node) froze the
    whole worker process: found by experiments.chaos, a checkpoint that never completed."""
    tree_factory(base=f"file://{tmp_path}/dfs", persist_delay_s=0.01)

    def scenario(ns: str) -> tuple[list[str], list[bytes]]:  # shipped by value to a worker
        import threading

        from dstl_ray import KeyGroupRange, StateChangelogClient

        client = StateChangelogClient("jobt", namespace=ns)
        w = client.create_writer("op", KeyGroupRange(0, 0))
        threads: list[str] = []
        for v in (b"a", b"b"):
            w.append(0, v)
            f = w.persist_durably(0)
            f.add_done_callback(lambda _f: threads.append(threading.current_thread().name))
            h = f.result(timeout=30)
        client.close()
        return threads, list(h.get_state_changes(0))

    threads, changes = ray.get(ray.remote(num_cpus=0)(scenario).remote(namespace), timeout=60)
    assert changes == [b"a", b"b"]
    assert threads and all(t.startswith("dstl-deliver") for t in threads), threads


def test_a_node_that_does_not_answer_fails_the_persist_at_its_deadline(tree_factory,
                                                                       namespace, tmp_path):
    """The node flushing the batch hangs for 8 s in its DFS write (attempts may take 30 s):
    the writer's request fails with PersistError after persist_timeout_s (2 s). Before, its
    future stayed pending until the node answered, however long. The writer's next request
    sends the changes again and succeeds; the late answer's file is released unused, so its
    node deletes it (nobody names it)."""
    import json

    tree = tree_factory(base=f"file://{tmp_path}/dfs", persist_delay_s=0.01,
                        persist_timeout_s=2.0, upload_timeout_s=30.0, max_attempts=1,
                        plugins="dstl_ray.testing")  # set_fault_spec below
    hang = json.dumps({"script": ["slow:8"], "match": ".dstl"})  # each node's first flush
    ray.get([tree.node(n).set_fault_spec.remote(hang) for n in tree.nodes], timeout=30)
    client = StateChangelogClient("jobh", namespace=namespace)
    w = client.create_writer("op", KeyGroupRange(0, 0))
    w.append(0, b"a")
    t0 = time.monotonic()
    with pytest.raises(PersistError, match="persist_timeout_s=2s"):
        w.persist_durably(0).result(timeout=30)
    assert 1.9 <= time.monotonic() - t0 < 7.5  # the deadline, not the node's answer
    assert w.retained_sqns()  # nothing is lost
    w.append(0, b"b")
    h = w.persist_durably(0).result(timeout=30)  # re-sent: the flushing node answers now
    assert list(h.get_state_changes(0)) == [b"a", b"b"]
    tr = client.transport
    deadline = time.monotonic() + 30
    while tr.late_released < 1 and time.monotonic() < deadline:
        time.sleep(0.2)  # the hung flush lands at ~8 s; its answer comes late
    assert tr.timeouts == 1 and tr.late_released == 1
    while (["file://" + p for p in _dstl_files(tmp_path / "dfs")] != h.file_paths()
           and time.monotonic() < deadline):
        time.sleep(0.2)  # released unused: its node deletes it
    assert ["file://" + p for p in _dstl_files(tmp_path / "dfs")] == h.file_paths()
    client.close()


@pytest.mark.parametrize("lane", ["on", "off"])
def test_writers_on_the_nodes_machine_use_the_local_lane(tree_factory, namespace, tmp_path,
                                                         lane):
    """Persist calls and marks of a writer on its node actor's machine go over the local
    lane (dstl_ray.transport.lane), not Ray; after the node actor is killed and restarted,
    the writer finds it again and opens a new lane. With local_lane=off: Ray calls only."""
    tree = tree_factory(base=f"file://{tmp_path}/dfs", persist_delay_s=0.01, local_lane=lane)
    client = StateChangelogClient("jobl", namespace=namespace)
    w = client.create_writer("op", KeyGroupRange(0, 0))
    first = client.transport.lane
    assert (first is not None) == (lane == "on")
    w.append(0, b"a")
    w.persist_durably(0, checkpoint_id=1).result(timeout=30)
    w.persist_durably(0, checkpoint_id=2).result(timeout=30)  # nothing new: a mark
    node = tree.node(client.node_name)
    st = ray.get(node.status.remote())
    if lane == "on":
        assert first.calls >= 2  # the persist call and the mark went by lane
        deadline = time.monotonic() + 10
        while st["lane"]["calls"] < 2:  # the mark is not waited for: it may still be on
            assert time.monotonic() < deadline  # its way when status (by Ray) arrives
            time.sleep(0.1)
            st = ray.get(node.status.remote())
        assert st["lane"]["connections"] == 1
    else:
        assert st["lane"] is None
    ray.kill(node, no_restart=False)
    deadline = time.monotonic() + 60
    while True:  # until the restarted actor answers
        try:
            if ray.get(node.status.remote(), timeout=10)["incarnation"] != st["incarnation"]:
                break
        except Exception:  # noqa: BLE001 - restarting
            pass
        assert time.monotonic() < deadline
        time.sleep(0.3)
    w.append(0, b"b")
    while True:
        try:
            h = w.persist_durably(0, checkpoint_id=3).result(timeout=30)
            break
        except PersistError:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert list(h.get_state_changes(0)) == [b"a", b"b"]
    w.append(0, b"c")  # the request that found the lane broken went by Ray; this one
    h = w.persist_durably(0, checkpoint_id=4).result(timeout=30)  # finds the node again
    assert list(h.get_state_changes(0)) == [b"a", b"b", b"c"]
    if lane == "on":
        assert client.transport.lane is not None and client.transport.lane is not first
        assert first.closed is not None
    client.close()
    assert client.transport.lane is None


@ray.remote(num_cpus=0)
class _TwoWritersInTurn:
    """One process holding two writers that persist one after the other, as an executor
    running two subtasks on one core does."""

    def __init__(self, namespace: str) -> None:
        self.client = StateChangelogClient("inturn", namespace=namespace)
        self.writers = [self.client.create_writer(f"op{i}", KeyGroupRange(i, i))
                        for i in range(2)]

    def node(self) -> str:
        return self.client.node_name

    def checkpoint(self, cp: int, in_turn: bool) -> tuple[float, list[str]]:
        """Both writers' changes of ``cp`` durable; (seconds, handles as JSON)."""
        for i, w in enumerate(self.writers):
            w.append(i, f"cp{cp}-w{i}".encode())
        t0 = time.monotonic()
        if in_turn:
            handles = [w.persist_durably(0, checkpoint_id=cp).result(timeout=30)
                       for w in self.writers]
        else:
            futures = [w.persist_durably(0, checkpoint_id=cp) for w in self.writers]
            handles = [f.result(timeout=30) for f in futures]
        return time.monotonic() - t0, [h.to_json() for h in handles]

    def close(self) -> None:
        self.client.close()


def test_writers_of_one_process_persisting_in_turn_do_not_wait_for_each_other(
        tree_factory, namespace, tmp_path):
    """Issue 28 item 6: the second writer sent the previous checkpoint, so its node took it
    for late and waited persist_max_wait_s (0.5 s) for a request that could only come after
    the answer to the first one's: every checkpoint cost 0.5 s (on the old code
    waits_for_late grew by one per checkpoint and the p50 was ~510 ms). Now the node knows
    both writers live in one process, that this process waits for each answer (learned from
    the checkpoint before), and that it has a request unanswered: it does not wait."""
    from dstl_ray import StateChangelogHandle

    tree = tree_factory(base=f"file://{tmp_path}/dfs", persist_max_wait_s=0.5)
    actor = _TwoWritersInTurn.remote(namespace)
    try:
        ray.get(actor.checkpoint.remote(0, False))  # both at once: each sent a checkpoint
        ray.get(actor.checkpoint.remote(1, True))  # in turn: the node learns it (one wait)
        before = sum(s["waits_for_late"] for s in tree.status())
        took = []
        for cp in range(2, 8):
            seconds, handles = ray.get(actor.checkpoint.remote(cp, True))
            took.append(seconds)
        waits = sum(s["waits_for_late"] for s in tree.status()) - before
        assert waits == 0, (waits, took)
        assert sorted(took)[len(took) // 2] < 0.25, took
        for i, text in enumerate(handles):
            got = StateChangelogHandle.from_json(text).read_all()
            assert got == {i: [f"cp{cp}-w{i}".encode() for cp in range(8)]}
    finally:
        ray.get(actor.close.remote())
        ray.kill(actor)
