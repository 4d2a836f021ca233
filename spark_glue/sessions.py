"""Session windows with event-time timers: the example of spark_glue.timers (``make demo``,
tests). A user's session is a run of events no more than ``gap`` apart; it closes when the
watermark passes its last event plus the gap (an event-time timer), or when an event arrives
past that point before the watermark did. Closed sessions go to the sink as
``(user, start_ms, end_ms, events)``; open ones are state ``session`` = [start, end, events].

:func:`offline_sessions` computes the same sessions from all input at once, which the
streaming result must equal when events arrive in event-time order (the demo's and the
tests' input).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

SCHEMA = "user STRING, ts LONG"  # ts: event time, ms since the epoch
COLUMNS = ("user", "start_ms", "end_ms", "events")  # a closed session, as the sink gets it


@dataclass(frozen=True)
class Sessions:
    """The update and on_timer functions of session windows of ``gap_ms``: :meth:`update`
    and :meth:`on_timer` for the per-key API, :meth:`update_frame` and
    :meth:`on_timer_frame` for the vectorized one (``api="pandas"``; ``key`` is the key
    column it groups a call's rows by)."""

    gap_ms: int
    key: str = "user"

    def update(self, key: Any, rows: list[Any], state: Any) -> list[tuple[Any, int, int, int]]:
        s, timers = state.value("session"), state.timers
        cur = s.get()
        out = []
        for t in sorted(r["ts"] for r in rows):
            if cur is not None and t - cur[1] > self.gap_ms:  # past the gap: close it now
                timers.delete_event_time(cur[1] + self.gap_ms + 1)
                out.append((key, cur[0], cur[1], cur[2]))
                cur = None
            if cur is None:
                cur = [t, t, 1]
            else:
                timers.delete_event_time(cur[1] + self.gap_ms + 1)
                cur = [cur[0], max(cur[1], t), cur[2] + 1]
            timers.register_event_time(cur[1] + self.gap_ms + 1)
        s.set(cur)
        return out

    def on_timer(self, key: Any, timer: Any, state: Any) -> list[tuple[Any, int, int, int]]:
        s = state.value("session")
        cur = s.get()
        if cur is None:
            return []
        s.clear()
        return [(key, cur[0], cur[1], cur[2])]


    def update_frame(self, keys: Any, rows: Any, state: Any) -> Any:
        """The vectorized API's update: :meth:`update` for each key of the call, on its
        rows, through the key's view of its state and timers (a session is a run of one
        key's events: there is no column-wise shortcut); the sessions it closed as one
        pandas DataFrame of :data:`COLUMNS`."""
        import pandas as pd

        out: list[tuple[Any, int, int, int]] = []
        for key, group in rows.groupby(self.key, sort=False, dropna=False):
            out += self.update(key, group.to_dict("records"), state.key(key))
        return pd.DataFrame(out, columns=list(COLUMNS))

    def on_timer_frame(self, key: Any, timer: Any, state: Any) -> Any:
        """The vectorized API's on_timer: :meth:`on_timer` as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame(self.on_timer(key, timer, state), columns=list(COLUMNS))


def offline_sessions(events: Iterable[tuple[Any, int]], gap_ms: int
                     ) -> tuple[set[tuple[Any, int, int, int]], dict[Any, list[int]]]:
    """The sessions of all ``events`` at once: (every session followed by another of its
    user, {user: its last session [start, end, events]})."""
    by_user: dict[Any, list[int]] = {}
    for user, ts in events:
        by_user.setdefault(user, []).append(ts)
    closed: set[tuple[Any, int, int, int]] = set()
    last: dict[Any, list[int]] = {}
    for user, times in by_user.items():
        times.sort()
        start = end = times[0]
        n = 1
        for t in times[1:]:
            if t - end > gap_ms:
                closed.add((user, start, end, n))
                start, n = t, 0
            end = t
            n += 1
        last[user] = [start, end, n]
    return closed, last


def check_sessions(emitted: Iterable[tuple[Any, int, int, int]], open_now: dict[Any, Any],
                   events: Iterable[tuple[Any, int]], gap_ms: int, watermark_ms: int | None
                   ) -> list[str]:
    """What is wrong (empty: nothing) with a streaming run's sessions, given all its
    ``events`` (in event-time order across micro-batches): the sessions it ``emitted`` and
    those still open in its state must be exactly the offline sessions; every session
    followed by another must have been emitted, and so must every last session whose timer
    ``watermark_ms`` (a watermark every subtask had reached) has passed."""
    closed, last = offline_sessions(events, gap_ms)
    emitted = set(emitted)
    opened = {(u, *v) for u, v in open_now.items()}
    problems = []
    everything = closed | {(u, *v) for u, v in last.items()}
    if emitted & opened:
        problems.append(f"emitted and still open: {sorted(emitted & opened)[:3]}")
    if emitted | opened != everything:
        problems.append(f"sessions differ from the offline ones: missing "
                        f"{sorted(everything - emitted - opened)[:3]}, unexpected "
                        f"{sorted((emitted | opened) - everything)[:3]}")
    due = {(u, *v) for u, v in last.items()
           if watermark_ms is not None and v[1] + gap_ms + 1 <= watermark_ms}
    if not (closed | due) <= emitted:
        problems.append(f"not emitted although closed: {sorted((closed | due) - emitted)[:3]}")
    return problems
