"""RetainedCheckpoints: the last K complete checkpoints, only ever rising (Flink's
CompletedCheckpointStore)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dstl_ray.checkpoint.metadata import CheckpointMetadata
from dstl_ray.checkpoint.recovery import CompletedCheckpoint
from dstl_ray.checkpoint.retained import RetainedCheckpoints
from dstl_ray.errors import CheckpointDeclinedError


def _cc(n: int) -> CompletedCheckpoint:
    return CompletedCheckpoint(n, f"memory://j/chk-{n}/_metadata",
                               CheckpointMetadata("j", n, "checkpoint", 16, ()), {})


@given(st.integers(1, 4), st.lists(st.integers(0, 50), unique=True, max_size=20))
def test_adding_keeps_the_newest_k_and_returns_the_subsumed(k, ids):
    r, added, subsumed = RetainedCheckpoints(k), [], []
    for n in sorted(ids):
        subsumed += [c.checkpoint_id for c in r.add(_cc(n))]
        added.append(n)
    assert r.ids() == added[-k:]
    assert subsumed == added[:-k] if len(added) > k else subsumed == []
    assert r.newest_id() == (added[-1] if added else -1)
    assert (r.latest().checkpoint_id if r.latest() else None) == (added[-1] if added else None)


def test_an_id_not_newer_than_the_newest_or_in_progress_is_refused():
    r = RetainedCheckpoints(2)
    r.refuse_older(0, "j")  # nothing retained: any id
    r.add(_cc(3))
    with pytest.raises(CheckpointDeclinedError, match="checkpoint 3 is already complete"):
        r.refuse_older(3, "j")
    with pytest.raises(CheckpointDeclinedError, match="or 5 in progress"):
        r.refuse_older(5, "j", {5})
    r.refuse_older(4, "j", {5})
    assert r.subsumed(2) == "checkpoint 2 subsumed: checkpoint 3 completed first"
    assert r.subsumed(4) is None


def test_drop_replace_and_clear():
    r = RetainedCheckpoints(3)
    for n in (1, 2, 3):
        r.add(_cc(n))
    assert [c.checkpoint_id for c in r.drop_from(2)] == [2, 3] and r.ids() == [1]
    r.replace([_cc(7), _cc(5)])
    assert r.ids() == [5, 7]
    assert [c.checkpoint_id for c in r.clear()] == [5, 7] and r.ids() == [] and r.all() == []
