"""``experiments.burst_phase``: which checkpoint triggers of a ``vs_flink`` run fell inside
its input's bursts (the draw that decides the count of checkpoints with changes)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from experiments.burst_phase import burst_phase, merge_windows, triggers_inside


def test_overlapping_subtask_bursts_are_one_burst() -> None:
    assert merge_windows([(1.0, 1.1), (0.0, 0.2), (1.05, 1.3), (0.1, 0.15), (2.0, 2.0)]) == [
        (0.0, 0.2), (1.0, 1.3), (2.0, 2.0)]


def test_a_window_ending_before_it_starts_is_refused() -> None:
    with pytest.raises(ValueError, match="ends before it starts"):
        merge_windows([(2.0, 1.0)])


def test_triggers_inside_count_start_in_end_out() -> None:
    windows = [(1.0, 1.2), (2.0, 2.2)]
    assert triggers_inside([0.9, 1.0, 1.1, 1.2, 1.9, 2.19, 2.2, 3.0], windows) == 3
    assert triggers_inside([], windows) == 0
    assert triggers_inside([1.5], []) == 0


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 5)), max_size=30),
       st.lists(st.floats(0, 110), max_size=30))
def test_triggers_inside_agrees_with_a_scan(raw, triggers) -> None:
    bursts = [(s, s + d) for s, d in raw]
    windows = merge_windows(bursts)
    assert all(a[1] < b[0] for a, b in zip(windows, windows[1:], strict=False))
    assert triggers_inside(triggers, windows) == sum(
        any(s <= t < e for s, e in bursts) for t in triggers)


def test_a_run_whose_triggers_miss_its_bursts_and_one_that_hits_them() -> None:
    # four subtasks' bursts each second, 0.0-0.15 s after it; triggers every 0.2 s
    bursts = [(sec + i * 0.01, sec + 0.12 + i * 0.01) for sec in range(3) for i in range(4)]
    missed = burst_phase([sec + 0.19 + k * 0.2 for sec in range(3) for k in range(5)], bursts)
    hit = burst_phase([sec + 0.05 + k * 0.2 for sec in range(3) for k in range(5)], bursts)
    assert missed["bursts"] == hit["bursts"] == 3
    assert missed["burst_ms"] == [150.0, 150.0, 150.0]
    assert missed["triggers_inside"] == 0 and hit["triggers_inside"] == 3
    assert burst_phase([1.0], []) == {"bursts": 0, "burst_ms": [], "triggers": 0,
                                      "triggers_inside": 0}
