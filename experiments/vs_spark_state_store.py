"""dstl-ray vs Spark's own RocksDB state store with changelog checkpointing, on the same keyed
aggregation (per-user count and sum), the same input files (one file per micro-batch), the
same number of partitions, on the same RayDP Spark session over a 3-node Ray cluster.

Spark: ``groupBy(user).agg(count, sum)`` in update mode, RocksDBStateStoreProvider with
``spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled=true``.
dstl-ray: :class:`spark_glue.KeyedStatefulOperator` in ``foreachBatch`` (one checkpoint per
micro-batch through the node-actor tree, materialization every 10 s).

Per side: files created per micro-batch (state files: Spark's ``state/`` directory vs
dstl-ray's base path; a watcher thread records every file name it sees, so files created and
later deleted count too), state commit time per batch (Spark: the state operator's
``commitTimeMs``; dstl-ray: slowest subtask persist + checkpoint metadata), end-to-end batch
duration (``triggerExecution`` of the query progress, the same measure for both), and recovery
time after a restart (a new query run on the same checkpoint location: start until its first
batch completed, which includes loading the state).

Run: python -m experiments.vs_spark_state_store [--quick]
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

NS = "vs-spark"
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


def count_sum(key: Any, rows: list[Any], state: Any) -> None:
    """The same aggregation as Spark's ``groupBy(user).agg(count(*), sum(amount))``."""
    c, s = state.value("count"), state.value("sum")
    c.set(c.get(0) + len(rows))
    s.set(s.get(0) + sum(r["amount"] for r in rows))


def _progress(q: Any) -> list[dict[str, Any]]:
    """Progress of the batches that had input (dicts in PySpark 3.5)."""
    out = [p if isinstance(p, dict) else json.loads(p.json) for p in q.recentProgress]
    return [p for p in out if p.get("numInputRows", 0) > 0]


def _run_query(start: Any, n_batches: int, timeout: float = 900) -> tuple[Any, float]:
    t0 = time.perf_counter()
    q = start()
    deadline = time.time() + timeout
    while len(_progress(q)) < n_batches:
        if q.exception() is not None:
            raise RuntimeError(f"query failed: {q.exception()}")
        if time.time() > deadline:
            raise TimeoutError(f"{len(_progress(q))} of {n_batches} batches after {timeout}s")
        time.sleep(0.05)
    return q, time.perf_counter() - t0


def spark_side(spark: Any, src: Path, work: Path, n: int, parts: int, add_file: Any
               ) -> dict[str, Any]:
    from pyspark.sql import functions as F

    from spark_glue.pipeline import SCHEMA

    chk = work / "spark-rocksdb-chk"
    spark.conf.set("spark.sql.streaming.stateStore.providerClass", ROCKSDB)
    spark.conf.set("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled",
                   "true")
    spark.conf.set("spark.sql.shuffle.partitions", str(parts))

    def start() -> Any:
        return (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(src))
                .groupBy("user").agg(F.count("*").alias("n"), F.sum("amount").alias("s"))
                .writeStream.outputMode("update").format("noop")
                .option("checkpointLocation", str(chk)).start())

    with FileWatcher(chk / "state") as state_files, FileWatcher(chk) as all_files:
        q, _ = _run_query(start, n)
        prog = _progress(q)
        q.stop()
        created_run = len(state_files.seen)
        all_run = len(all_files.seen)
        add_file()
        q2, recovery_s = _run_query(start, 1)
        first = _progress(q2)[0]["durationMs"]
        q2.stop()
    return {
        "batches": len(prog),
        "state_files_created": created_run, "all_files_created": all_run,
        "state_files_per_batch": created_run / max(1, len(prog)),
        "all_files_per_batch": all_run / max(1, len(prog)),
        "commit_ms": summary([sum(o.get("commitTimeMs", 0) for o in p["stateOperators"])
                              for p in prog]),
        "batch_ms": summary([p["durationMs"]["triggerExecution"] for p in prog]),
        "batch_ms_series": [p["durationMs"]["triggerExecution"] for p in prog],
        "recovery_s": recovery_s,
        "recovery_profile": {"first_batch_durations_ms": first},
    }


