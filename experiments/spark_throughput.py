"""Spark at production size: the stateful operator's throughput against Spark's own stateful
operators, micro-batches of 10k, 100k and 1M events over 1k, 100k and 1M distinct keys, on
RayDP over 3 Ray nodes (3 executors x 1 core), one run, side by side:

- ``dstl-ray per-key``: :class:`spark_glue.KeyedStatefulOperator`, ``update(key, rows, state)``
  once per key (rows as ``Row`` objects);
- ``dstl-ray vectorized``: the same operator with ``api="pandas"`` (one pandas call per
  subtask, state by the column: spark_glue.vectorized);
- ``Spark applyInPandasWithState``: ``groupBy(user).applyInPandasWithState`` (a pandas call
  per key), RocksDB state store with changelog checkpointing;
- ``Spark groupBy().agg()``: the native aggregation on the same store;
- ``dstl-ray vectorized + combine``: the vectorized API with a combiner (the operator's
  ``combine`` as a mapping of Spark aggregates, :data:`COMBINE`: each key's count and sum of
  the batch computed in the JVM, partial aggregation and shuffle as the native aggregation
  does them, so one row per key and batch reaches Python; spark_glue.combine);
- ``dstl-ray per-key + combine``: the per-key API over the same combiner's rows;
- ``dstl-ray vectorized + map-side combine``: the vectorized API with ``combine`` as a
  pandas function (:func:`partial_count_and_sum`) run on each input partition's rows in the
  map task's Python worker before the shuffle: one stage fewer than the Spark aggregates,
  but every input row crosses into Python.

Every system computes the same per-user count and sum (dstl-ray: typed states, ``bigint``)
and emits each updated key's totals
(update mode; Spark's outputs go to the ``noop`` sink, dstl-ray's to the driver). The input is
one Parquet file per micro-batch (keys uniform over the key space), the same files for every
system. Per row: events/s (events over the median batch duration), batch p50/p90 (Spark's
``triggerExecution``, the same measure for all; the first batch of each run is the warm-up
and left out), state commit p50 (Spark: the state operator's ``commitTimeMs``; dstl-ray: the
slowest subtask's persist plus the checkpoint metadata) and state files created per batch
(every file name seen under the state directory, so files created and deleted count too).

Run: python -m experiments.spark_throughput [--quick] [--systems 0,1,3,4,5 --keep-from
experiments/results/spark_throughput.json] (rows of systems not run are kept from an
earlier run, each marked ``from_run`` with its date) [--batches N] (micro-batches per run;
each system once per run: a second query of the same system finds its input read)
[--rounds R] (every system R times per size, alternating, experiments.paired_rounds: each
row is a system's median round, each ratio the median of the rounds' ratios; this machine's
speed drifts by a quarter and more between minutes)
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import machine, parser, plt, summary, write_results
from .file_watcher import FileWatcher
from .paired_rounds import median_item, median_ratio, round_order
from .vs_flink import files_by_kind
from .vs_spark_state_store import ROCKSDB, _progress, _run_query

NS = "spark-tp"
SCHEMA = "user STRING, amount LONG"
SYSTEMS = ("dstl-ray per-key", "dstl-ray vectorized", "Spark applyInPandasWithState",
           "Spark groupBy().agg()", "dstl-ray vectorized + combine", "dstl-ray per-key + combine",
           "dstl-ray vectorized + map-side combine")


def per_key(key: Any, rows: list[Any], state: Any) -> list[tuple[Any, int, int]]:
    c, s = state.value("count"), state.value("sum")
    n, t = c.get(0) + len(rows), s.get(0) + sum(r["amount"] for r in rows)
    c.set(n)
    s.set(t)
    return [(key, n, t)]


def vectorized(keys: Any, rows: Any, state: Any) -> Any:
    import pandas as pd

    agg = rows.groupby("user", sort=False)["amount"].agg(["size", "sum"])
    count = state.value("count").get(0).to_numpy() + agg["size"].to_numpy()
    total = state.value("sum").get(0).to_numpy() + agg["sum"].to_numpy()
    state.value("count").set(count)
    state.value("sum").set(total)
    return pd.DataFrame({"user": keys, "count": count, "sum": total})


def count_and_sum() -> dict[str, Any]:
    """The combiner (the operator's ``combine``, run as ``groupBy(user).agg(...)`` in the JVM):
    per key of the batch, its events' count and sum."""
    from pyspark.sql import functions as F

    return {"n": F.count("*"), "total": F.sum("amount")}


def partial_count_and_sum(pdf: Any) -> Any:
    """The map-side combiner (``combine`` as a function): per key of one input partition,
    its events' count and sum, in pandas."""
    return pdf.groupby("user", as_index=False, sort=False).agg(n=("amount", "size"),
                                                               total=("amount", "sum"))


def per_key_combined(key: Any, rows: list[Any], state: Any) -> list[tuple[Any, int, int]]:
    """:func:`per_key` over the combiner's counts and sums."""
    c, s = state.value("count"), state.value("sum")
    n, t = c.get(0) + sum(r["n"] for r in rows), s.get(0) + sum(r["total"] for r in rows)
    c.set(n)
    s.set(t)
    return [(key, n, t)]


def vectorized_combined(keys: Any, rows: Any, state: Any) -> Any:
    """:func:`vectorized` over the combiner's counts and sums."""
    import pandas as pd

    agg = rows.groupby("user", sort=False)[["n", "total"]].sum()
    count = state.value("count").get(0).to_numpy() + agg["n"].to_numpy()
    total = state.value("sum").get(0).to_numpy() + agg["total"].to_numpy()
    state.value("count").set(count)
    state.value("sum").set(total)
    return pd.DataFrame({"user": keys, "count": count, "sum": total})


def in_pandas_with_state(key: Any, pdfs: Any, state: Any) -> Any:
    import pandas as pd

    count, total = state.get if state.exists else (0, 0)
    for pdf in pdfs:
        count += len(pdf)
        total += int(pdf["amount"].sum())
    state.update((count, total))
    yield pd.DataFrame({"user": [key[0]], "count": [count], "sum": [total]})


def write_inputs(folder: Path, batches: int, events: int, keys: int, seed: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(batches):
        ids = rng.integers(0, keys, events)
        users = pa.array(np.char.add("u", ids.astype(str)).astype(object), pa.string())
        t = pa.table({"user": users, "amount": pa.array(rng.integers(1, 100, events))})
        pq.write_table(t, folder / f".b{i:04d}.tmp")
        (folder / f".b{i:04d}.tmp").rename(folder / f"b{i:04d}.parquet")


def _stats(system: str, events: int, keys: int, batch_ms: list[float],
           commit_ms: list[float], files: int, batches: int, **extra: Any) -> dict[str, Any]:
    measured = batch_ms[1:] or batch_ms  # the first batch warms up
    s = summary(measured)
    return {"system": system, "events_per_batch": events, "keys": keys,
            "events_per_s": events / (s["p50"] / 1000), "batch_ms_p50": s["p50"],
            "batch_ms_p90": s["p90"], "commit_ms_p50": summary(commit_ms[1:] or commit_ms)["p50"],
            "state_files_per_batch": files / max(1, batches), "batches": batches,
            "batch_ms_series": batch_ms, **extra}


def run_dstl(spark: Any, src: Path, work: Path, base: Path, api: str, events: int, keys: int,
             batches: int, combine: bool | str = False, tag: str = "") -> dict[str, Any]:
    """One run of a dstl-ray system (``tag``: the round's, so each run is a job of its
    own)."""
    from spark_glue import KeyedStatefulOperator

    kind = "-combine" if combine is True else f"-{combine}" if combine else ""
    job = f"tp-{api}{kind}-{events}-{keys}{tag}"
    update = {("rows", False): per_key, ("rows", True): per_key_combined,
              ("pandas", False): vectorized, ("pandas", True): vectorized_combined,
              ("pandas", "map-side"): vectorized_combined}[api, combine]
    op = KeyedStatefulOperator(job, key="user", update=update, api=api, namespace=NS,
                               parallelism=3, max_parallelism=128,
                               materialization_interval=10.0, sink=lambda b, out: None,
                               combine=(partial_count_and_sum if combine == "map-side"
                                        else count_and_sum() if combine else None),
                               state_schema={"count": "bigint", "sum": "bigint"})

    def start() -> Any:
        return (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
                .parquet(str(src)).writeStream.foreachBatch(op)
                .option("checkpointLocation", str(work / f"chk-{job}")).start())

    try:
        with FileWatcher(base / job) as files:
            q, _ = _run_query(start, batches, timeout=3600)
            prog = _progress(q)[:batches]
            q.stop()
        h = list(op.history)[:batches]
        system = {("rows", False): 0, ("rows", True): 5, ("pandas", False): 1,
                  ("pandas", True): 4, ("pandas", "map-side"): 6}[api, combine]
        return _stats(SYSTEMS[system],
                      events, keys,
                      [p["durationMs"]["triggerExecution"] for p in prog],
                      [x.checkpoint_s * 1000 for x in h], len(files.seen), len(prog),
                      restores=sum(x.restores for x in h[1:]),
                      # each batch's time in the operator (foreachBatch), the slowest
                      # subtask's update function and restore, the checkpoint, the sink
                      batch_breakdown_s=[{"operator": round(x.batch_s, 2),
                                          "apply": round(x.apply_s, 2),
                                          "restore": round(x.restore_s, 2),
                                          "checkpoint": round(x.checkpoint_s, 2),
                                          "sink": round(x.commit_s, 2)} for x in h],
                      state_files_per_batch_by_kind=files_by_kind(files.seen, len(prog)),
                      apply_ms_p50=summary([x.apply_s * 1000 for x in h[1:] or h])["p50"])
    finally:
        op.close()


def run_spark(spark: Any, src: Path, work: Path, kind: str, events: int, keys: int,
              batches: int, tag: str = "") -> dict[str, Any]:
    """One run of a Spark system (``tag``: the round's, a checkpoint location of its own)."""
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.state import GroupStateTimeout

    chk = work / f"chk-spark-{kind}-{events}-{keys}{tag}"

    def start() -> Any:
        df = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(src))
        if kind == "agg":
            out = df.groupBy("user").agg(F.count("*").alias("count"),
                                         F.sum("amount").alias("sum"))
        else:
            out = df.groupBy("user").applyInPandasWithState(
                in_pandas_with_state, "user STRING, count LONG, sum LONG",
                "count LONG, sum LONG", "update", GroupStateTimeout.NoTimeout)
        return (out.writeStream.outputMode("update").format("noop")
                .option("checkpointLocation", str(chk)).start())

    with FileWatcher(chk / "state") as files:
        q, _ = _run_query(start, batches, timeout=3600)
        prog = _progress(q)[:batches]
        q.stop()
    return _stats(SYSTEMS[3] if kind == "agg" else SYSTEMS[2], events, keys,
                  [p["durationMs"]["triggerExecution"] for p in prog],
                  [sum(o.get("commitTimeMs", 0) for o in p["stateOperators"]) for p in prog],
                  len(files.seen), len(prog))


# ratio name -> (system over, system under), each system an index into SYSTEMS
RATIOS = {"vectorized_over_apply_in_pandas": (1, 2), "vectorized_over_native_agg": (1, 3),
          "vectorized_combine_over_native_agg": (4, 3), "per_key_over_native_agg": (0, 3),
          "per_key_combine_over_native_agg": (5, 3),
          "vectorized_map_side_combine_over_native_agg": (6, 3)}


def _of(runs: list[dict[str, Any]], system: str, e: int, k: int) -> list[dict[str, Any]]:
    return [r for r in runs if r["system"] == system and (r["events_per_batch"], r["keys"])
            == (e, k)]


def median_rows(runs: list[dict[str, Any]], rounds: int) -> list[dict[str, Any]]:
    """A row per system and size: its median round's run by batch p50, with every round's
    batch p50 (``rounds_batch_ms_p50``) when there were several."""
    rows = []
    for system, e, k in dict.fromkeys((r["system"], r["events_per_batch"], r["keys"])
                                      for r in runs):
        mine = _of(runs, system, e, k)
        row = {x: v for x, v in median_item(mine, lambda r: r["batch_ms_p50"]).items()
               if x != "round"}
        if rounds > 1:
            row["rounds_batch_ms_p50"] = [r["batch_ms_p50"] for r in mine]
        rows.append(row)
    return rows


def size_ratios(runs: list[dict[str, Any]], e: int, k: int) -> dict[str, Any]:
    """The ratios of one size (:data:`RATIOS`): events/s of one system over another's, the
    median of the rounds' pairs, only between runs of this run (a row kept from another run
    was measured on another day, maybe another machine: no ratio); each round's in
    ``per_round``."""
    out: dict[str, Any] = {"events_per_batch": e, "keys": k}
    per_round: dict[str, list[float]] = {}
    for name, (a, b) in RATIOS.items():
        got = median_ratio(*({r["round"]: r["events_per_s"] for r in _of(runs, SYSTEMS[i], e, k)}
                             for i in (a, b)))
        out[name] = got and got["median"]
        if got and len(got["per_round"]) > 1:
            per_round[name] = got["per_round"]
    if per_round:
        out["per_round"] = per_round
    return out


def plot(rows: list[dict[str, Any]], sizes: list[tuple[int, int]]) -> Any:
    pyplot = plt()
    fig, axes = pyplot.subplots(1, 2, figsize=(14, 4.8))
    def short(n: int) -> str:
        return f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}k"

    labels = [f"{short(e)} ev\n{short(k)} keys" for e, k in sizes]
    width = 0.12
    colors = ["tab:blue", "tab:cyan", "tab:orange", "tab:red", "tab:green", "tab:purple",
              "tab:olive"]
    for si, system in enumerate(SYSTEMS):
        by = {(r["events_per_batch"], r["keys"]): r for r in rows if r["system"] == system}
        xs = [i + (si - 3) * width for i in range(len(sizes))]
        axes[0].bar(xs, [by[s]["events_per_s"] if s in by else 0 for s in sizes], width,
                    label=system, color=colors[si])
        axes[1].bar(xs, [by[s]["batch_ms_p50"] if s in by else 0 for s in sizes], width,
                    label=system, color=colors[si])
    for ax, title in zip(axes, ("events/s (events over median batch duration)",
                                "batch duration p50 (ms)"), strict=True):
        ax.set_xticks(range(len(sizes)), labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle("Keyed count+sum per micro-batch, RayDP on 3 Ray nodes (3 executors x 1 core)")
    return fig


def _all_at_least(ratios: list[dict[str, Any]], name: str, bound: float) -> bool | None:
    """Whether every ratio ``name`` measured in this run is at least ``bound``; None if none
    was (its systems' rows were kept from another run, or not run)."""
    got = [r[name] for r in ratios if r[name] is not None]
    return all(x >= bound for x in got) if got else None


def targets(ratios: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issues' targets, from the ratios of this run's rows."""
    return {
        "vectorized_at_or_above_apply_in_pandas": _all_at_least(
            ratios, "vectorized_over_apply_in_pandas", 1.0),
        "vectorized_at_least_half_native": _all_at_least(
            ratios, "vectorized_over_native_agg", 0.5),
        "no_failure_at_1m_events": any(r["events_per_batch"] >= 1_000_000 for r in rows),
        # issue 32: with a combiner (as the native aggregation combines), either kind
        "vectorized_combine_at_or_above_native": _all_at_least(
            ratios, "vectorized_combine_over_native_agg", 1.0),
        "vectorized_map_side_combine_at_or_above_native": _all_at_least(
            ratios, "vectorized_map_side_combine_over_native_agg", 1.0),
        "per_key_combine_at_least_half_native": _all_at_least(
            ratios, "per_key_combine_over_native_agg", 0.5)}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--events", default="", help="comma-separated events per batch")
    p.add_argument("--keys", default="", help="comma-separated key space sizes")
    p.add_argument("--systems", default="", help="comma-separated indexes into the systems")
    p.add_argument("--batches", type=int, default=0,
                   help="micro-batches per run, the first a warm-up (default: 6 at 10k "
                        "events, else 4)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system this many times per size, alternating "
                        "(experiments.paired_rounds): each row is the system's median "
                        "round, each ratio the median of the rounds' ratios")
    p.add_argument("--keep-from", default="",
                   help="an earlier spark_throughput.json: its rows of the systems not run "
                        "now are kept, marked with that run's date (the slow ones need not "
                        "run again)")
    args = p.parse_args()
    events = [int(x) for x in args.events.split(",") if x] or (
        [10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000])
    keys = [int(x) for x in args.keys.split(",") if x] or (
        [1_000, 100_000] if args.quick else [1_000, 100_000, 1_000_000])
    systems = [int(x) for x in args.systems.split(",") if x] or list(range(len(SYSTEMS)))
    unknown = [s for s in systems if not 0 <= s < len(SYSTEMS)]
    if unknown or len(set(systems)) != len(systems):
        # an index past the list would run the native aggregation again, on the checkpoint
        # of its first run: a query with nothing to do, waited on for an hour
        p.error(f"--systems: {args.systems!r} names a system twice or one of none "
                f"(0-{len(SYSTEMS) - 1}: {', '.join(SYSTEMS)})")
    sizes = [(e, k) for e in events for k in keys]
    # read before the run: a bad file must not cost the measurements
    earlier = json.loads(Path(args.keep_from).read_text()) if args.keep_from else None

    import ray
    from pyspark import cloudpickle

    from dstl_ray import ChangelogConfig, deploy
    from dstl_ray.testing import start_local_cluster
    from spark_glue import start_spark, stop_spark

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the update functions
    work = Path(tempfile.mkdtemp(prefix="spark-tp-"))
    cluster = start_local_cluster(3, 1, NS)
    rounds = max(1, args.rounds)
    runs: list[dict[str, Any]] = []  # every run of every round
    try:
        spark = start_spark("spark-tp", num_executors=3, executor_cores=1,
                            executor_memory="1500M",
                            configs={"spark.sql.shuffle.partitions": "3"})
        spark.conf.set("spark.sql.streaming.stateStore.providerClass", ROCKSDB)
        spark.conf.set("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled",
                       "true")
        spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", "100")
        base = work / "dstl"
        tree = deploy(f"file://{base}", ChangelogConfig(namespace=NS, persist_delay_s=0.05),
                      detached=False)
        try:
            for e, k in sizes:
                n = args.batches or (6 if e <= 10_000 else 4)
                src = work / f"in-{e}-{k}"
                write_inputs(src, n, e, k, seed=e + k)
                for rnd, si in ((i, si) for i in range(rounds)
                                for si in round_order(systems, i)):
                    t0 = time.perf_counter()
                    tag = f"-r{rnd}" if rounds > 1 else ""
                    if si in (0, 1, 4, 5, 6):
                        r = run_dstl(spark, src, work, base,
                                     "rows" if si in (0, 5) else "pandas", e, k, n,
                                     combine="map-side" if si == 6 else si in (4, 5), tag=tag)
                    else:
                        r = run_spark(spark, src, work, "pandas" if si == 2 else "agg", e, k, n,
                                      tag=tag)
                    runs.append({**r, "round": rnd})
                    print(f"[spark_throughput] {e} events, {k} keys, round {rnd}, {r['system']}: "
                          f"{r['events_per_s']:,.0f} events/s, batch p50 "
                          f"{r['batch_ms_p50']:.0f} ms, commit p50 {r['commit_ms_p50']:.0f} "
                          f"ms, {r['state_files_per_batch']:.1f} state files/batch "
                          f"({time.perf_counter() - t0:.0f} s)", flush=True)
                shutil.rmtree(src, ignore_errors=True)
        finally:
            tree.shutdown()
            stop_spark()
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    rows = median_rows(runs, rounds)
    if earlier is not None:
        ran = {SYSTEMS[i] for i in systems}
        rows += [{**r, "from_run": r.get("from_run", earlier["machine"]["date"])}
                 for r in earlier["rows"]
                 if r["system"] not in ran and (r["events_per_batch"], r["keys"]) in sizes]
    ratios = [size_ratios(runs, e, k) for e, k in sizes]
    data = {
        "workload": {"events_per_batch": events, "keys": keys, "ray_nodes": 3,
                     "executors": 3, "executor_cores": 1, "parallelism": 3,
                     "batches": (f"{args.batches}" if args.batches else
                                 "6 (10k), 4 (100k, 1M)") + "; the first is the warm-up",
                     "rounds": rounds},
        "rows": rows, "ratios": ratios,
        "targets": targets(ratios, rows),
        "machine": machine(),
    }
    write_results("spark_throughput", data, plot(rows, sizes), args.out)


if __name__ == "__main__":
    main()
