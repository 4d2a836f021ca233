"""How the chaos harness takes a fault kind's recovery latency ratio
(experiments.chaos_report), without a cluster."""

from __future__ import annotations

from experiments.chaos_report import drift, ratios_by_kind, recovery_ratios


def test_recovery_ratio_counts_only_isolated_faults_with_enough_samples():
    """p50 of the other job's checkpoints in [end + heal, + window) over p50 in the window
    before the fault; a fault with another fault (or its heal window) in either window, or
    with too few checkpoints in one, gives no ratio. A kind's ratio is the median of its
    faults' ratios."""
    before = [[t / 2, 10.0] for t in range(0, 20)]  # 0 .. 9.5 s: 10 ms
    during = [[t / 2, 900.0] for t in range(20, 40)]  # the faults: slow, never counted
    after = [[t / 2, 10.0 if t < 60 else 30.0] for t in range(40, 80)]  # 30 ms from 30 s
    series = before + during + after
    faults = [{"kind": "savepoint_cycle", "start_s": 10.0, "end_s": 12.0}]
    (r,) = recovery_ratios(faults, series, window_s=5.0, heal_s=10.0)
    assert r["isolated"] and (r["n_before"], r["n_after"]) == (10, 10), r
    assert (r["before_p50_ms"], r["after_p50_ms"], r["ratio"]) == (10.0, 10.0, 1.0), r
    (r,) = recovery_ratios([{**faults[0], "end_s": 18.0}], series, 5.0, 10.0)
    assert r["after_p50_ms"] == 30.0 and r["ratio"] == 3.0, r  # [28, 33): mostly 30 ms
    # a second fault within the first one's window after (or its heal reaching into the
    # second one's window before): neither counts
    two = faults + [{"kind": "long_stall", "start_s": 25.0, "end_s": 26.0}]
    assert [("ratio" in r, r["isolated"]) for r in recovery_ratios(two, series, 5.0, 10.0)
            ] == [(False, False), (False, False)]
    # too few checkpoints in the window before (the other job just started)
    (r,) = recovery_ratios([{**faults[0], "start_s": 0.8}], series, 5.0, 10.0)
    assert r["isolated"] and r["n_before"] == 2 and "ratio" not in r, r
    episodes = [{"recovery": recovery_ratios(faults, series, 5.0, 10.0)},
                {"recovery": recovery_ratios([{**faults[0], "end_s": 18.0}], series, 5.0,
                                             10.0)}]
    by_kind = ratios_by_kind(episodes)["savepoint_cycle"]
    assert (by_kind["counted"], by_kind["worst_fault_ratio"], by_kind["ratio"]) == (
        2, 3.0, 2.0)
    # one slow window among three faults stays a single fault's; a slowdown after each
    # of them is the kind's
    three = episodes + [{"recovery": recovery_ratios(faults, series, 5.0, 10.0)}]
    assert ratios_by_kind(three)["savepoint_cycle"]["ratio"] == 1.0
    slow = [{"recovery": recovery_ratios([{**faults[0], "end_s": 18.0}], series, 5.0, 10.0)}]
    assert ratios_by_kind(slow * 3)["savepoint_cycle"]["ratio"] == 3.0


def test_drift_compares_an_episodes_last_window_with_its_first_after_warm_up():
    """A slowdown a fault left behind raises the windows before later faults too: the
    episode's last W over its first W after W of warm-up shows it."""
    warm = [[t / 2, 500.0] for t in range(0, 10)]  # 0 .. 4.5 s: warm-up, never counted
    steady = [[t / 2, 10.0] for t in range(10, 40)]  # 5 .. 19.5 s
    assert drift(warm + steady, 5.0) == 1.0
    slower = [[t / 2, 25.0] for t in range(40, 60)]  # a slowdown from 20 s to the end
    assert drift(warm + steady + slower, 5.0) == 2.5
    assert drift(warm + steady[:5], 5.0) is None  # shorter than three windows
    assert drift([], 5.0) is None
