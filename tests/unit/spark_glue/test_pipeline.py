"""The event files' publication order: Spark's file source orders new files by modification
time in milliseconds and breaks ties by directory listing order, so files written back to back
must not share a millisecond (session windows over them would see events out of order)."""

from __future__ import annotations

import json

from spark_glue.pipeline import MTIME_STEP_NS, json_lines, write_distinct_key_file, write_event_file


def _mtimes_ms(folder):
    return [f.stat().st_mtime_ns // 1_000_000 for f in sorted(folder.glob("events-*.json"))]


def test_files_written_back_to_back_have_increasing_millisecond_mtimes(tmp_path):
    for i in range(30):
        write_event_file(tmp_path, i, 3, 2, seed=1, event_time_ms=1000 * i, span_ms=1000)
    ms = _mtimes_ms(tmp_path)
    assert len(ms) == 30
    assert all(b - a >= MTIME_STEP_NS // 1_000_000 for a, b in zip(ms, ms[1:], strict=False))
    # what a file source reads, in modification-time order, is in event-time order
    by_mtime = sorted(tmp_path.glob("events-*.json"), key=lambda f: f.stat().st_mtime_ns)
    ts = [json.loads(line)["ts"] for f in by_mtime for line in f.read_text().splitlines()]
    assert ts == sorted(ts)
    assert not list(tmp_path.glob(".*.tmp"))  # every temporary file was renamed


def test_key_files_and_a_later_batch_of_files_keep_the_order(tmp_path):
    for i in range(5):
        write_distinct_key_file(tmp_path, i, 4, seed=2)
    for i in range(5, 10):
        write_event_file(tmp_path, i, 2, 2, seed=3)
    ms = _mtimes_ms(tmp_path)
    assert ms == sorted(ms) and len(set(ms)) == 10
    assert len(list(json_lines(tmp_path.glob("events-*.json")))) == 5 * 4 + 5 * 2
