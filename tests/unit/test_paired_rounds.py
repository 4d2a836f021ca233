"""Paired rounds on a drifting machine (experiments.paired_rounds, and spark_throughput's rows
and ratios from them): pure logic over made-up runs."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from experiments.paired_rounds import median_item, median_ratio, paired_ratios, round_order
from experiments.spark_throughput import SYSTEMS, median_rows, size_ratios


def test_odd_rounds_run_the_systems_in_reverse():
    assert [round_order([3, 4, 5], i) for i in range(3)] == [[3, 4, 5], [5, 4, 3], [3, 4, 5]]


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=9))
def test_the_median_item_has_as_many_items_above_as_at_or_below(values):
    m = median_item(values, float)
    below = sum(v < m for v in values)
    above = sum(v > m for v in values)
    assert below <= (len(values) - 1) // 2 and above <= len(values) // 2


def test_no_items_have_no_median():
    with pytest.raises(ValueError, match="no items"):
        median_item([], float)


def test_ratios_pair_runs_of_one_round_only():
    a = {0: 10.0, 1: 30.0, 2: 12.0}
    b = {0: 10.0, 1: 10.0, 3: 1.0}  # round 2 has no b, round 3 no a
    assert paired_ratios(a, b) == [1.0, 3.0]
    assert median_ratio(a, b) == {"median": 1.0, "per_round": [1.0, 3.0]}
    assert median_ratio(a, {}) is None


def _run(system: int, rnd: int, eps: float, e: int = 1000, k: int = 10) -> dict:
    return {"system": SYSTEMS[system], "events_per_batch": e, "keys": k, "round": rnd,
            "events_per_s": eps, "batch_ms_p50": e / eps * 1000}


def test_a_ratio_is_the_median_of_the_rounds_not_of_the_medians():
    # the machine is slow in round 1 for both systems: the medians of each system's runs
    # would compare native's round 2 with the combiner's round 0 (0.8x); each round's pair
    # says the combiner is ahead (1.2x, 1.25x, 1.1x)
    runs = [_run(3, 0, 100.0), _run(4, 0, 120.0),
            _run(4, 1, 50.0), _run(3, 1, 40.0),
            _run(3, 2, 150.0), _run(4, 2, 165.0)]
    r = size_ratios(runs, 1000, 10)
    assert r["vectorized_combine_over_native_agg"] == pytest.approx(1.2)
    assert r["per_round"] == {"vectorized_combine_over_native_agg":
                              pytest.approx([1.2, 1.25, 1.1])}
    assert r["per_key_combine_over_native_agg"] is None  # not run
    rows = median_rows(runs, 3)
    assert [(x["system"], x["events_per_s"]) for x in rows] == [
        (SYSTEMS[3], 100.0), (SYSTEMS[4], 120.0)]
    assert "round" not in rows[0] and len(rows[0]["rounds_batch_ms_p50"]) == 3


def test_one_round_keeps_the_single_run_rows():
    runs = [_run(3, 0, 100.0), _run(5, 0, 60.0)]
    rows = median_rows(runs, 1)
    assert all("rounds_batch_ms_p50" not in x for x in rows)
    r = size_ratios(runs, 1000, 10)
    assert r["per_key_combine_over_native_agg"] == pytest.approx(0.6) and "per_round" not in r


@pytest.mark.parametrize("systems", [f"3,{len(SYSTEMS)}", "3,3", "-1"])
def test_spark_throughput_refuses_a_system_it_does_not_have(monkeypatch, capsys, systems):
    # (an index past the list once ran the native aggregation again on its first run's
    # checkpoint: a query with nothing to read, waited on for an hour)
    from experiments import spark_throughput

    monkeypatch.setattr(sys, "argv", ["spark_throughput", "--systems", systems])
    with pytest.raises(SystemExit) as exited:
        spark_throughput.main()
    assert exited.value.code == 2
    assert "--systems" in capsys.readouterr().err
