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


def test_a_fault_s_ratio_is_to_the_episode_s_baseline_not_to_the_window_before_it():
    """The other job's p50 flips between two modes from window to window (where its
    subtasks landed): after a fault that happened to leave it fast, the next fault's window
    before is fast too, and a ratio to it looked like a 1.4x slowdown."""
    def window(t0: float, ms: float) -> list[list[float]]:
        return [[t0 + i / 2, ms] for i in range(20)]  # 10 s of checkpoints

    # four faults, back to back as the harness keeps them: each one's window after is the
    # next one's window before; p50s 20, 14, 20, 20, 20 from window to window
    series = (window(0, 20.0) + window(10, 14.0) + window(20, 20.0) + window(30, 20.0)
              + window(40, 20.0))
    faults = [{"kind": k, "start_s": 10.0 * (i + 1) - 0.0, "end_s": 10.0 * (i + 1)}
              for i, k in enumerate(("writer_kill", "coordinator_restart", "dfs_slow",
                                     "dfs_torn"))]
    # windows: before [s - 10, s), after [e + 0, e + 10) with heal 0 and W 10 s
    got = recovery_ratios(faults, series, window_s=10.0, heal_s=0.0)
    assert [e["ratio_to_before"] for e in got] == [0.7, 1.429, 1.0, 1.0], got
    assert {e["baseline_ms"] for e in got} == {20.0}  # the median of 20, 14, 20, 20
    assert [e["ratio"] for e in got] == [0.7, 1.0, 1.0, 1.0]
    # a slowdown after every fault of a kind still shows: its windows after stay slow
    slow = window(0, 20.0) + window(10, 30.0)
    (e,) = recovery_ratios([faults[0]], slow, window_s=10.0, heal_s=0.0)
    assert e["ratio"] == 1.5
