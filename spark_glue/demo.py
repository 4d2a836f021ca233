"""``make demo`` / ``dstl-ray demo``: the main job, a stateful PySpark stream on RayDP.

Starts a local Ray cluster of 3 nodes (``ray.cluster_utils.Cluster``), deploys the changelog
tree on ``file://`` under ./demo-data, and runs a Structured Streaming pipeline on RayDP
(3 executors spread over the nodes): generated user events arrive as files; per-user counts,
sums and amount histograms are kept by :class:`KeyedStatefulOperator`, one checkpoint per
micro-batch, with periodic materialization. Half-way it kills the node actor that the most
tasks used and a Spark executor, measures how long until the next checkpoint completes, and
compares the checkpoint latency before the failure with that once the cluster has healed.
Each user's events also form session windows (a gap of 3 s of event time closes one), closed
by event-time timers (spark_glue.timers). At the end the state of the last checkpoint,
restored from storage, must equal a plain Spark batch recomputation over all input, and the
sessions emitted plus those still open must equal the offline sessions of all input; the
demo exits non-zero if either does not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dstl_ray.plotting import pyplot

from .pipeline import SCHEMA, count_and_sum, diff, json_lines, recompute, write_event_file
from .sessions import Sessions, check_sessions
from .state_reader import read_state
from .stats import totals

NS = "dstl_demo"
T0_MS = 1_700_000_000_000  # event time of the first file; each file is one second later
SESSION_GAP_MS, ALLOWED_DELAY_S = 3_000, 2.0
SESSIONS = Sessions(SESSION_GAP_MS)


def update(key: Any, rows: list[Any], state: Any) -> list[Any]:
    """The demo's update: per-user totals (spark_glue.pipeline) and session windows."""
    return ([("totals", *o) for o in count_and_sum(key, rows, state)]
            + [("session", *o) for o in SESSIONS.update(key, rows, state)])


def on_timer(key: Any, timer: Any, state: Any) -> list[Any]:
    """A session's event-time timer fired: the session closes."""
    return [("session", *o) for o in SESSIONS.on_timer(key, timer, state)]


@contextlib.contextmanager
def _terminal_only_progress(log: Path, quiet: bool) -> Iterator[Callable[[str], None]]:
    """Send this process's stdout and stderr, and those of every process it starts from
    now on (Ray's, the Spark JVM's), to ``log``; yield a function that prints a progress
    line on the terminal (and into the log). ``quiet=False`` leaves output as it is."""
    if not quiet:
        yield lambda line: print(line, flush=True)
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    term = os.fdopen(os.dup(1), "w", buffering=1)
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)

    def say(line: str) -> None:
        term.write(line + "\n")
        print(line, flush=True)  # into the log, between the lines it explains

    try:
        yield say
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        term.close()


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def recovery_latency(history: list[Any], fail_at: float | None, window_s: float = 30.0
                     ) -> dict[str, Any]:
    """Checkpoint latency before the failure and after recovery ("Recovery restores speed
    too"). "Before" is the checkpoints of the ``window_s`` before the failure, the first
    batch left out (it pays the query's warm-up: seconds, where later ones take ms). The
    cluster has healed at the first checkpoint after the failure whose subtasks ran on as
    many executors as the last one before it (the node actor restarted, the replacement
    executor took its share: ``spark_glue.placement``); "after recovery" is the checkpoints
    of the ``window_s`` after that one (all of them in a shorter run)."""
    before = [s for s in history[1:] if fail_at is None
              or fail_at - window_s <= s.finished_at <= fail_at] or history[:1]
    out: dict[str, Any] = {
        "checkpoint_ms_p50_before_failure": _p50_ms(before),
        "checkpoint_ms_p50_after_recovery": None, "healed_s": None,
        "checkpoints_after_recovery": 0}
    after = [s for s in history if fail_at is not None and s.finished_at > fail_at]
    if not after:
        return out
    spread = len(set(before[-1].executors.values())) if before else 0
    healed = next((s for s in after if len(set(s.executors.values())) >= spread), after[0])
    window = [s for s in after if healed.finished_at < s.finished_at
              <= healed.finished_at + window_s]
    out.update(checkpoint_ms_p50_after_recovery=_p50_ms(window),
               healed_s=round(healed.finished_at - fail_at, 2),
               checkpoints_after_recovery=len(window))
    return out


def _p50_ms(batches: list[Any]) -> float | None:
    return round(_pct([s.checkpoint_s * 1000 for s in batches], 0.5), 1) if batches else None


