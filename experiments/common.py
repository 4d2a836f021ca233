"""Shared helpers of the experiments: argument parsing, percentiles, writing JSON + PNG."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import time
from typing import Any

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def run_in_group(cmd: list[str], log: str, timeout_s: float, env: dict[str, str],
                 cwd: str) -> int | None:
    """Run ``cmd`` in a process group of its own (output to ``log``) and return its exit
    code (None: killed at ``timeout_s``). Whatever of the group outlives it goes too: a
    Spark JVM was seen hanging on at half a core after its Python process had exited, and
    would slow every later measurement."""
    with open(log, "wb") as logf:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        rc: int | None = None
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:  # (an interrupt too: the group is in a session of its own, no SIGINT)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rc


def parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--quick", action="store_true", help="a CI-sized run")
    p.add_argument("--out", default=RESULTS, help="directory for NAME.json and NAME.png")
    return p


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values) if values else float("nan")}


def machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "cpus": os.cpu_count(),
            "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_results(name: str, data: dict[str, Any], fig: Any, out: str = RESULTS) -> str:
    os.makedirs(out, exist_ok=True)
    data = {"experiment": name, "machine": machine(), **data}
    path = os.path.join(out, f"{name}.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
    if fig is not None:  # None: the experiment drew its PNG(s) itself
        fig.savefig(os.path.join(out, f"{name}.png"), dpi=110, bbox_inches="tight")
    print(f"wrote {path} and {name}.png", flush=True)
    return path


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def count_at_rate(state: Any, keys: list[Any], rng: Any, rate: float, stop: Any,
                  mailbox: Any, batch: int = 100, burst_from: float | None = None,
                  bursts: list[tuple[float, float]] | None = None) -> None:
    """Increment random ``keys`` of ValueState ``state`` at ``rate`` updates/s until ``stop``
    is set, ``batch`` at a time under ``mailbox`` (like a Flink task's mailbox: the
    checkpoint barrier takes turns with the records).

    Evenly spread by default. With ``burst_from`` (a ``time.time()``), the way Flink's SQL
    ``datagen`` source emits: each second's ``rate`` updates as fast as they go, then a sleep
    until the next whole second after ``burst_from`` (its ``DataGeneratorSource.run``: a
    loop of ``rowsPerSecond`` collects, then ``Thread.sleep`` until ``nextReadTime += 1000``).
    Each burst's wall-clock ``(start, end)`` is appended to ``bursts`` if given (the latest
    10,000: :mod:`experiments.burst_phase`).
    """
    if burst_from is not None:
        per_second, tick = int(rate), burst_from
        while not stop.is_set():
            began = time.time()
            for start in range(0, per_second, batch):
                with mailbox:
                    for _ in range(min(batch, per_second - start)):
                        k = rng.choice(keys)
                        state.update(k, state.value(k, 0) + 1)
                # between two chunks, mail first (a Flink task's mailbox takes a barrier
                # between records): give up the interpreter, so a waiting barrier gets the
                # mailbox instead of this loop taking it straight back
                time.sleep(0)
            if bursts is not None:
                bursts.append((began, time.time()))
                del bursts[:-10_000]
            tick += 1.0
            stop.wait(max(0.0, tick - time.time()))
        return
    t0, n = time.perf_counter(), 0
    while not stop.is_set():
        with mailbox:
            for _ in range(batch):
                k = rng.choice(keys)
                state.update(k, state.value(k, 0) + 1)
        n += batch
        ahead = n / rate - (time.perf_counter() - t0)
        if ahead > 0:
            time.sleep(ahead)
