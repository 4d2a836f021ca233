"""Pending timers at scale: the memory of one subtask holding 10M timers, with the timer index
on the Python heap (``state_backend="heap"``) and in RocksDB (``state_backend="rocksdb"``),
and how fast timers are registered, indexed after a restore, and fired.

Workload, per index kind, each phase in a process of its own (peak RSS is the process's):
1. **register**: one subtask (all key groups of max parallelism 128) registers TIMERS
   processing-time timers, one per key, at scattered times, through the operator's
   :class:`~spark_glue.timers.TimerService`, with a checkpoint every CHUNK timers (the
   changelog persisted, as batches would); then a materialization and a checkpoint.
2. **restore**: a fresh process restores that checkpoint and builds the timer index from the
   timers' state (what a restarted or rescaled subtask does), then fires FIRE of the timers,
   earliest first, with a checkpoint every CHUNK firings.

The heap index runs a smaller count by default (--heap-timers): at ~200 B per timer its
memory is the point, and it grows linearly. Checkpoints go through a CheckpointCoordinator
on file:// (DirectTransport: the state and its index are measured, not the tree). Each
phase's process gets the environment ``spark_glue.start_spark`` gives executors (glibc's
``MALLOC_ARENA_MAX``), as a subtask's Python worker has it.

Run: python -m experiments.timers_scale [--quick] [--timers N] [--heap-timers N] [--fire N]
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from spark_glue.session import DEFAULTS as SPARK_DEFAULTS

from .common import parser, plt, write_results
from .large_state import MAXP, _coordinator  # (one subtask of all 128 key groups)

# what spark_glue.start_spark gives its executors' environment (their Python workers')
EXECUTOR_ENV = {k.removeprefix("spark.executorEnv."): v for k, v in SPARK_DEFAULTS.items()
                if k.startswith("spark.executorEnv.")}
CHUNK = 500_000
T0 = 1_800_000_000_000  # the timers' times: ms since the epoch, spread over a day
SPREAD = 86_400_000


def _rss_mb() -> tuple[float, float]:
    """(current, peak) resident memory of this process in MiB."""
    with open("/proc/self/status") as f:
        cur = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return cur / 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def register(args: dict[str, Any]) -> dict[str, Any]:
    """Phase 1 (in its own process): register the timers, checkpoint, materialize."""
    from spark_glue.timers import PROCESSING, TimerService

    coord, b = _coordinator(args["base"], args["job"], args["kind"], args["local"])
    rss0 = _rss_mb()[0]
    s = TimerService(b, args["kind"], args["local"])
    rng, n = random.Random(7), args["timers"]
    try:
        t0 = time.perf_counter()
        for i in range(n):
            s.register(f"key-{i:09d}", PROCESSING, T0 + rng.randrange(SPREAD))
            if (i + 1) % CHUNK == 0:
                coord.trigger_checkpoint().result()
        coord.trigger_checkpoint().result()
        reg_s = time.perf_counter() - t0
        cur, _peak = _rss_mb()
        t0 = time.perf_counter()
        b.materialize_now()
        cc = coord.trigger_checkpoint().result()
        mat_s = time.perf_counter() - t0
        cur_after, peak = _rss_mb()
        return {"timers": n, "pending": s.live(), "register_s": reg_s,
                "register_per_s": n / reg_s, "materialize_s": mat_s, "rss_start_mb": rss0,
                "rss_mb": cur, "rss_after_materialize_mb": cur_after, "peak_rss_mb": peak,
                "bytes_per_timer": (cur - rss0) * (1 << 20) / n,
                "checkpoint": cc.metadata_url}
    finally:
        s.close()
        coord.shutdown()  # closes the backend; the retained checkpoint stays for phase 2


def restore(args: dict[str, Any]) -> dict[str, Any]:
    """Phase 2 (a fresh process): restore, build the index, fire timers earliest first."""
    from spark_glue.timers import TimerService

    t0 = time.perf_counter()
    coord, b = _coordinator(args["base"], args["job"], args["kind"], args["local"])
    restore_s = time.perf_counter() - t0
    rss0 = _rss_mb()[0]
    t0 = time.perf_counter()
    s = TimerService(b, args["kind"], args["local"])
    build_s = time.perf_counter() - t0
    rss_built = _rss_mb()[0]
    out: dict[str, Any] = {"restore_s": restore_s, "index_build_s": build_s,
                           "indexed": s.live(), "index_build_per_s": s.live() / build_s,
                           "rss_after_build_mb": rss_built,
                           "index_mb": rss_built - rss0}
    try:
        fired, last, in_order, t0 = 0, -1, True, time.perf_counter()
        for timer in s.due(None, T0 + SPREAD):
            in_order &= timer.time_ms >= last
            last = timer.time_ms
            fired += 1
            if fired % CHUNK == 0:
                coord.trigger_checkpoint().result()
            if fired >= args["fire"]:
                break
        coord.trigger_checkpoint().result()
        fire_s = time.perf_counter() - t0
        cur, peak = _rss_mb()
        out.update(fired=fired, fired_in_time_order=in_order, fire_s=fire_s,
                   fire_per_s=fired / fire_s, pending_after=s.live(), rss_mb=cur,
                   peak_rss_mb=peak)
        return out
    finally:
        s.close()
        coord.shutdown()


def _child(phase: str, args: dict[str, Any]) -> dict[str, Any]:
    # the phase's process has the allocator settings of an executor's Python worker
    env = {**os.environ, "MALLOC_ARENA_MAX": EXECUTOR_ENV["MALLOC_ARENA_MAX"]}
    p = subprocess.run([sys.executable, "-m", "experiments.timers_scale", "--phase", phase,
                        "--args", json.dumps(args)], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if p.returncode != 0:
        raise RuntimeError(f"{phase} ({args['kind']}) failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_kind(kind: str, timers: int, fire: int, work: str) -> dict[str, Any]:
    args = {"kind": kind, "timers": timers, "fire": min(fire, timers),
            "base": f"file://{work}/dfs-{kind}", "job": f"timers-{kind}",
            "local": f"{work}/local-{kind}"}
    reg = _child("register", args)
    print(f"{kind}: {timers:,} timers registered at {reg['register_per_s']:,.0f}/s, RSS "
          f"{reg['rss_mb']:.0f} MiB (peak {reg['peak_rss_mb']:.0f})", flush=True)
    res = _child("restore", args)
    print(f"{kind}: index of {res['indexed']:,} built in {res['index_build_s']:.1f} s, "
          f"{res['fired']:,} fired at {res['fire_per_s']:,.0f}/s, peak RSS "
          f"{res['peak_rss_mb']:.0f} MiB", flush=True)
    leftover = os.listdir(args["local"]) if os.path.isdir(args["local"]) else []
    return {"kind": kind, "register": reg, "restore": res,
            "local_dirs_left": [x for x in leftover if x.startswith("dstl-rocksdb-")]}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--timers", type=int, default=10_000_000)
    p.add_argument("--heap-timers", type=int, default=2_000_000)
    p.add_argument("--fire", type=int, default=2_000_000)
    p.add_argument("--phase", choices=["register", "restore"], help=argparse_hidden())
    p.add_argument("--args", help=argparse_hidden())
    a = p.parse_args()
    if a.phase:
        fn = register if a.phase == "register" else restore
        print(json.dumps(fn(json.loads(a.args))), flush=True)
        return
    timers, heap_timers, fire = a.timers, a.heap_timers, a.fire
    if a.quick:
        timers, heap_timers, fire = 200_000, 200_000, 100_000
    work = tempfile.mkdtemp(prefix="timers-scale-")
    try:
        runs = [run_kind("rocksdb", timers, fire, work), run_kind("heap", heap_timers, fire,
                                                                  work)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rocks = runs[0]
    # the headline: the rocksdb index with every timer pending, over both phases
    data = {"pending_timers_per_subtask": rocks["register"]["pending"],
            "peak_rss_mb": max(rocks["register"]["peak_rss_mb"],
                               rocks["restore"]["peak_rss_mb"]),
            "fire_per_s": rocks["restore"]["fire_per_s"],
            "register_per_s": rocks["register"]["register_per_s"],
            "index_build_per_s": rocks["restore"]["index_build_per_s"],
            "target_peak_rss_mb": 512, "max_parallelism": MAXP, "runs": runs}
    data["within_target"] = data["peak_rss_mb"] <= 512
    data["process_env"] = EXECUTOR_ENV
    fig, axes = plt().subplots(1, 2, figsize=(11, 4))
    names = [f"{r['kind']}\n{r['register']['timers'] / 1e6:g}M timers" for r in runs]
    ax = axes[0]
    for i, r in enumerate(runs):
        ax.bar(i - 0.2, r["register"]["peak_rss_mb"], 0.4, color="C0",
               label="peak RSS, registering" if i == 0 else None)
        ax.bar(i + 0.2, r["restore"]["peak_rss_mb"], 0.4, color="C1",
               label="peak RSS, restore + index + firing" if i == 0 else None)
    ax.axhline(512, color="red", ls="--", lw=1, label="512 MiB")
    ax.set_xticks(range(len(runs)), names)
    ax.set_ylabel("MiB")
    ax.set_title("memory of one subtask with pending timers")
    ax.legend(fontsize=8)
    ax = axes[1]
    for i, r in enumerate(runs):
        rates = [r["register"]["register_per_s"], r["restore"]["index_build_per_s"],
                 r["restore"]["fire_per_s"]]
        ax.bar([i - 0.27, i, i + 0.27], rates, 0.27, color=["C0", "C2", "C3"])
    ax.set_xticks(range(len(runs)), names)
    ax.set_ylabel("timers/s")
    ax.set_title("registered (blue), indexed after restore (green), fired (red)")
    write_results("timers_scale", data, fig, a.out)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
