"""Where a run's checkpoint triggers fell against its input's bursts (``vs_flink``'s bursts
input: each second's rows at once, as Flink's SQL ``datagen`` emits them).

On bursts, the p50 of a run's checkpoint durations falls between two kinds of checkpoint:
those with no changes to persist and those a burst gave changes, which take several times as
long. A burst gives changes to the first checkpoint after it starts and, if a trigger falls
while it is still being applied, to one more. The trigger schedule (every interval from the
loop's start) and the bursts (every whole second from the generators' start) keep one phase
for a whole run, so a run whose bursts last ``D`` ms has a trigger inside most of its bursts
or inside almost none, with a chance of about ``D / interval`` for the first: the count of
checkpoints with changes, and with it the p50, is a draw per run. These figures say which
draw a run got."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence


def merge_windows(windows: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as disjoint ones in time order (the subtasks'
    bursts of one second overlap: together they are the second's burst)."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(windows):
        if end < start:
            raise ValueError(f"a window ends before it starts: {(start, end)}")
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def triggers_inside(triggers: Iterable[float], windows: Sequence[tuple[float, float]]) -> int:
    """How many of ``triggers`` (times) fell inside one of ``windows`` (disjoint, in time
    order: :func:`merge_windows`), start included, end excluded."""
    starts = [s for s, _ in windows]
    n = 0
    for t in triggers:
        i = bisect.bisect_right(starts, t) - 1
        n += i >= 0 and t < windows[i][1]
    return n


def burst_phase(triggers: Sequence[float], bursts: Iterable[tuple[float, float]]
                ) -> dict[str, object]:
    """A run's bursts (every subtask's ``(start, end)``, wall clock) against its checkpoint
    triggers (wall clock): each second's burst in ms (from its first subtask's start to its
    last one's end) and how many triggers fell inside one, of how many in the bursts' span."""
    windows = merge_windows(bursts)
    if not windows:
        return {"bursts": 0, "burst_ms": [], "triggers": 0, "triggers_inside": 0}
    span = [t for t in triggers if windows[0][0] <= t < windows[-1][1]]
    return {"bursts": len(windows),
            "burst_ms": sorted(round((e - s) * 1000, 1) for s, e in windows),
            "triggers": len(span), "triggers_inside": triggers_inside(span, windows)}
