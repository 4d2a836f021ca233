"""FLIP-306 across checkpoints on the real Ray tree (file://): the flushing node appends each
flush to its open file, nothing a retained checkpoint names is deleted, nothing else stays,
and a restore equals the oracle."""

from __future__ import annotations

import os
import time

import pytest

import dstl_ray as d
from dstl_ray.checkpoint.recovery import restore_backends
from dstl_ray.cli.inspect import inspect_path, render

MAXP = 32
JOB = "cmerge"


def _owner(bs, key):
    kg = d.assign_key_group(key, MAXP)
    return next(b for b in bs if kg in b.key_group_range)


def _on_disk(root, sub):
    top = root / JOB / sub
    return {"file://" + os.path.join(dp, f) for dp, _, fs in os.walk(top) for f in fs}


def _referenced(coord, sub):
    return {u for c in coord.completed_checkpoints() for u in c.files.values()
            if f"/{JOB}/{sub}/" in u}


def _restored(namespace, checkpoint):
    """The counts of ``checkpoint`` restored by a reader job of its own."""
    reader = restore_backends(d.StateChangelogClient(JOB + "-r", namespace=namespace),
                              checkpoint, "op", 2, MAXP, materialization_interval=None)
    try:
        got = {}
        for b in reader:
            got.update(b.dump().get("n", {}))
        return got
    finally:
        for b in reader:
            b.close()


def test_flushes_are_appended_across_checkpoints_and_freed(tree_factory, namespace, tmp_path):
    base = f"file://{tmp_path}/dfs"
    tree_factory(base=base, file_merging="across_checkpoints")
    client = d.StateChangelogClient(JOB, namespace=namespace)
    assert client.config.file_merging == "across_checkpoints"
    coord = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=2)
    bs = coord.restore(client, "op", 3, materialization_interval=0.3)
    state: dict[str, int] = {}
    seen: set[str] = set()
    for r in range(30):
        for i in range(60):
            k = f"k{(r * 7 + i) % 90}"
            state[k] = state.get(k, 0) + 1
            _owner(bs, k).value_state("n").update(k, state[k])
        coord.trigger_checkpoint().result(timeout=60)
        seen |= _on_disk(tmp_path / "dfs", "segments")
        for c in coord.completed_checkpoints():  # nothing a retained checkpoint names is gone
            gone = [u for u in c.files.values() if not os.path.exists(u[len("file://"):])]
            assert not gone, (c.checkpoint_id, gone)
        time.sleep(0.05)
    # appended to the open file (rolled when mostly dead), not one file per checkpoint
    assert 1 <= len(seen) <= 10, seen
    assert not [p for p in (tmp_path / "dfs" / JOB).rglob("*.dstl")
                if "/segments/" not in str(p)], "every flush went to a merged file"
    assert sum(b.materializations for b in bs) >= 3
    # `dstl-ray inspect` walks a merged file flush by flush, every CRC checked
    live = _on_disk(tmp_path / "dfs", "segments")
    biggest = max(live, key=lambda u: os.path.getsize(u[len("file://"):]))
    summary = inspect_path(biggest)
    assert len(summary["flushes"]) >= 2 and all(f["logs"] for f in summary["flushes"])
    assert "flush at offset" in render(summary)
    assert _restored(namespace, coord.latest_checkpoint()) == state
    # materialize once more, then no more: the old flushes die once released and subsumed.
    # The watermark rides on persist requests, so each checkpoint has one small change.
    for b in bs:
        b.materialize(force=True).result(timeout=30)
        b.materialization_interval = None
    deadline = time.monotonic() + 30
    n = 0
    while True:
        n += 1
        k = f"k{n % 90}"
        state[k] = state.get(k, 0) + 1
        _owner(bs, k).value_state("n").update(k, state[k])
        coord.trigger_checkpoint().result(timeout=60)
        on_disk, ref = _on_disk(tmp_path / "dfs", "segments"), _referenced(coord, "segments")
        if on_disk == ref or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert on_disk == ref
    coord.shutdown()


def test_across_checkpoints_is_refused_on_object_stores():
    with pytest.raises(d.ConfigError, match="across_checkpoints needs a file system"):
        d.deploy("s3://bucket/ckpt", d.ChangelogConfig(file_merging="across_checkpoints"))


def test_restored_backends_keep_the_flushes_they_restored(tree_factory, namespace, tmp_path):
    """After a failover the new backends' snapshots name the restored changelog (until their
    first materialization), in files the old writers had released: the node must keep them
    for the new logs, however far the watermark moves."""
    base = f"file://{tmp_path}/dfs"
    # one flush per file: a file goes as soon as its flush is dead
    tree_factory(base=base, file_merging="across_checkpoints", file_merging_max_file_size=1)
    client = d.StateChangelogClient(JOB, namespace=namespace)
    coord = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=2)
    old = coord.restore(client, "op", 2, materialization_interval=None)
    state: dict[str, int] = {}

    def update(bs, r):
        for i in range(40):
            k = f"k{(r * 3 + i) % 50}"
            state[k] = state.get(k, 0) + 1
            _owner(bs, k).value_state("n").update(k, state[k])

    update(old, 0)
    first = coord.trigger_checkpoint().result(timeout=60)  # names the old writers' flush
    state_at_first = dict(state)
    update(old, 1)
    for b in old:  # the old writers truncate and release that flush, then die
        b.materialize(force=True).result(timeout=30)
        b._stop.set()
        coord.unregister_backend(b)
    state.clear()  # what the new backends restore
    state.update(state_at_first)
    new = restore_backends(d.StateChangelogClient(JOB, namespace=namespace), first, "op", 2,
                           MAXP, materialization_interval=None)
    for b in new:
        coord.register_backend(b)
    for r in range(2, 7):  # the watermark passes the first checkpoint; no materialization
        update(new, r)
        coord.trigger_checkpoint().result(timeout=60)
        for c in coord.completed_checkpoints():
            gone = [u for u in c.files.values() if not os.path.exists(u[len("file://"):])]
            assert not gone, (c.checkpoint_id, gone)
    assert coord.subsumed_watermark() > first.checkpoint_id
    assert _restored(namespace, coord.latest_checkpoint()) == state
    coord.shutdown()
