"""State larger than memory: the heap and rocksdb state tables side by side, with Spark's own
RocksDB state store on the same data where it can be run (FLIP-158 is "generalized"
incremental checkpoints: the changelog over any state backend; its target is "TBs of state").

Workload: KEYS keys (20M; --quick 400k) of 100-byte values over parallelism 4 (four
processes, one subtask each: a quarter of the keys), loaded, materialized, then ROUNDS rounds
that each update 1% of the keys, take a checkpoint (the changelog persisted) and materialize
(heap: the whole state as one file; rocksdb: the SST files not uploaded before). Per table:
checkpoint p50/p99, bytes uploaded per materialization against the bytes changed since the
last one, peak RSS per subtask (each subtask in a process of its own), recovery time of one
subtask from its last checkpoint (materialized state + changelog, in a fresh process) and
changelog replay MB/s. Checkpoints go through a CheckpointCoordinator per subtask on file://
(DirectTransport: the state tables are measured, not the tree), so superseded files are
deleted as in a job.

Like for like with Spark (issue "large state, like for like"): the ``dstl-ray-operator-rocksdb``
row is the Spark operator itself (:mod:`experiments.large_state_operator`: RayDP, the same
input files, batches and query restart as Spark's side), next to Spark's row; both give
``batch_ms_p50`` (update batches) and ``restart_first_batch_ms`` (the first batch after the
query is restarted) by the same definition, and the last panel shows them side by side.

Run: python -m experiments.large_state [--quick] [--keys N] [--rounds R] [--tables heap,rocksdb]
     [--no-spark] [--no-operator] [--only operator,spark --keep-from FILE] (--only runs just
     those rows; the others, and the long run, are kept from FILE, marked ``from_run``)
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from .common import machine, parser, percentile, plt, write_results

MAXP = 128
VALUE = 100
PARALLELISM = 4
LOAD_CHECKPOINT_EVERY = 500_000  # persist the changelog while loading (bounded memory)


def _key(i: int) -> str:
    return f"key-{i:010d}"


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _coordinator(base: str, job: str, table: str, local: str) -> tuple[Any, Any]:
    import dstl_ray as d

    client = d.StateChangelogClient(job, transport=d.DirectTransport(job, base))
    coord = d.CheckpointCoordinator(job, base, max_parallelism=MAXP, retained=1)
    (b,) = coord.restore(client, "op", 1, materialization_interval=None, state_backend=table,
                         local_dir=local)
    return coord, b


def subtask(args: dict[str, Any]) -> dict[str, Any]:
    """One subtask's run (in a process of its own): load, materialize, rounds."""
    import dstl_ray as d

    if args.get("limit_gb"):  # a MemoryError, not the machine's OOM killer
        lim = int(args["limit_gb"] * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    ser = d.TaggedSerializer()
    rng = random.Random(args["index"])
    t0 = time.perf_counter()
    lo, hi = args["lo"], args["hi"]
    coord, b = _coordinator(args["base"], args["job"], args["table"], args["local"])
    out: dict[str, Any] = {"index": args["index"], "keys": hi - lo}
    try:
        vs = b.value_state("v")
        t0 = time.perf_counter()
        for i in range(lo, hi):
            vs.update(_key(i), rng.randbytes(VALUE))
            if (i - lo + 1) % LOAD_CHECKPOINT_EVERY == 0:
                coord.trigger_checkpoint().result()
        out["load_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        b.materialize(force=True).result()
        out["first_mat_s"] = time.perf_counter() - t0
        out["first_mat_bytes"] = b._files.last_upload_bytes
        coord.trigger_checkpoint().result()
        ckpt_ms, mat_ms, upload, changed = [], [], [], []
        n_upd = max(1, (hi - lo) // 100)
        for _ in range(args["rounds"]):
            nbytes = 0
            for i in rng.sample(range(lo, hi), n_upd):
                k, v = _key(i), rng.randbytes(VALUE)
                vs.update(k, v)
                nbytes += len(ser.serialize(k)) + len(ser.serialize(v))
            t0 = time.perf_counter()
            coord.trigger_checkpoint().result()
            ckpt_ms.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            b.materialize().result()
            mat_ms.append((time.perf_counter() - t0) * 1000)
            upload.append(b._files.last_upload_bytes)
            changed.append(nbytes)
        # the recovery checkpoint: the last materialization plus 1% more in the changelog
        for i in rng.sample(range(lo, hi), n_upd):
            vs.update(_key(i), rng.randbytes(VALUE))
        cc = coord.trigger_checkpoint().result()
        out.update(ckpt_ms=ckpt_ms, mat_ms=mat_ms, upload_bytes=upload, changed_bytes=changed,
                   checkpoint=cc.metadata_url, peak_rss_mb=_rss_mb())
    except MemoryError:
        out["error"] = (f"MemoryError at the {args['limit_gb']} GiB limit per subtask, "
                        f"{time.perf_counter() - t0:.0f} s in, with {hi - lo:,} keys")
    finally:
        coord.abandon()  # the retained checkpoint stays for the recovery run
        b.close()
    return out


def recover(args: dict[str, Any]) -> dict[str, Any]:
    """Restore one subtask from its checkpoint in a fresh process: the whole restore, and
    the changelog alone into an empty table (the replay rate)."""
    import dstl_ray as d
    from dstl_ray.checkpoint.metadata import split_metadata_url
    from dstl_ray.checkpoint.recovery import load_checkpoint
    from dstl_ray.state.backend import ChangelogKeyedStateBackend, RestoreSource
    from dstl_ray.state.snapshot import ChangelogComponent

    cc = load_checkpoint(args["checkpoint"])
    base, own = split_metadata_url(cc.metadata_url)
    snap = cc.metadata.snapshots[0]
    log_bytes = sum(seg.length for c in snap.components if isinstance(c, ChangelogComponent)
                    for seg in c.handle.segments)
    client = d.StateChangelogClient(args["job"] + "-r",
                                    transport=d.DirectTransport(args["job"] + "-r", base))

    def restore(components: tuple) -> float:
        s = d.KeyedStateSnapshot(snap.operator_id, snap.key_group_range, components)
        t0 = time.perf_counter()
        b = ChangelogKeyedStateBackend(client, "op", snap.key_group_range, MAXP,
                                       materialization_interval=None,
                                       restore=[RestoreSource(s, base, own, cc.metadata_url)],
                                       state_backend=args["table"], local_dir=args["local"])
        dt = time.perf_counter() - t0
        b.close()
        return dt

    full = restore(snap.components)
    rss = _rss_mb()
    only_log = restore(tuple(c for c in snap.components if isinstance(c, ChangelogComponent)))
    return {"recovery_s": full, "replay_s": only_log, "changelog_bytes": log_bytes,
            "replay_mb_s": log_bytes / max(only_log, 1e-6) / 1e6, "recovery_rss_mb": rss}


def run_table(table: str, keys: int, rounds: int, work: str, limit_gb: float = 0
              ) -> dict[str, Any]:
    base = f"file://{work}/dfs-{table}"
    local = f"{work}/local-{table}"
    per = keys // PARALLELISM
    jobs = [{"index": i, "lo": i * per, "hi": (i + 1) * per, "base": base,
             "job": f"{table}-{i}", "table": table, "local": local, "rounds": rounds,
             "limit_gb": limit_gb if table == "heap" else 0}
            for i in range(PARALLELISM)]
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    with ctx.Pool(PARALLELISM, maxtasksperchild=1) as pool:
        try:
            results = pool.map(subtask, jobs)
        except Exception as e:  # noqa: BLE001 - a subtask killed by the OOM killer
            return {"backend": table, "keys": keys, "error": f"{type(e).__name__}: {e}"}
    wall = time.perf_counter() - t0
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"backend": table, "keys": keys, "error": errors[0]}
    with ctx.Pool(1, maxtasksperchild=1) as pool:
        rec = pool.apply(recover, ({**jobs[0], "checkpoint": results[0]["checkpoint"]},))
    ckpt = [x for r in results for x in r["ckpt_ms"]]
    upload = [x for r in results for x in r["upload_bytes"]]
    changed = [x for r in results for x in r["changed_bytes"]]
    ratio = [u / c for u, c in zip(upload, changed, strict=True)]
    return {
        "backend": table, "keys": keys,
        "state_bytes": keys * VALUE,
        "ckpt_ms_p50": round(percentile(ckpt, 50), 1),
        "ckpt_ms_p99": round(percentile(ckpt, 99), 1),
        "mat_ms_p50": round(percentile([x for r in results for x in r["mat_ms"]], 50), 1),
        "mat_upload_bytes": round(percentile(upload, 50)),
        "mat_upload_bytes_mean": round(sum(upload) / len(upload)),
        "changed_bytes_per_round": round(sum(changed) / len(changed)),
        "upload_to_changed_p50": round(percentile(ratio, 50), 2),
        "upload_to_changed_mean": round(sum(upload) / sum(changed), 2),
        # subtask 0's materializations one by one: compactions show as the large ones
        "upload_bytes_rounds_subtask0": results[0]["upload_bytes"],
        "changed_bytes_rounds_subtask0": results[0]["changed_bytes"],
        "first_mat_bytes": sum(r["first_mat_bytes"] for r in results),
        "first_mat_s_max": round(max(r["first_mat_s"] for r in results), 1),
        "load_s_max": round(max(r["load_s"] for r in results), 1),
        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in results)),
        "recovery_s": round(rec["recovery_s"], 2),
        "recovery_rss_mb": round(rec["recovery_rss_mb"]),
        "replay_mb_s": round(rec["replay_mb_s"], 1),
        "wall_s": round(wall, 1),
    }