def dstl_side(spark: Any, src: Path, work: Path, n: int, parts: int, add_file: Any
              ) -> dict[str, Any]:
    from dstl_ray import ChangelogConfig, deploy
    from spark_glue import KeyedStatefulOperator
    from spark_glue.pipeline import SCHEMA

    base, chk = work / "dstl", work / "dstl-spark-chk"
    tree = deploy(f"file://{base}", ChangelogConfig(namespace=NS, persist_delay_s=0.2),
                  detached=False)

    def make_op() -> Any:
        return KeyedStatefulOperator("vs-spark", key="user", update=count_sum, namespace=NS,
                                     parallelism=parts, max_parallelism=128,
                                     materialization_interval=10.0)

    try:
        ops: list[Any] = []

        op_start_s: list[float] = []

        def start() -> Any:
            t0 = time.perf_counter()
            ops.append(make_op())
            op_start_s.append(time.perf_counter() - t0)
            return (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
                    .json(str(src)).writeStream.foreachBatch(ops[-1])
                    .option("checkpointLocation", str(chk)).start())

        with FileWatcher(base) as state_files, FileWatcher(chk) as spark_files:
            q, _ = _run_query(start, n)
            prog = _progress(q)
            q.stop()
            op = ops[-1]
            created_run = len(state_files.seen)
            spark_run = len(spark_files.seen)
            op.close()
            add_file()
            q2, recovery_s = _run_query(start, 1)
            first = _progress(q2)[0]
            q2.stop()
            ops[-1].close()
            h = ops[-1].history[0]
            # where the restart's first batch goes (issue: recovery at least as fast as
            # Spark's store): the operator's start (lease, checkpoints, orphan cleanup), the
            # query's own start, then the batch: its subtasks' restores, the update function,
            # the checkpoint
            recovery_profile = {
                "operator_start_s": round(op_start_s[-1], 3),
                "first_batch_trigger_ms": first["durationMs"]["triggerExecution"],
                "first_batch_durations_ms": first["durationMs"],
                "first_batch_restore_ms": round(h.restore_s * 1000, 1),
                "first_batch_apply_ms": round(h.apply_s * 1000, 1),
                "first_batch_checkpoint_ms": round(h.checkpoint_s * 1000, 1),
                "first_batch_operator_ms": round(h.batch_s * 1000, 1),
                "first_batch_restores": h.restores}
        st = tree.status()
        return {
            "batches": len(prog),
            "state_files_created": created_run, "all_files_created": created_run + spark_run,
            "state_files_per_batch": created_run / max(1, len(prog)),
            "all_files_per_batch": (created_run + spark_run) / max(1, len(prog)),
            "changelog_files_per_batch": sum(s["files_flushed"] for s in st) / max(1, len(prog)),
            "commit_ms": summary([h.checkpoint_s * 1000 for h in op.history]),
            "batch_ms": summary([p["durationMs"]["triggerExecution"] for p in prog]),
            "batch_ms_series": [p["durationMs"]["triggerExecution"] for p in prog],
            "restores_per_batch": sum(h.restores for h in op.history) / max(1, len(op.history)),
            "recovery_s": recovery_s,
            "recovery_profile": recovery_profile,
        }
    finally:
        tree.shutdown()


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batches", type=int, default=0)
    p.add_argument("--events", type=int, default=0, help="events per micro-batch")
    p.add_argument("--users", type=int, default=20_000)
    p.add_argument("--partitions", type=int, default=3)
    args = p.parse_args()
    n = args.batches or (8 if args.quick else 60)
    events = args.events or (1000 if args.quick else 5000)

    import ray
    from pyspark import cloudpickle

    from dstl_ray.testing import start_local_cluster
    from spark_glue import start_spark, stop_spark
    from spark_glue.pipeline import write_event_file

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers get count_sum
    work = Path(tempfile.mkdtemp(prefix="vs-spark-"))
    srcs = {side: work / f"input-{side}" for side in ("dstl", "spark")}
    for src in srcs.values():  # the same files for both sides
        for i in range(n):
            write_event_file(src, i, events, args.users, seed=11)

    def adder(src: Path) -> Any:
        def add_file() -> None:  # one more batch of input for the restarted query
            write_event_file(src, n, events, args.users, seed=11)
        return add_file

    cluster = start_local_cluster(3, 1, NS)
    try:
        spark = start_spark("vs-spark", num_executors=3, executor_cores=1,
                            executor_memory="768M")
        spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", str(n + 10))
        print(f"[vs_spark] {n} micro-batches x {events} events, {args.partitions} partitions",
              flush=True)
        # the same input for both: each side reads every file from the start
        dstl = dstl_side(spark, srcs["dstl"], work, n, args.partitions, adder(srcs["dstl"]))
        print(f"[vs_spark] dstl-ray: {dstl['state_files_per_batch']:.2f} state files/batch, "
              f"batch p50 {dstl['batch_ms']['p50']:.0f} ms", flush=True)
        rocks = spark_side(spark, srcs["spark"], work, n, args.partitions,
                           adder(srcs["spark"]))
        print(f"[vs_spark] Spark RocksDB: {rocks['state_files_per_batch']:.2f} state "
              f"files/batch, batch p50 {rocks['batch_ms']['p50']:.0f} ms", flush=True)
        stop_spark()
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    ratio = dstl["batch_ms"]["p50"] / rocks["batch_ms"]["p50"]
    data = {
        "workload": {"batches": n, "events_per_batch": events, "users": args.users,
                     "partitions": args.partitions, "ray_nodes": 3, "executors": 3},
        "dstl_ray": dstl, "spark_rocksdb_changelog": rocks,
        "batch_p50_ratio_dstl_over_spark": ratio,
        "targets": {"fewer_state_files_per_batch":
                    dstl["state_files_per_batch"] < rocks["state_files_per_batch"],
                    "batch_duration_within_1_5x": ratio <= 1.5},
        "machine": machine(),
    }
    pyplot = plt()
    fig, (a1, a2) = pyplot.subplots(1, 2, figsize=(11, 4))
    names = ["dstl-ray", "Spark RocksDB\n(changelog ckpt)"]
    a1.bar(names, [dstl["state_files_per_batch"], rocks["state_files_per_batch"]],
           color=["tab:blue", "tab:orange"])
    a1.set_ylabel("state files created per micro-batch")
    a2.plot(dstl["batch_ms_series"], label="dstl-ray", color="tab:blue")
    a2.plot(rocks["batch_ms_series"], label="Spark RocksDB", color="tab:orange")
    a2.set_xlabel("micro-batch")
    a2.set_ylabel("batch duration (ms)")
    a2.legend()
    fig.suptitle(f"Same keyed count+sum, {n} micro-batches x {events} events, "
                 f"{args.partitions} partitions, RayDP on 3 Ray nodes")
    write_results("vs_spark_state_store", data, fig, args.out)


if __name__ == "__main__":
    main()
