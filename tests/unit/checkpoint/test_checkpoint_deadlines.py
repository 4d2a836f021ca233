"""One deadline per checkpoint (Flink's checkpoint timeout): a checkpoint whose snapshots are
not all in ``checkpoint_timeout_s`` after its trigger is declined, and a hung checkpoint does
not hold up the ones after it; completed checkpoints still only rise."""

from __future__ import annotations

import concurrent.futures
import math
import time

import pytest

import dstl_ray as d
from dstl_ray.storage.registry import get_storage

from ..ckpt_util import MAXP, client, new_base


class HungSnapshots(d.ChangelogKeyedStateBackend):
    """A real backend whose snapshots of the checkpoints in ``hang`` never complete (its
    subtask hangs, or its node actor never answers)."""

    def __init__(self, *args, hang: set[int], **kw) -> None:
        super().__init__(*args, **kw)
        self.hang = hang
        self.hung: list[concurrent.futures.Future] = []

    def snapshot(self, checkpoint_id: int = -1):
        if checkpoint_id in self.hang:
            f: concurrent.futures.Future = concurrent.futures.Future()
            self.hung.append(f)
            return f
        return super().snapshot(checkpoint_id)


def _job(timeout_s: float, hang: set[int]):
    base = new_base()
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP, retained=2,
                                    checkpoint_timeout_s=timeout_s)
    c = client("job", base)
    a = HungSnapshots(c, "op", d.KeyGroupRange(0, 7), MAXP, materialization_interval=None,
                      hang=hang)
    b = d.ChangelogKeyedStateBackend(c, "op", d.KeyGroupRange(8, 15), MAXP,
                                     materialization_interval=None)
    for x in (a, b):
        coord.register_backend(x)
    return base, coord, a, b


def _update(backends, value) -> None:
    for bk in backends:
        for i in range(20):
            key = f"k{i}"
            if d.assign_key_group(key, MAXP) in bk.key_group_range:
                bk.value_state("v").update(key, value)


def test_a_hung_snapshot_declines_its_checkpoint_at_the_deadline_and_the_next_completes():
    base, coord, a, b = _job(0.5, hang={1})
    _update([a, b], 1)
    t0 = time.monotonic()
    pc1 = coord.trigger_checkpoint()
    with pytest.raises(d.CheckpointDeclinedError) as e:
        pc1.result(timeout=10)
    elapsed = time.monotonic() - t0
    assert 0.45 <= elapsed < 5.0, elapsed
    msg = str(e.value)
    assert "checkpoint 1 " in msg and "checkpoint_timeout_s=0.5s" in msg and "1 of 2" in msg and "op[0-7]" in msg
    assert coord.declined == 1 and a.hung and not a.hung[0].done()
    _update([a, b], 2)
    cc2 = coord.trigger_checkpoint().result(timeout=10)
    assert cc2.checkpoint_id == 2 and coord.latest_checkpoint().checkpoint_id == 2
    st = get_storage(base)
    assert not st.exists(f"{coord.job_path}/chk-1/_metadata")
    assert st.exists(cc2.metadata_url)
    coord.shutdown()


def test_a_hung_checkpoint_does_not_hold_up_a_later_one():
    """Checkpoint 2 is ready long before checkpoint 1's deadline: it completes at once, and
    checkpoint 1 (which could only complete into the past now) is declined as subsumed
    right then, not at its deadline. Before, checkpoint 2 waited behind checkpoint 1."""
    _, coord, a, b = _job(30.0, hang={1})
    _update([a, b], 1)
    pc1 = coord.trigger_checkpoint()
    _update([a, b], 2)
    t0 = time.monotonic()
    cc2 = coord.trigger_checkpoint().result(timeout=10)
    assert cc2.checkpoint_id == 2 and time.monotonic() - t0 < 10
    with pytest.raises(d.CheckpointDeclinedError, match="checkpoint 1 .*subsumed"):
        pc1.result(timeout=10)
    assert time.monotonic() - t0 < 10  # not at its 30 s deadline
    assert [c.checkpoint_id for c in coord.completed_checkpoints()] == [2]
    assert coord.subsumed_watermark() == 1  # nothing pending below 2 any more
    coord.shutdown()


def test_checkpoints_that_are_not_held_up_complete_in_trigger_order():
    _, coord, a, b = _job(30.0, hang=set())
    for r in range(5):
        _update([a, b], r)
        pcs = [coord.trigger_checkpoint() for _ in range(3)]
        ids = [pc.result(timeout=10).checkpoint_id for pc in pcs]
        assert ids == sorted(ids)
    assert coord.declined == 0
    coord.shutdown()


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan, "600", True, None])
def test_bad_checkpoint_timeout_is_a_config_error_naming_it(bad):
    with pytest.raises(d.ConfigError, match="checkpoint_timeout_s"):
        d.CheckpointCoordinator("job", new_base(), checkpoint_timeout_s=bad)


def test_default_checkpoint_timeout_is_flinks_ten_minutes():
    assert d.CheckpointCoordinator("job", new_base()).checkpoint_timeout_s == 600.0
