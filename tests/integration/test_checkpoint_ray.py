"""Backend + coordinator on the real Ray tree (file://): checkpoints, a crash, a restore at
another parallelism that matches an oracle, and storage holding only retained files."""

from __future__ import annotations

import random

import dstl_ray as d
from dstl_ray.storage.registry import get_storage

MAXP = 32


def _dump(bs):
    out = {}
    for b in bs:
        for name, dd in b.dump().items():
            out.setdefault(name, {}).update(dd)
    return out


def _owner(bs, key):
    kg = d.assign_key_group(key, MAXP)
    return next(b for b in bs if kg in b.key_group_range)


def test_checkpoints_and_rescaled_restore_on_ray_tree(tree_factory, namespace, tmp_path):
    base = f"file://{tmp_path}/x"
    tree_factory(base=base)
    rng = random.Random(7)
    client = d.StateChangelogClient("rjob", namespace=namespace)
    coord = d.CheckpointCoordinator("rjob", base, max_parallelism=MAXP, retained=2)
    bs = coord.restore(client, "op", 3, materialization_interval=None)
    oracle: dict[str, dict] = {"v": {}, "l": {}}
    at: dict[int, dict] = {}
    for round_ in range(5):
        for _ in range(60):
            k = f"k{rng.randint(0, 40)}"
            v = rng.randint(0, 1000)
            _owner(bs, k).value_state("v").update(k, v)
            oracle["v"][k] = v
            _owner(bs, k).list_state("l").add(k, round_)
            oracle["l"].setdefault(k, []).append(round_)
        pcs = [coord.trigger_checkpoint()]
        at[pcs[0].checkpoint_id] = {n: {k: (list(x) if isinstance(x, list) else x)
                                        for k, x in m.items()} for n, m in oracle.items()}
        if round_ == 2:
            for b in bs:
                b.materialize().result(timeout=60)
        for pc in pcs:
            pc.result(timeout=60)
    latest = coord.latest_checkpoint()
    for b in bs:  # crash: no shutdown
        b.writer.wait_uploads(30)
    coord.abandon()
    client2 = d.StateChangelogClient("rjob", namespace=namespace)
    coord2 = d.CheckpointCoordinator("rjob", base, max_parallelism=MAXP, retained=2)
    bs2 = coord2.restore(client2, "op", 5, materialization_interval=None)
    assert _dump(bs2) == at[latest.checkpoint_id]
    root = f"{base}/rjob"
    want = {u for c in coord2.completed_checkpoints() for u in c.files.values()} | {
        c.metadata_url for c in coord2.completed_checkpoints()}
    assert set(get_storage(root).list_files(root)) == want | {coord2.lease.url}
    coord2.shutdown()
    # a clean shutdown leaves the released lease record: the next run's epoch grows from it
    assert set(get_storage(root).list_files(root)) == want | {coord2.lease.url}
