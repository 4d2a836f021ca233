"""Session windows (spark_glue.sessions) through both update APIs, without Spark: the
vectorized one (``update_frame`` / ``on_timer_frame``, ``api="pandas"``) closes exactly the
sessions the per-key one closes, and both equal the offline sessions of all input, on a
real backend with its timers (tests/spark/test_timers.py runs the per-key API on RayDP)."""

from __future__ import annotations

import random

import pyarrow as pa

from spark_glue.routing import group_by_key
from spark_glue.sessions import COLUMNS, Sessions, check_sessions
from spark_glue.timers import TimerContext, TimerService
from spark_glue.vectorized import apply_pandas
from spark_glue.worker import apply_rows, fire_timers

from ..ckpt_util import new_base
from .test_timers import backend, spec

GAP = 1_000


def _events(seed: int) -> list[list[tuple[str, int]]]:
    """Eight batches of events in event-time order, gaps of up to 3 s between a user's."""
    rng, t, batches = random.Random(seed), 0, []
    for _ in range(8):
        batch = []
        for _ in range(rng.randint(0, 12)):
            t += rng.choice((10, 50, 400, 1_500, 3_000))
            batch.append((f"u{rng.randint(0, 4)}", t))
        batches.append(batch)
    return batches


def _run(api: str, batches: list[list[tuple[str, int]]]) -> tuple[list[tuple], dict, int]:
    sessions = Sessions(GAP)
    b = backend(new_base())
    try:
        service, emitted, seen = TimerService(b), [], None
        for batch in batches:
            table = pa.table({"user": [u for u, _ in batch], "ts": [t for _, t in batch]},
                             schema=pa.schema([("user", pa.string()), ("ts", pa.int64())]))
            groups = group_by_key(table, "user")
            if batch:
                seen = max(seen or 0, max(t for _, t in batch))
            ctx = TimerContext(service, seen, 0)  # the watermark: the largest time seen
            if api == "pandas":
                outs = [apply_pandas(sessions.update_frame, groups, b, {}, ctx)]
                outs += [pa.Table.from_pandas(f).to_pylist() for f in fire_timers(
                    spec(api="pandas", on_timer=sessions.on_timer_frame), ctx, b, {})]
                for out in outs:
                    rows = out if isinstance(out, list) else (
                        pa.ipc.open_stream(out).read_all().to_pylist() if out else [])
                    emitted += [tuple(r[c] for c in COLUMNS) for r in rows]
            else:
                emitted += apply_rows(sessions.update, groups, b, {}, ctx)
                emitted += fire_timers(spec(on_timer=sessions.on_timer), ctx, b, {})
        return emitted, b.dump().get("session", {}), seen
    finally:
        b.close()


def test_the_vectorized_sessions_equal_the_per_key_ones_and_the_offline_ones():
    for seed in range(5):
        batches = _events(seed)
        events = [e for batch in batches for e in batch]
        by_rows, open_rows, seen = _run("rows", batches)
        by_frames, open_frames, _ = _run("pandas", batches)
        assert sorted(by_frames) == sorted(by_rows), seed
        assert open_frames == open_rows
        assert check_sessions(by_frames, open_frames, events, GAP, seen) == [], seed
        assert by_rows, seed  # some session closed
