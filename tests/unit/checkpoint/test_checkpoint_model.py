"""Model-based test of the checkpoint lifecycle (fixed seeds): random puts, deletes, list
appends and map updates; checkpoints (some concurrent), materializations, crashes and
restores at random parallelism. After every restore the state equals the oracle at the
restored checkpoint, and storage holds exactly what the retained checkpoints reference."""

from __future__ import annotations

import copy
import random

import pytest

import dstl_ray as d

from ..ckpt_util import MAXP, Oracle, client, dump_all, files, new_base, referenced


def _recover(base, retained, parallelism):
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP, retained=retained)
    bs = coord.restore(client("job", base), "op", parallelism, materialization_interval=None)
    return coord, bs


@pytest.mark.parametrize("seed", range(8))
def test_random_lifecycle_matches_oracle(seed):
    rng = random.Random(seed)
    base = new_base()
    retained = rng.randint(1, 3)
    oracle = Oracle()
    at_checkpoint: dict[int, dict] = {}
    coord, bs = _recover(base, retained, rng.randint(1, 6))
    for _step in range(400):
        r = rng.random()
        k = f"k{rng.randint(0, 60)}"
        if r < 0.35:
            oracle.put(bs, k, rng.choice([rng.randint(-5, 10**9), f"s{rng.random()}",
                                          [1, "x", None], {"a": 1.5}]))
        elif r < 0.45:
            oracle.delete(bs, k)
        elif r < 0.6:
            oracle.list_add(bs, k, rng.randint(0, 100))
        elif r < 0.72:
            oracle.map_put(bs, k, f"u{rng.randint(0, 4)}", rng.random())
        elif r < 0.78:
            oracle.map_remove(bs, k, f"u{rng.randint(0, 4)}")
        elif r < 0.86:  # one checkpoint, or two in flight at once
            pcs = []
            for _ in range(rng.choice([1, 1, 2])):
                pcs.append(coord.trigger_checkpoint())
                at_checkpoint[pcs[-1].checkpoint_id] = oracle.copy()
                if rng.random() < 0.5:
                    oracle.put(bs, k, "between")
            for i, pc in enumerate(pcs):
                try:
                    pc.result()
                except d.CheckpointDeclinedError as e:
                    # two in flight: the older one's last snapshot came in after the newer
                    # one completed, which subsumes it (Flink aborts it too)
                    assert i == 0 and len(pcs) == 2 and "completed first" in str(e), e
                    pcs[1].result()
                    del at_checkpoint[pc.checkpoint_id]
        elif r < 0.93:
            futs = [b.materialize() for b in bs if rng.random() < 0.6]
            if rng.random() < 0.5:
                for f in futs:
                    if f is not None:
                        f.result()
        else:  # crash (no shutdown) and recover at a random parallelism
            for b in bs:  # the crashed process's last uploads land (or not) first
                b.wait_materialization(30)
                b.writer.wait_uploads(30)
            latest = coord.latest_checkpoint()
            coord.abandon()
            coord, bs = _recover(base, retained, rng.randint(1, 6))
            expected = at_checkpoint[latest.checkpoint_id] if latest else Oracle().state
            assert dump_all(bs) == expected
            oracle.state = copy.deepcopy(expected)
            assert files(base) == referenced(coord), "leaked or missing files after recovery"
            if latest:
                assert coord.latest_checkpoint().checkpoint_id == latest.checkpoint_id
    # final: checkpoint, shut down, recover, compare; storage exactly the retained files
    pc = coord.trigger_checkpoint()
    at_checkpoint[pc.checkpoint_id] = oracle.copy()
    pc.result()
    coord.shutdown()
    have, want = files(base), referenced(coord)
    assert want <= have, "missing files at shutdown"
    # a declined checkpoint's late snapshot (its changes truncated before its upload landed)
    # leaves nothing behind either (tests/unit/checkpoint/test_late_snapshot.py)
    assert have == want, f"leaked at shutdown: {sorted(have - want)}"
    coord, bs = _recover(base, retained, rng.randint(1, 8))
    assert dump_all(bs) == at_checkpoint[pc.checkpoint_id]
    assert files(base) == referenced(coord)
    assert len(coord.completed_checkpoints()) <= retained
    coord.shutdown()
