"""The operator on a large keyed state, like for like with Spark's RocksDB state store
(``experiments.large_state_spark``): :class:`spark_glue.KeyedStatefulOperator` with
``state_backend="rocksdb"`` on RayDP, over the same input files (same seed: the same keys and
values), the same batches, the same restart.

Workload (as the Spark side's): a first micro-batch writes ``keys`` distinct keys (bigint)
with random values of ``value_bytes`` bytes; then ``rounds`` micro-batches each give new
values to ``update_fraction`` of the keys; then the whole query is restarted (the streaming
query stopped and the operator closed; a new operator of the same job and a new query on the
same checkpoint location) and one more such batch runs. The state is the latest value per key
(the vectorized API: ``rows.groupby(k).v.last()`` into a typed ``binary`` value state). The
update emits no outputs: Spark's side writes its rows to the ``noop`` sink, which drops them
on the executors, while the operator's outputs would travel to the driver.

Setup: 2 Ray nodes of 1 CPU on this machine, 2 RayDP executors x 1 core (2 task slots, as
Spark's ``local[2]``), parallelism 4 (Spark's side: 4 shuffle partitions), the DSTL tree on
``file://``, the RocksDB working directories on local disk, materialization every 10 s.
After the first batch and after the rounds the run waits until materialization is quiet (no
new file under the job's ``mat/`` for 25 s, longer than the interval: every subtask has
materialized all it holds), as the Spark side waits for its snapshot uploads, so the rounds
start from, and the restart restores, materialized state.

Measures: ``batch_ms`` is Spark's ``triggerExecution`` of each update batch (the same measure
as Spark's side); ``restart_first_batch_ms`` the ``triggerExecution`` of the first batch after
the restart (the operator restores every subtask from the checkpoint in it: RocksDB files
downloaded and checked, then the changelog since their materialization replayed);
``restart_restore_s`` the slowest subtask's restore within it; ``ckpt_ms`` the operator's
checkpoint (slowest subtask's persist plus the ``_metadata``); ``mat_upload_bytes`` the bytes
of new files in the DFS job directory during the rounds and the wait after them, per round;
``peak_rss_mb_per_executor`` the highest resident memory of one executor (its JVM plus its
Python workers, which hold the RocksDB tables), sampled every 0.5 s.

Run: python -m experiments.large_state_operator --keys N --rounds R (prints the row); the
side-by-side run is ``python -m experiments.large_state --only operator,spark``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .common import percentile
from .large_state_spark import _progress, in_child, listing, workload_parser, write_inputs

NS = "large-state-op"
PARALLELISM = 4
QUIET_S = 25.0  # no new materialized file for this long: materialization is done
MAT_INTERVAL_S = 10.0


def last_value(keys: Any, rows: Any, state: Any) -> None:
    """The latest value per key (as Spark's side's ``groupBy(k).agg(last(v))``)."""
    state.value("v").set(rows.groupby("k", sort=False)["v"].last())


class RssSampler:
    """Peak resident memory of each executor's process tree (the JVM that is not the driver's
    and its descendants: the Python workers), sampled in a thread."""

    def __init__(self, driver_jvm: int, every_s: float = 0.5) -> None:
        self.driver_jvm, self.every_s = driver_jvm, every_s
        self.peak: dict[int, float] = {}  # executor JVM pid -> MiB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            for root, mb in self.sample().items():
                self.peak[root] = max(self.peak.get(root, 0.0), mb)

    def sample(self) -> dict[int, float]:
        procs: dict[int, tuple[int, str, float]] = {}  # pid -> (ppid, comm, rss MiB)
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/status") as f:
                    st = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:  # gone meanwhile
                continue
            rss = int(st.get("VmRSS", "0 kB").split()[0]) / 1024
            procs[int(d)] = (int(st["PPid"]), st["Name"].strip(), rss)
        roots = {p for p, (_, name, _) in procs.items()
                 if name == "java" and p != self.driver_jvm and self._raydp(p)}
        out = dict.fromkeys(roots, 0.0)
        for pid, (_, _, rss) in procs.items():
            p, seen = pid, 0
            while p in procs and p not in roots and seen < 64:
                p, seen = procs[p][0], seen + 1
            if p in roots:
                out[p] += rss
        return out

    @staticmethod
    def _raydp(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return b"raydp" in f.read().lower()
        except OSError:
            return False


def _quiet(mat: Path, since: float, timeout: float) -> float:
    """Wait until no file under ``mat`` is newer than QUIET_S seconds; the seconds waited."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        times = [since] + [e.stat().st_mtime for e in os.scandir(mat)] if mat.exists() \
            else [since]
        if time.time() - max(times) >= QUIET_S:
            break
        time.sleep(1.0)
    return round(time.time() - t0, 1)