def _plot(history: list[Any], t0: float, fail_at: float | None, out: Path) -> None:
    plt = pyplot("dstl-ray demo (the latency plot)")
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([s.finished_at - t0 for s in history], [s.checkpoint_s * 1000 for s in history],
            "o-", ms=3, label="checkpoint (persist + metadata)")
    ax.plot([s.finished_at - t0 for s in history], [s.batch_s * 1000 for s in history],
            ".", alpha=0.5, label="whole micro-batch")
    if fail_at is not None:
        ax.axvline(fail_at - t0, color="red", ls="--", label="node actor + executor killed")
    ax.set_xlabel("time since the stream started (s)")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_title("dstl-ray demo: per-micro-batch checkpoint latency (3 Ray nodes, RayDP)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run_pipeline_demo(args: argparse.Namespace) -> int:
    pyplot("dstl-ray demo (the latency plot)")  # before minutes of work, not after
    if args.hosts and not args.ray_address:  # the hosts' owner; the demo runs in the first
        from dstl_ray.local.hosts import rerun_on_hosts

        return rerun_on_hosts(args.hosts, [sys.executable, "-m", "dstl_ray.cli.main"])
    base = Path(os.path.abspath(args.base_path or "demo-data"))
    shutil.rmtree(base, ignore_errors=True)
    log = base / "logs" / "demo.log"
    with _terminal_only_progress(log, not args.verbose) as say:
        if not args.verbose:
            say(f"[demo] logs of Ray, Spark and its JVM go to {log} (--verbose: here)")
        return _run(args, base, say)


def _run(args: argparse.Namespace, base: Path, say: Callable[[str], None]) -> int:
    import ray

    from dstl_ray import ChangelogConfig, deploy
    from dstl_ray.local import start_local_cluster

    from .operator import KeyedStatefulOperator
    from .session import executor_hosts, kill_executor, start_spark, stop_spark

    src, out_dir = base / "input", base / "output"
    out_dir.mkdir(parents=True)
    cluster, hosts = None, 1
    if args.ray_address:  # --hosts N: a Ray node on every host, this driver on the first
        ray.init(address=args.ray_address, namespace=NS, log_to_driver=False)
        hosts = sum(n["Alive"] for n in ray.nodes())
        say(f"[demo] joined the Ray cluster of {hosts} hosts at {args.ray_address}; "
            f"data under {base}")
    else:
        say(f"[demo] starting a local Ray cluster of 3 nodes; data under {base}")
        cluster = start_local_cluster(3, 1, NS)
    executors = hosts if args.ray_address else 3  # one per Ray node
    spark = None
    stop = threading.Event()
    try:
        tree = deploy(f"file://{base}/dstl", ChangelogConfig(namespace=NS, persist_delay_s=0.2),
                  detached=False)
        say(f"[demo] changelog tree: {len(tree.status())} node actors on file://{base}/dstl")
        spark = start_spark("dstl-demo", num_executors=executors, executor_cores=1,
                            executor_memory="512M")
        say(f"[demo] Spark on RayDP: {executors} executors spread over the Ray nodes")

        def sink(batch_id: int, outputs: list[Any]) -> None:  # idempotent by batch id
            tmp = out_dir / f".batch-{batch_id:06d}.tmp"
            tmp.write_text("\n".join(json.dumps(o) for o in outputs) + "\n")
            tmp.rename(out_dir / f"batch-{batch_id:06d}.jsonl")

        op = KeyedStatefulOperator("demo-job", key="user", update=update, on_timer=on_timer,
                                   event_time="ts", allowed_delay=ALLOWED_DELAY_S,
                                   namespace=NS, parallelism=args.parallelism, max_parallelism=128,
                                   materialization_interval=args.materialization_interval,
                                   sink=sink,
                                   history_limit=None)  # a bounded run: summarize every batch
        produced = [0]

        def generate() -> None:
            i = 0
            while not stop.is_set():
                produced[0] += write_event_file(src, i, args.events_per_file, args.users, 42,
                                                event_time_ms=T0_MS + 1000 * i)
                i += 1
                stop.wait(args.file_interval)

        # the source needs its folder
        write_event_file(src, 10**4, 1, args.users, 42, event_time_ms=T0_MS - 1000)
        gen = threading.Thread(target=generate, daemon=True, name="demo-events")
        gen.start()
        q = (spark.readStream.schema(SCHEMA + ", ts LONG").option("maxFilesPerTrigger", 4)
             .json(str(src))
             .writeStream.foreachBatch(op).option("checkpointLocation", str(base / "spark-chk"))
             .start())
        t0 = time.time()
        fail_at: float | None = None
        killed: tuple[str, str] | None = None
        last_print = 0.0
        def measured() -> bool:
            """The failure came, the tree healed, and the window after it is over."""
            if fail_at is None:
                return False
            healed = recovery_latency(list(op.history), fail_at)["healed_s"]
            return healed is not None and time.time() >= fail_at + healed + args.window

        # run for the duration, and with a failure until the window after the tree healed
        # is over (bounded); the failure comes half-way, once the checkpoints before it
        # are enough for a p50 (the first batch, the query's warm-up, left out)
        while time.time() - t0 < args.duration or (
                args.inject and not measured() and time.time() - t0 < args.duration + 180):
            if q.exception() is not None:
                raise RuntimeError(f"the stream failed: {q.exception()}")
            now = time.time()
            if (fail_at is None and args.inject and now - t0 >= args.duration / 2
                    and len(op.history) >= 1 + args.before_checkpoints):
                used = Counter(n for s in op.history for n in s.nodes.values())
                node = used.most_common(1)[0][0]
                ray.kill(ray.get_actor(node, namespace=NS), no_restart=False)
                killed = (node, kill_executor() or "none found")
                fail_at = time.time()
                say(f"[demo] t={fail_at - t0:4.0f}s FAILURE: killed node actor {node} and "
                    f"executor {killed[1]}")
            if now - last_print >= 5 and op.history:
                h = op.history
                lat = [s.checkpoint_s * 1000 for s in h[-10:]]
                say(f"[demo] t={now - t0:4.0f}s batches={len(h):3d} "
                    f"rows={sum(s.rows for s in h):7d} events-produced={produced[0]:7d} "
                    f"checkpoint p50 (last 10)={statistics.median(lat):6.1f} ms")
                last_print = now
            time.sleep(0.5)
        stop.set()
        gen.join()
        say("[demo] input stopped; draining the stream")
        q.processAllAvailable()
        h = op.history

        def shown() -> list[dict[str, Any]]:  # each batch's metrics in the query's progress
            return [p["observedMetrics"][op.progress.name] for p in q.recentProgress
                    if op.progress.name in p.get("observedMetrics", {})]

        deadline = time.time() + 10  # the last batch's progress event reaches the listener
        while time.time() < deadline and (not shown() or h and shown()[-1] != h[-1].metrics()):
            time.sleep(0.2)
        q.stop()
        shown_metrics = shown()
        recovery_s = None
        if fail_at is not None:
            after = [s for s in h if s.finished_at > fail_at]
            recovery_s = (after[0].finished_at - fail_at) if after else None
        say("[demo] checking the last checkpoint's state against a batch recomputation")
        got = op.state()
        want = recompute(spark, src)
        problems = diff({name: got.get(name, {}) for name in want}, want)
        say("[demo] checking the session windows against the offline sessions of all input")
        sessions = _sessions(op, out_dir, src, got)
        problems += sessions.pop("problems")
        say("[demo] reading the final state back as DataFrames (spark_glue.read_state)")
        read_back = {name: _read_back(spark, op, name) for name in ("count", "sum", "hist")}
        problems += [f"read_state({name!r}) differs from the operator's state"
                     for name, rows in read_back.items() if rows != got.get(name, {})]
        st = tree.status()
        lat = [s.checkpoint_s * 1000 for s in h]
        summary = {
            "batches": len(h), "checkpoints": len(h), "replayed_batches": sum(s.replayed
                                                                              for s in h),
            "rows": sum(s.rows for s in h), "users": len(want["count"]),
            "checkpoint_ms_p50": round(_pct(lat, 0.5), 1),
            "checkpoint_ms_p99": round(_pct(lat, 0.99), 1),
            "batch_ms_p50": round(_pct([s.batch_s * 1000 for s in h], 0.5), 1),
            "restore_ms_p50": round(_pct([s.restore_s * 1000 for s in h], 0.5), 1),
            "apply_ms_p50": round(_pct([s.apply_s * 1000 for s in h], 0.5), 1),
            "changelog_files": sum(s["files_flushed"] for s in st),
            "changelog_bytes": sum(s["bytes_flushed"] for s in st),
            "files_per_checkpoint": round(sum(s["files_flushed"] for s in st) / max(1, len(h)),
                                          2),
            "task_retries": sum(s.retries for s in h), "backend_restores": sum(s.restores
                                                                               for s in h),
            "killed": list(killed) if killed else None,
            "hosts": hosts, "executor_hosts": executor_hosts(spark),
            "recovery_s": round(recovery_s, 2) if recovery_s is not None else None,
            **recovery_latency(list(h), fail_at, args.window),
            "state_matches_recomputation": not problems,
            "state_reader_rows": sum(len(v) for v in read_back.values()),
            "metrics": totals(h),  # the operator's counts (spark_glue.stats)
            # query.lastProgress["observedMetrics"]: the last batch's, and how many of the
            # progress updates Spark keeps (recentProgress) carried them
            "last_progress_metrics": shown_metrics[-1] if shown_metrics else None,
            "progress_updates_with_metrics": len(shown_metrics),
            **sessions,
        }
        op.close()
        say("\n[demo] summary")
        width = max(len(k) for k in summary)
        for k, v in summary.items():
            say(f"  {k:<{width}}  {v}")
        (base / "summary.json").write_text(json.dumps(summary, indent=2))
        png = base / "checkpoint_latency.png"
        _plot(h, t0, fail_at, png)
        say(f"[demo] wrote {png} and {base / 'summary.json'}")
        if problems:
            say("[demo] FAILED: the state differs from the recomputation:")
            for p in problems:
                say(f"    {p}")
            return 1
        if args.inject and recovery_s is None:
            say("[demo] FAILED: no checkpoint completed after the failure")
            return 1
        say("[demo] OK: the state equals the batch recomputation of all input")
        return 0
    finally:
        stop.set()
        if spark is not None:
            stop_spark()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def _sessions(op: Any, out_dir: Path, src: Path, state: dict[str, Any]) -> dict[str, Any]:
    """The session windows: those the sink got (the last output of every batch) and those
    open in the state, against the offline sessions of every input event."""
    emitted = [tuple(o[1:]) for o in json_lines(out_dir.glob("batch-*.jsonl"))
               if o[0] == "session"]
    events = [(e["user"], e["ts"]) for e in json_lines(src.glob("events-*.json"))]
    snaps = op.coordinator.latest_checkpoint().metadata.snapshots
    # the watermark every subtask had reached in the last batch (spark_glue.timers)
    watermark = min(s.event_time_ms for s in snaps) - int(ALLOWED_DELAY_S * 1000)
    problems = check_sessions(emitted, state.get("session", {}), events, SESSION_GAP_MS,
                              watermark)
    if len(emitted) != len(set(emitted)):
        problems.append("a session was emitted twice")
    return {"sessions_closed": len(emitted), "sessions_open": len(state.get("session", {})),
            "sessions_match_offline": not problems, "problems": problems}


def _read_back(spark: Any, op: Any, name: str) -> dict[Any, Any]:
    """State ``name`` of the operator's latest checkpoint, read by the state reader and
    shaped as :meth:`KeyedStatefulOperator.state` shapes it."""
    out: dict[Any, Any] = {}
    for r in read_state(spark, op, name).collect():
        if "user_key" in r.asDict():
            out.setdefault(r["key"], {})[r["user_key"]] = r["value"]
        else:
            out[r["key"]] = r["value"]
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-path", default=None, help="default: ./demo-data")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of input (60)")
    p.add_argument("--events-per-file", type=int, default=1000)
    p.add_argument("--parallelism", type=int, default=3, help="operator subtasks (3)")
    p.add_argument("--file-interval", type=float, default=0.5, help="seconds between files")
    p.add_argument("--users", type=int, default=5000)
    p.add_argument("--materialization-interval", type=float, default=10.0)
    p.add_argument("--verbose", action="store_true",
                   help="Ray, Spark and JVM logs on the terminal (default: a log file)")
    p.add_argument("--window", type=float, default=30.0,
                   help="seconds of checkpoints before the failure and after the tree healed "
                        "that give the p50s before and after (30)")
    p.add_argument("--before-checkpoints", type=int, default=10,
                   help="checkpoints (after the first) the failure waits for (10)")
    p.add_argument("--hosts", type=int, default=0,
                   help="run on N hosts of their own: network namespaces with their own IPs "
                        "and a Ray node each, one executor per host (needs root; default: "
                        "a local 3-node cluster)")
    p.add_argument("--ray-address", default="", help=argparse.SUPPRESS)  # a host's driver
    p.add_argument("--no-failure", dest="inject", action="store_false",
                   help="do not kill a node actor and an executor half-way")
