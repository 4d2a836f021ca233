"""A writer process killed without releasing, on a tree that merges changelog files across
checkpoints (issue 16 item 7): its node finds its Ray job dead, fences it and releases its
sections up to the newest checkpoint it made a handle for. Before, the merged file holding
them stayed for the rest of the job's incarnation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dstl_ray import KeyGroupRange, PersistError, StateChangelogClient, StateChangelogHandle

JOB = "deadw"

WRITER = """
import sys, time
import ray
from dstl_ray import KeyGroupRange, StateChangelogClient
address, ns, job = sys.argv[1:4]
ray.init(address=address, namespace=ns, log_to_driver=False)
c = StateChangelogClient(job, namespace=ns)
w = c.create_writer("victim", KeyGroupRange(0, 0))
w.append(0, b"one")
w.persist_durably(0, checkpoint_id=1).result(timeout=60)
w.append(0, b"two")
w.persist_durably(0, checkpoint_id=2).result(timeout=60)
h = w.persist_durably(0, checkpoint_id=3).result(timeout=60)  # nothing new: a mark
print("HANDLE " + h.to_json(), flush=True)
time.sleep(3600)  # killed, never releases
"""


def _merged(root) -> set[str]:
    return {str(p) for p in root.rglob("*.dstl") if "/segments/" in str(p)}


def test_a_killed_writers_merged_flushes_go_once_no_checkpoint_can_name_them(
        tree_factory, namespace, ray_cluster, tmp_path):
    base = f"file://{tmp_path}/dfs"
    # (every flush in a file of its own: the other writer's flushes keep theirs alive)
    tree = tree_factory(base=base, file_merging="across_checkpoints", dead_writer_check_s=0.5,
                        persist_delay_s=0.01, file_merging_max_file_size=1)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    p = subprocess.Popen([sys.executable, "-c", WRITER, ray_cluster.address, namespace, JOB],
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        while not line.startswith("HANDLE "):
            line = p.stdout.readline()
            assert line or p.poll() is None, "the writer process ended early"
        handle = StateChangelogHandle.from_json(line[len("HANDLE "):])
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    assert handle.read_all() == {0: [b"one", b"two"]}
    files = _merged(tmp_path / "dfs")
    assert files
    # the job goes on with another writer; its requests carry the subsumed watermark
    client = StateChangelogClient(JOB, namespace=namespace)
    w = client.create_writer("alive", KeyGroupRange(1, 1))
    try:
        deadline = time.monotonic() + 60
        while sum(s["dead_writers_released"] for s in tree.status()) == 0:
            assert time.monotonic() < deadline, [s["dead_writers_released"]
                                                 for s in tree.status()]
            time.sleep(0.3)
        # released up to checkpoint 3: still there while checkpoint 3 may be retained
        w.subsumed(2)
        w.append(1, b"x")
        w.persist_durably(0, checkpoint_id=4).result(timeout=60)
        assert files <= _merged(tmp_path / "dfs"), "checkpoint 3 may still name them"
        assert handle.read_all() == {0: [b"one", b"two"]}
        w.subsumed(3)
        deadline = time.monotonic() + 30
        while files & _merged(tmp_path / "dfs"):
            assert time.monotonic() < deadline, "the dead writer's merged file stayed"
            w.append(1, b"y")
            w.persist_durably(0, checkpoint_id=5).result(timeout=60)
            time.sleep(0.3)
    finally:
        client.close()
    st = tree.status()
    assert sum(s["dead_writers_kept"] for s in st) == 0


def test_a_mark_the_node_does_not_take_fails_at_the_persist_deadline(tree_factory, namespace,
                                                                     tmp_path):
    """With merged files a handle waits until its node took the writer's mark (the node
    must know how far the writer's handles go before one goes out). A node that never
    answers (its process paused) fails the handle with PersistError after
    persist_timeout_s. Before, the handle waited for as long as the node was paused."""
    tree = tree_factory(base=f"file://{tmp_path}/dfs", file_merging="across_checkpoints",
                        dead_writer_check_s=3600, persist_delay_s=0.01, persist_timeout_s=2.0)
    client = StateChangelogClient("markdl", namespace=namespace)
    w = client.create_writer("op", KeyGroupRange(0, 0))
    try:
        w.append(0, b"a")
        w.persist_durably(0, checkpoint_id=1).result(timeout=30)
        pid = next(s["pid"] for s in tree.status() if s["name"] == client.transport.node_name)
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            fut = w.persist_durably(0, checkpoint_id=2)  # nothing new: an awaited mark
            try:
                fut.result(timeout=10)
                raise AssertionError("the handle went out without the node taking the mark")
            except PersistError as e:
                assert "persist_timeout_s=2s" in str(e) and "mark" in str(e)
            assert 1.9 <= time.monotonic() - t0 < 8
        finally:
            os.kill(pid, signal.SIGCONT)
        h = w.persist_durably(0, checkpoint_id=3).result(timeout=30)  # the node is back
        assert h.read_all() == {0: [b"a"]}
    finally:
        client.close()