def _child(a: argparse.Namespace) -> None:
    """The measurement, in the child process; writes the (partial) result after each phase."""
    work, out = Path(a.workdir), Path(a.child)
    staging, src, chk, local, dfs = (work / d for d in ("staging", "input", "chk", "local",
                                                       "dfs"))
    for d in (staging, src, chk, local, dfs):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    res: dict[str, Any] = {
        "backend": "dstl-ray-operator-rocksdb", "keys": a.keys, "value_bytes": a.value_bytes,
        "state_bytes": a.keys * a.value_bytes, "rounds": a.rounds,
        "update_fraction": a.update_fraction, "parallelism": PARALLELISM,
        "executors": "2 x 1 core (RayDP, 2 Ray nodes)", "api": "pandas",
        "materialization_interval_s": MAT_INTERVAL_S,
        "loadavg_at_start": os.getloadavg()[0], "phase": "setup"}

    def save() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        os.replace(tmp, out)

    t_all = time.perf_counter()
    files = write_inputs(staging, a.keys, a.rounds, a.update_fraction, a.value_bytes, a.seed)
    res["setup_s"] = round(time.perf_counter() - t_all, 1)
    res["phase"] = "cluster start"
    save()

    from pyspark import cloudpickle

    from dstl_ray import ChangelogConfig, deploy
    from dstl_ray.testing import start_local_cluster, stop_local_cluster
    from spark_glue import KeyedStatefulOperator, start_spark, stop_spark
    from spark_glue.pipeline import publish

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cluster = start_local_cluster(2, 1, NS)
    tree = spark = q = op = None
    job = "large-state"
    try:
        spark = start_spark("large-state-op", num_executors=2, executor_cores=1,
                            executor_memory=a.executor_memory,
                            configs={"spark.sql.shuffle.partitions": str(PARALLELISM)})
        spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", str(a.rounds + 10))
        driver_jvm = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
        tree = deploy(f"file://{dfs}", ChangelogConfig(namespace=NS, persist_delay_s=0.05),
                      detached=False)

        def operator() -> Any:
            return KeyedStatefulOperator(
                job, key="k", update=last_value, api="pandas", namespace=NS,
                parallelism=PARALLELISM, max_parallelism=128, state_backend="rocksdb",
                local_dir=str(local), materialization_interval=MAT_INTERVAL_S,
                state_schema={"v": "binary"})

        def start(o: Any) -> Any:
            return (spark.readStream.schema("k BIGINT, v BINARY")
                    .option("maxFilesPerTrigger", 1).parquet(str(src))
                    .writeStream.foreachBatch(o).option("checkpointLocation", str(chk))
                    .start())

        batches: list[dict[str, Any]] = []
        res["batches"] = batches

        def run_batch(i: int, o: Any) -> dict[str, Any]:
            res["phase"] = f"batch {i}" + (" (first, all keys)" if i == 0 else "")
            save()
            t0 = time.perf_counter()
            publish(files[i], src / files[i].name)
            q.processAllAvailable()
            p = _progress(q, i)
            h = o.history[-1]
            b = {"batch": i, "ms": p["durationMs"]["triggerExecution"],
                 "wall_ms": round((time.perf_counter() - t0) * 1000), "rows": p["numInputRows"],
                 "ckpt_ms": round(h.checkpoint_s * 1000, 1), "apply_s": round(h.apply_s, 2),
                 "restore_s": round(h.restore_s, 2), "restores": h.restores,
                 "operator_s": round(h.batch_s, 2)}
            batches.append(b)
            res["peak_rss_mb_per_executor"] = round(max(rss.peak.values(), default=0.0), 1)
            save()
            return b

        mat = dfs / job / "mat"
        with RssSampler(driver_jvm) as rss:
            op = operator()
            q = start(op)
            run_batch(0, op)
            res["phase"] = "waiting for materialization"
            save()
            res["first_mat_wait_s"] = _quiet(mat, time.time(), 1800.0)
            before = listing(dfs)
            t_rounds = time.perf_counter()
            for i in range(1, a.rounds + 1):
                run_batch(i, op)
            res["rounds_s"] = round(time.perf_counter() - t_rounds, 1)
            res["phase"] = "waiting for the last materialization"
            save()
            res["final_mat_wait_s"] = _quiet(mat, time.time(), 1800.0)
            after = listing(dfs)
            up = batches[1:]
            new = sum(s - before.get(p, 0) for p, s in after.items()
                      if s > before.get(p, 0))
            res.update({
                "batch_ms_p50": percentile([b["ms"] for b in up], 50),
                "batch_ms_p99": percentile([b["ms"] for b in up], 99),
                "ckpt_ms_p50": percentile([b["ckpt_ms"] for b in up], 50),
                "ckpt_ms_p99": percentile([b["ckpt_ms"] for b in up], 99),
                "first_batch_ms": batches[0]["ms"],
                "mat_upload_bytes": new / len(up),
                "dfs_bytes_at_restart": sum(after.values()),
                "mat_files_at_restart": sum(p.startswith(f"{job}/mat/") for p in after)})
            res["phase"] = "restart"
            save()
            q.stop()
            op.close()
            q = None
            op = operator()
            q = start(op)
            b = run_batch(a.rounds + 1, op)
            res.update({"restart_first_batch_ms": b["ms"], "restart_restore_s": b["restore_s"],
                        "restart_restores": b["restores"], "phase": "done"})
    except Exception as e:  # report what was measured, and what failed at which size
        res["error"] = f"{res['phase']} failed at keys={a.keys}: {type(e).__name__}: " + \
            str(e)[:1500]
    finally:
        res["total_s"] = round(time.perf_counter() - t_all, 1)
        save()
        try:
            if q is not None:
                q.stop()
            if op is not None:
                op.close()
            if tree is not None:
                tree.shutdown()
            if spark is not None:
                stop_spark()
        finally:
            stop_local_cluster(cluster)
            for d in (staging, src, chk, local, dfs):
                shutil.rmtree(d, ignore_errors=True)


