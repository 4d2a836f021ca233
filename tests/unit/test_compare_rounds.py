"""``make compare --rounds R`` (experiments.vs_flink): each node count runs every system and
input R times, alternating, and its row is the median round's, so one slow minute of this
machine does not make the published ratio."""

from __future__ import annotations

from typing import Any

from experiments.vs_flink import median_row


def _run(e2e: float, ack: float = 1.0, changes: int = 30) -> dict[str, Any]:
    return {"e2e_ms": {"p50": e2e}, "ack_ms": {"p50": ack}, "checkpoints_with_changes": changes}


def test_the_row_is_the_median_rounds_per_input() -> None:
    rounds = [{"bursts": (_run(30), _run(10)), "even": (_run(20), _run(40))},   # 3.0, 0.5
              {"bursts": (_run(12), _run(12)), "even": (_run(10), _run(40))},   # 1.0, 0.25
              {"bursts": (_run(8), _run(16)), "even": (_run(30), _run(30))}]    # 0.5, 1.0
    row = median_row(2, rounds, {"flushes": 3})
    assert row["ratios"]["e2e_over_flink"] == 1.0
    assert row["ratios"]["even_e2e_over_flink_even"] == 0.5
    assert row["dstl_ray"]["e2e_ms"]["p50"] == 12 and row["flink"]["e2e_ms"]["p50"] == 12
    assert row["dstl_ray"]["even_input"]["e2e_ms"]["p50"] == 20
    assert row["flink_even"]["e2e_ms"]["p50"] == 40
    assert row["dstl_ray"]["trace"] == {"flushes": 3} and row["rounds"] == 3
    assert [r["e2e_over_flink"] for r in row["per_round"]["bursts"]] == [3.0, 1.0, 0.5]


def test_an_even_count_takes_the_lower_middle_and_one_round_is_itself() -> None:
    two = [{"bursts": (_run(30), _run(10))}, {"bursts": (_run(10), _run(10))}]
    assert median_row(1, two, {})["ratios"]["e2e_over_flink"] == 1.0
    one = median_row(1, [{"bursts": (_run(9), _run(18))}], {})
    assert one["ratios"]["e2e_over_flink"] == 0.5 and "flink_even" not in one


def test_without_flink_the_ratios_are_none_and_even_alone_is_the_row() -> None:
    row = median_row(4, [{"even": (_run(25), None)}], {})
    assert row["dstl_ray"]["e2e_ms"]["p50"] == 25 and "even_input" not in row["dstl_ray"]
    assert row["ratios"] == {"e2e_over_flink": None, "ack_over_flink": None,
                             "even_e2e_over_flink_even": None}
