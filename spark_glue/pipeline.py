"""The main job's pieces: generated user events, the per-user update function, and the plain
batch recomputation the streaming result is checked against (``make demo``, tests, bench)."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

SCHEMA = "user STRING, amount LONG"
BUCKET = 25  # histogram bucket width of amounts

# Spark's file source orders new files by modification time in milliseconds and breaks ties
# by directory listing order, which is no order at all (a hashed directory lists
# events-00005 before events-00004). Files written back to back often share a millisecond, so
# each published file gets a modification time at least this far past the previous one.
MTIME_STEP_NS = 10_000_000
_published = threading.Lock()
_last_mtime_ns: dict[Path, int] = {}


def publish(tmp: Path, final: Path) -> None:
    """Make the complete file ``tmp`` visible as ``final`` (a rename: a file source never sees
    it half-written), with a modification time later, by at least ``MTIME_STEP_NS``, than any
    file published in that folder before by this process, so the file source reads the
    folder's files in the order they were published."""
    with _published:
        folder = final.parent.resolve()
        t = max(time.time_ns(), _last_mtime_ns.get(folder, 0) + MTIME_STEP_NS)
        _last_mtime_ns[folder] = t
    os.utime(tmp, ns=(t, t))  # a rename keeps the file's modification time
    tmp.rename(final)


def write_event_file(folder: Path, index: int, events: int, users: int, seed: int,
                     event_time_ms: int | None = None, span_ms: int = 1000) -> int:
    """Write ``events`` JSON events as ``events-{index}.json`` (:func:`publish`: the file
    source sees complete files, in the order they were written); returns the number written.
    With ``event_time_ms``, each event has an event time ``ts`` (ms) in ``[event_time_ms,
    event_time_ms + span_ms)``, the file's events in time order."""
    rng = random.Random(seed * 1_000_003 + index)
    evs = [{"user": f"u{rng.randrange(users)}", "amount": rng.randint(1, 100)}
           for _ in range(events)]
    if event_time_ms is not None:
        for e, t in zip(evs, sorted(event_time_ms + rng.randrange(span_ms) for _ in evs),
                        strict=True):
            e["ts"] = t
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".events-{index:05d}.tmp"
    tmp.write_text("\n".join(json.dumps(e) for e in evs) + "\n")
    publish(tmp, folder / f"events-{index:05d}.json")
    return events


def json_lines(files: Iterable[Path]) -> Iterator[Any]:
    """The JSON values of ``files``' lines, files in name order (event files, sink output)."""
    for f in sorted(files):
        for line in f.read_text().splitlines():
            if line:
                yield json.loads(line)


def write_distinct_key_file(folder: Path, index: int, keys: int, seed: int) -> int:
    """Write ``keys`` events of ``keys`` distinct users (``k0000000``...) as
    ``events-{index}.json`` (:func:`publish`): one micro-batch of that many keys; returns
    the number written."""
    rng = random.Random(seed * 1_000_003 + index)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".events-{index:05d}.tmp"
    with open(tmp, "w") as f:
        for i in range(keys):
            f.write(f'{{"user": "k{i:07d}", "amount": {rng.randint(1, 100)}}}\n')
    publish(tmp, folder / f"events-{index:05d}.json")
    return keys


def count_and_sum(key: Any, rows: list[Any], state: Any) -> list[tuple[Any, int, int]]:
    """Per user: event count and amount sum (ValueState) and a histogram of amounts by bucket
    (MapState); emits (user, count, sum) for the sink."""
    count, total = state.value("count"), state.value("sum")
    count.set(count.get(0) + len(rows))
    total.set(total.get(0) + sum(r["amount"] for r in rows))
    hist = state.map("hist")
    for r in rows:
        b = r["amount"] // BUCKET
        hist.put(b, hist.get(b, 0) + 1)
    return [(key, count.get(), total.get())]


def recompute(spark: Any, folder: Path | str) -> dict[str, dict[Any, Any]]:
    """The same result as a plain Spark batch job over all input, shaped like
    :meth:`KeyedStatefulOperator.state`: {"count": {user: n}, "sum": {...}, "hist": {...}}."""
    from pyspark.sql import functions as F

    df = spark.read.schema(SCHEMA).json(str(folder))
    agg = df.groupBy("user").agg(F.count("*").alias("n"), F.sum("amount").alias("s")).collect()
    hist_rows = (df.withColumn("b", F.floor(F.col("amount") / BUCKET).cast("long"))
                 .groupBy("user", "b").count().collect())
    hist: dict[Any, dict[Any, int]] = {}
    for r in hist_rows:
        hist.setdefault(r["user"], {})[r["b"]] = r["count"]
    return {"count": {r["user"]: r["n"] for r in agg},
            "sum": {r["user"]: r["s"] for r in agg}, "hist": hist}


def diff(got: dict[str, dict[Any, Any]], want: dict[str, dict[Any, Any]], limit: int = 5
         ) -> list[str]:
    """Human-readable differences (empty when equal)."""
    out = []
    for name in sorted(set(got) | set(want)):
        g, w = got.get(name, {}), want.get(name, {})
        for k in sorted(set(g) | set(w), key=str):
            if g.get(k) != w.get(k):
                out.append(f"{name}[{k}]: state {g.get(k)!r}, recomputation {w.get(k)!r}")
                if len(out) >= limit:
                    return out
    return out