def run_operator(keys: int, value_bytes: int, rounds: int, update_fraction: float,
                 workdir: str, *, seed: int = 0, executor_memory: str = "2g",
                 timeout_s: float = 7200.0) -> dict[str, Any]:
    """Measure the operator on the workload above in a child process (its own Ray cluster
    and Spark session); returns the row, with ``error`` set if the run did not complete."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    return in_child("experiments.large_state_operator", [
        "--keys", str(keys), "--value-bytes", str(value_bytes), "--rounds", str(rounds),
        "--update-fraction", str(update_fraction), "--workdir", str(work), "--seed", str(seed),
        "--executor-memory", executor_memory, "--timeout-s", str(timeout_s)],
        work / "operator", "dstl-ray-operator-rocksdb", keys, timeout_s)


def main() -> None:
    p = workload_parser(__doc__)
    p.add_argument("--executor-memory", default="2g")
    p.add_argument("--timeout-s", type=float, default=7200.0)
    a = p.parse_args()
    if a.child:
        _child(a)
        return
    import tempfile

    work = a.workdir or tempfile.mkdtemp(prefix="large-state-op-")
    res = run_operator(a.keys, a.value_bytes, a.rounds, a.update_fraction, work, seed=a.seed,
                       executor_memory=a.executor_memory, timeout_s=a.timeout_s)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