def run_spark_row(keys: int, rounds: int, work: str) -> dict[str, Any]:
    """Spark's RocksDB state store on the same workload, in a process of its own (so its
    JVM and memory do not share ours)."""
    code = ("import json,sys; from experiments.large_state_spark import run_spark; "
            f"print('ROW', json.dumps(run_spark({keys}, {VALUE}, {rounds}, 0.01, "
            f"{PARALLELISM}, {work + '/spark'!r}, timeout_s=5400)))")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=6 * 3600, cwd=os.path.dirname(os.path.dirname(__file__)))
    finally:
        # the Spark JVM is meant to exit with its Python process, but one was seen hanging
        # on at half a core after the run (orphaned, in its shutdown): its command line
        # names the run's directory
        subprocess.run(["pkill", "-f", f"{work}/spark/"], check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    return {"backend": "spark-rocksdb", "keys": keys,
            "error": (proc.stderr or proc.stdout)[-500:]}


def _plot_long_run(ax: Any, run: dict[str, Any]) -> None:
    """Subtask 0's uploads over the long run, over the bytes changed: the flushed changes
    each round, and compaction's merges as the spikes; the running mean beside them."""
    if "error" in run:
        ax.set_title(f"long run failed: {run['error'][:40]}", fontsize=8)
        return
    up, ch = run["upload_bytes_rounds_subtask0"], run["changed_bytes_rounds_subtask0"]
    xs = range(1, len(up) + 1)
    ax.plot(xs, [u / c for u, c in zip(up, ch, strict=True)], lw=0.6, label="per round")
    mean, su, sc = [], 0, 0
    for u, c in zip(up, ch, strict=True):
        su, sc = su + u, sc + c
        mean.append(su / sc)
    ax.plot(xs, mean, color="tab:red", label="running mean")
    ax.axhline(2, color="grey", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("round", fontsize=8)
    ax.set_title(f"rocksdb upload / changed, {run['keys']:,} keys", fontsize=9)
    ax.legend(fontsize=7)


def run_operator_row(keys: int, rounds: int, work: str) -> dict[str, Any]:
    """The Spark operator on RocksDB, over the same input as :func:`run_spark_row`."""
    from .large_state_operator import run_operator

    try:
        return run_operator(keys, VALUE, rounds, 0.01, work + "/operator", timeout_s=5400)
    finally:
        subprocess.run(["pkill", "-f", f"{work}/operator/"], check=False)


def _kept(path: str, runs: set[str]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The rows of an earlier run that are not run now, and its long run, each marked with
    that run's date (``from_run``: experiments.ab counts only this run's figures)."""
    with open(path) as f:
        earlier = json.load(f)
    date = earlier.get("machine", {}).get("date", "?")
    rows = [{**r, "from_run": r.get("from_run", date)} for r in earlier["rows"]
            if ROW_OF.get(r["backend"], r["backend"]) not in runs]
    long_run = earlier.get("long_run")
    if isinstance(long_run, dict):
        long_run = {**long_run, "from_run": long_run.get("from_run", date)}
    return rows, long_run


ROW_OF = {"spark-rocksdb": "spark", "dstl-ray-operator-rocksdb": "operator"}


def _plot_like_for_like(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Update batch p50 and the first batch after a restart: the operator against Spark."""
    pair = [r for r in rows if r["backend"] in ROW_OF and "error" not in r
            and "restart_first_batch_ms" in r]
    xs = range(len(pair))
    ax.bar([x - 0.2 for x in xs], [r["batch_ms_p50"] / 1000 for r in pair], 0.4,
           label="update batch p50")
    ax.bar([x + 0.2 for x in xs], [r["restart_first_batch_ms"] / 1000 for r in pair], 0.4,
           label="first batch after restart")
    ax.set_xticks(list(xs), [ROW_OF[r["backend"]] for r in pair], fontsize=8)
    ax.set_ylabel("s", fontsize=8)
    ax.set_title("Spark operator vs Spark's store", fontsize=9)
    ax.legend(fontsize=7)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--keys", type=int, default=0)
    p.add_argument("--rounds", type=int, default=0)
    p.add_argument("--tables", default="heap,rocksdb")
    p.add_argument("--no-spark", action="store_true")
    p.add_argument("--no-operator", action="store_true")
    p.add_argument("--only", default="", help="comma-separated rows to run: heap, rocksdb, "
                   "spark, operator, long (the others are kept from --keep-from)")
    p.add_argument("--keep-from", default="", help="an earlier large_state.json")
    p.add_argument("--long-keys", type=int, default=0,
                   help="keys of the long rocksdb run (upload over many rounds)")
    p.add_argument("--long-rounds", type=int, default=0)
    p.add_argument("--heap-limit-gb", type=float, default=5.0,
                   help="address-space limit per heap subtask (0: none)")
    args = p.parse_args()
    keys = args.keys or (400_000 if args.quick else 20_000_000)
    rounds = args.rounds or (5 if args.quick else 10)
    runs = set(args.only.split(",")) if args.only else {
        *args.tables.split(","), *(() if args.no_spark else ("spark",)),
        *(() if args.no_operator else ("operator",)), "long"}
    if args.only and not args.keep_from:
        p.error("--only needs --keep-from (the rows not run)")
    rows, long_run = _kept(args.keep_from, runs) if args.keep_from else ([], None)
    work = tempfile.mkdtemp(prefix="dstl-large-state-")
    try:
        for table in ("heap", "rocksdb"):
            if table in runs:
                row = run_table(table, keys, rounds, work, args.heap_limit_gb)
                print(json.dumps(row), flush=True)
                rows.append(row)
                shutil.rmtree(f"{work}/dfs-{table}", ignore_errors=True)
        for name, run in (("spark", run_spark_row), ("operator", run_operator_row)):
            if name in runs:
                row = run(keys, rounds, work)
                print(json.dumps(row), flush=True)
                rows.append(row)
        # compaction's share of the uploads shows only over many rounds
        if "long" in runs or long_run is None:
            long_run = run_table("rocksdb", args.long_keys or (
                200_000 if args.quick else 2_000_000), args.long_rounds or (
                20 if args.quick else 200), work)
            print(json.dumps({k: v for k, v in long_run.items() if not isinstance(v, list)}),
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    pair = {ROW_OF[r["backend"]]: r for r in rows if r["backend"] in ROW_OF
            and "from_run" not in r and "restart_first_batch_ms" in r}
    ratios = {} if len(pair) < 2 else {  # only between rows of this run
        f"operator_over_spark_{m}": round(pair["operator"][m] / pair["spark"][m], 3)
        for m in ("batch_ms_p50", "restart_first_batch_ms")}
    data = {"keys": keys, "value_bytes": VALUE, "parallelism": PARALLELISM, "rounds": rounds,
            "update_fraction": 0.01, "rows": rows, "ratios": ratios, "long_run": long_run,
            "machine": machine()}
    pyplot = plt()
    fig, axes = pyplot.subplots(1, 6, figsize=(21, 3.2))
    _plot_like_for_like(axes[5], rows)
    ok = [r for r in rows if "error" not in r and "ckpt_ms_p50" in r
          and r["backend"] != "dstl-ray-operator-rocksdb"]
    names = [r["backend"] for r in ok]
    for ax, (field, label) in zip(axes, [("ckpt_ms_p50", "checkpoint p50 (ms)"),
                                         ("mat_upload_bytes", "upload per materialization (MB)"),
                                         ("peak_rss_mb", "peak RSS per subtask (MiB)"),
                                         ("recovery_s", "recovery (s)")], strict=False):
        vals = [r.get(field, 0) / (1e6 if field == "mat_upload_bytes" else 1) for r in ok]
        ax.bar(names, vals, color=["tab:blue", "tab:green", "tab:orange"][:len(vals)])
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    _plot_long_run(axes[4], long_run)
    fig.suptitle(f"{keys:,} keys of {VALUE} B, parallelism {PARALLELISM}, 1% updated per "
                 f"checkpoint", fontsize=10)
    fig.tight_layout()
    write_results("large_state", data, fig, args.out)


if __name__ == "__main__":
    main()
