"""Spark 3.5's own RocksDB state store with changelog checkpointing on a large keyed state:
the Spark side of ``experiments.large_state`` (which puts these figures next to dstl-ray's).

Workload: a first micro-batch writes ``keys`` distinct keys (bigint) with random values of
``value_bytes`` bytes (the state); then ``rounds`` micro-batches each give new random values to
``update_fraction`` of the keys (chosen at random, without repetition within a batch); one more
such batch after a restart measures recovery. The keyed state holds the latest value per key:
``groupBy(k).agg(last(v))`` in update mode, written to the ``noop`` sink.

Why the native aggregation and not ``applyInPandasWithState``: both keep one state row per key
in the same RocksDB state store and commit it the same way (changelog file per partition and
version, snapshots uploaded by the maintenance thread), so the state store costs measured here
are the same; but the Python operator adds per-group Python overhead (about 1,500 groups/s on
this machine, see the anchor probes), which would make the 20M-key first batch take hours and
bury the state store in the figures. The native aggregation is Spark's cheapest keyed state, so
it is the fairest lower bound for Spark.

Setup: local[2], ``spark.sql.shuffle.partitions=parallelism``, RocksDBStateStoreProvider with
``spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled=true``, other state
store settings at Spark's defaults. With changelog checkpointing a commit writes one changelog
file per partition; it makes a local RocksDB snapshot (flush + checkpoint) every 10 versions or
when the partition's changelog has more than 10,000 entries, and the maintenance thread (every
60 s) uploads the latest one; a store closed before that drops it. Input: parquet files written
up front into a staging directory; the query (``maxFilesPerTrigger=1``) reads a directory into
which one file is moved per micro-batch, then ``processAllAvailable()``: every batch is one file
and the checkpoint location is listed between batches. After the first batch, and after the
rounds, the run waits for the upload of the latest local snapshot (if a batch made one), so the
rounds start from, and the restart loads, an uploaded snapshot, as in a long-running query.

Measures (per update batch unless said): ``ckpt_ms`` is the state operator's ``commitTimeMs``
(``StreamingQueryProgress.stateOperators``; a SQL metric, so the sum over the partitions'
tasks, 2 of which run at once: ``ckpt_ms_per_partition_p50`` divides by the partitions; the
RocksDB breakdown is ``rocksdb_commit_ms_p50``); ``batch_ms`` is ``durationMs.triggerExecution``;
``mat_upload_bytes`` is the bytes that appeared in the checkpoint location's ``state/``
directory during the rounds (changelogs, and snapshot files uploaded meanwhile) plus the last
snapshot upload after them, divided by the rounds (``final_snapshot`` and ``first_snapshot``
give the uploads of the waits; Hadoop's ``.crc`` side files and in-flight ``.tmp`` files left
out); ``files_per_batch`` counts new files there (``files_per_batch_all``: in the whole
checkpoint location); ``peak_rss_mb`` is VmHWM of the driver JVM (local mode: the one Spark
process); ``recovery_s`` is from starting the query again on the same checkpoint location (same
JVM, new query run: the state store is loaded from the checkpoint location) until its first
batch (one more update file) is processed, to compare with ``update_batch_ms_p50``;
``restart_first_batch_ms`` is that batch's ``triggerExecution`` (the operator's side,
``experiments.large_state_operator``, restarts its query the same way and measures the same).

Spark runs in a child process (a fresh JVM per run: its own heap setting and peak RSS, and an
OOM there does not take the caller down). If a batch fails or the run times out, the result
holds what was measured and an ``error`` saying what failed at which size. The machine's load
average is recorded: the figures are only comparable with runs under similar load.

Run: python -m experiments.large_state_spark --keys N --rounds R [--value-bytes 100]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from .common import percentile, run_in_group

ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
CHANGELOG = "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled"
REPO = Path(__file__).resolve().parent.parent
KEEP_METRICS = {  # of the RocksDB state store's custom metrics (summed over partitions)
    "rocksdbCommitFlushLatency", "rocksdbCommitCheckpointLatency",
    "rocksdbCommitFileSyncLatencyMs", "rocksdbCommitCompactLatency",
    "rocksdbCommitWriteBatchLatency", "rocksdbCommitPauseLatency", "rocksdbSstFileSize",
    "rocksdbPutCount", "rocksdbGetCount", "rocksdbBytesCopied", "rocksdbFilesCopied",
    "rocksdbFilesReused", "rocksdbZipFileBytesUncompressed"}
KINDS = ((".changelog", "changelog"), (".zip", "snapshot_zip"), (".sst", "snapshot_sst"),
         (".log", "rocksdb_log"))  # of the files in the state directory, by name
LOG4J = ("rootLogger.level = error\nrootLogger.appenderRef.c.ref = c\nappender.c.type = Console\n"
         "appender.c.name = c\nappender.c.target = SYSTEM_ERR\n")


def run_spark(keys: int, value_bytes: int, rounds: int, update_fraction: float,
              parallelism: int, workdir: str, *, seed: int = 0, driver_memory: str = "4g",
              timeout_s: float = 7200.0, keep: bool = False, maintenance_s: int = 60,
              settle: bool = True) -> dict[str, Any]:
    """Measure Spark's RocksDB state store (changelog checkpointing) on the workload above, in
    a child process; returns the figures (see the module docstring), with ``error`` set if the
    run did not complete within ``timeout_s``. ``workdir`` holds the input, the checkpoint and
    Spark's local directories (deleted at the end unless ``keep``) and the child's log
    ``spark.log``. ``maintenance_s`` is the state store maintenance interval; ``settle=False``
    skips the waits for snapshot uploads (the restart may then replay every changelog)."""
    if keys < 1 or value_bytes < 1 or rounds < 1 or parallelism < 1:
        raise ValueError(f"keys, value_bytes, rounds and parallelism must be >= 1, got {keys}, "
                         f"{value_bytes}, {rounds}, {parallelism}")
    if not 0 < update_fraction <= 1:
        raise ValueError(f"update_fraction must be in (0, 1], got {update_fraction}")
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    args = ["--keys", str(keys), "--value-bytes", str(value_bytes), "--rounds", str(rounds),
            "--update-fraction", str(update_fraction), "--parallelism", str(parallelism),
            "--workdir", str(work), "--seed", str(seed), "--driver-memory", driver_memory,
            "--maintenance-s", str(maintenance_s)]
    args += ["--keep"] if keep else []
    args += [] if settle else ["--no-settle"]
    res = in_child("experiments.large_state_spark", args, work / "spark", "spark-rocksdb",
                   keys, timeout_s)
    if not keep:
        for d in ("staging", "input", "chk", "local"):
            shutil.rmtree(work / d, ignore_errors=True)
    return res


def _write_parquet(path: Path, ks: Any, value_bytes: int, rng: Any,
                   chunk: int = 1_000_000) -> None:
    """Rows (k bigint, v binary of ``value_bytes`` random bytes), one row group per chunk."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("k", pa.int64()), ("v", pa.binary())])
    with pq.ParquetWriter(str(path), schema, compression="none") as w:
        for i in range(0, len(ks), chunk):
            k = ks[i:i + chunk]
            offsets = np.arange(0, (len(k) + 1) * value_bytes, value_bytes, dtype=np.int32)
            v = pa.Array.from_buffers(pa.binary(), len(k), [
                None, pa.py_buffer(offsets), pa.py_buffer(rng.bytes(len(k) * value_bytes))])
            w.write_table(pa.table({"k": pa.array(k, pa.int64()), "v": v}, schema=schema))


def in_child(module: str, args: list[str], prefix: Path, backend: str, keys: int,
             timeout_s: float) -> dict[str, Any]:
    """Run ``module``'s measurement (``--child RESULT`` plus ``args``) in a process group of
    its own, its log at ``prefix.log``; the row it wrote (partial if it failed), with
    ``run_s``, and ``error`` saying what failed at which phase if it did not exit cleanly."""
    out, log = prefix.with_suffix(".result.json"), prefix.with_suffix(".log")
    out.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    t0 = time.perf_counter()
    rc = run_in_group([sys.executable, "-m", module, "--child", str(out), *args], str(log),
                      timeout_s, env, str(REPO))
    res: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {
        "backend": backend, "keys": keys, "phase": "start"}
    res["run_s"] = round(time.perf_counter() - t0, 1)
    if rc != 0 and "error" not in res:
        why = f"timed out after {timeout_s:.0f}s" if rc is None else f"exited with {rc}"
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        res["error"] = f"{module} {why} during {res.get('phase')} at keys={keys}: {tail}"
    return res


def keys_per_update(keys: int, update_fraction: float) -> int:
    return max(1, round(keys * update_fraction))


def write_inputs(staging: Path, keys: int, rounds: int, update_fraction: float,
                 value_bytes: int, seed: int) -> list[Path]:
    """The workload's input files in ``staging``, in batch order: every key, then ``rounds``
    + 1 update batches (the last one for after the restart). The same arguments give the
    same files (the operator's side, ``experiments.large_state_operator``, reads the same)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    m = keys_per_update(keys, update_fraction)
    files = [staging / f"batch-{i:05d}.parquet" for i in range(rounds + 2)]
    _write_parquet(files[0], np.arange(keys, dtype=np.int64), value_bytes, rng)
    for f in files[1:]:
        _write_parquet(f, rng.choice(keys, m, replace=False), value_bytes, rng)
    return files


def listing(root: Path) -> dict[str, int]:
    """Size of every file under ``root``, leaving out Hadoop's ``.crc`` side files and
    in-flight temporary files (hidden names, ``.tmp``)."""
    out = {}
    for dp, _, fs in os.walk(root):
        for f in fs:
            if f.startswith(".") or f.endswith((".crc", ".tmp")):
                continue
            p = os.path.join(dp, f)
            try:
                out[os.path.relpath(p, root)] = os.path.getsize(p)
            except FileNotFoundError:  # deleted by the maintenance thread meanwhile
                pass
    return out


def written(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """Files and bytes that appeared (or grew) from ``before`` to ``after``, by kind."""
    new = {p: s - before.get(p, 0) for p, s in after.items()
           if p not in before or s > before[p]}
    kinds: dict[str, int] = {}
    for p, s in new.items():
        kind = next((k for suffix, k in KINDS if p.endswith(suffix)), "other")
        kinds[kind] = kinds.get(kind, 0) + s
    return {"bytes": sum(new.values()), "files": sum(p not in before for p in new),
            "by_kind": kinds}


def _progress(q: Any, batch_id: int, timeout: float = 60.0) -> dict[str, Any]:
    """The progress of batch ``batch_id`` (posted just after ``processAllAvailable`` returns)."""
    deadline = time.time() + timeout
    while True:
        for p in q.recentProgress:
            p = p if isinstance(p, dict) else json.loads(p.json)
            if p.get("batchId") == batch_id and p.get("numInputRows", 0) > 0:
                return p
        if time.time() > deadline:
            raise TimeoutError(f"no progress for batch {batch_id} after {timeout}s")
        time.sleep(0.05)


def _ops(p: dict[str, Any]) -> dict[str, Any]:
    """The state operators' figures of one progress, summed over operators."""
    out: dict[str, Any] = {"commit_ms": 0, "rows_total": 0, "custom": {}}
    for op in p.get("stateOperators", []):
        out["commit_ms"] += op.get("commitTimeMs", 0)
        out["rows_total"] += op.get("numRowsTotal", 0)
        for k, v in (op.get("customMetrics") or {}).items():
            if k in KEEP_METRICS:
                out["custom"][k] = out["custom"].get(k, 0) + v
    return out


def _await_snapshots(state: Path, version: int, timeout: float) -> float:
    """Wait until every partition's state directory holds a snapshot (``<version>.zip``) of at
    least ``version``: with changelog checkpointing the maintenance thread uploads the latest
    local snapshot only every maintenance interval, and closing the store drops a snapshot not
    uploaded yet. Returns the seconds waited (``timeout`` if it did not happen)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        parts = [d for d in (state / "0").iterdir() if d.is_dir() and d.name.isdigit()]
        if parts and all(max((int(f.name[:-4]) for f in d.glob("*.zip")), default=0) >= version
                         for d in parts):
            break
        time.sleep(0.5)
    return round(time.perf_counter() - t0, 1)


def _vmhwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _save(path: Path, res: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, path)


def _session(a: argparse.Namespace, work: Path) -> Any:
    (work / "log4j2.properties").write_text(LOG4J)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("large-state-spark")
             .config("spark.driver.memory", a.driver_memory)
             .config("spark.driver.extraJavaOptions",
                     f"-Dlog4j2.configurationFile=file:{work / 'log4j2.properties'}")
             .config("spark.local.dir", str(work / "local"))
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", str(a.parallelism))
             .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB)
             .config(CHANGELOG, "true")
             .config("spark.sql.streaming.stateStore.maintenanceInterval", f"{a.maintenance_s}s")
             .config("spark.sql.streaming.numRecentProgressUpdates", str(a.rounds + 10))
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


class _Meter:
    """Lists the checkpoint location after each batch and each wait, so every byte written to
    the state directory falls in exactly one window."""

    def __init__(self, chk: Path) -> None:
        self.chk = chk
        self.state, self.every = listing(chk / "state"), listing(chk)

    def window(self) -> tuple[dict[str, Any], dict[str, Any]]:
        st, ev = listing(self.chk / "state"), listing(self.chk)
        out = written(self.state, st), written(self.every, ev)
        self.state, self.every = st, ev
        return out

    def batch(self, q: Any, i: int, wall_s: float) -> dict[str, Any]:
        p = _progress(q, i)
        w, w_all = self.window()
        ops = _ops(p)
        return {"batch": i, "ms": p["durationMs"]["triggerExecution"],
                "wall_ms": round(wall_s * 1000), "commit_ms": ops["commit_ms"],
                "rows": p["numInputRows"], "rows_total": ops["rows_total"],
                "state_bytes_written": w["bytes"], "state_files_new": w["files"],
                "all_files_new": w_all["files"], "by_kind": w["by_kind"],
                "durations_ms": p["durationMs"], "rocksdb": ops["custom"]}

    def settle(self, batches: list[dict[str, Any]], timeout: float) -> dict[str, Any]:
        """Wait for the upload of the latest local snapshot made by ``batches`` (batch i
        commits version i + 1), if any; the bytes that appeared meanwhile."""
        made = [b["batch"] + 1 for b in batches if b["rocksdb"].get(
            "rocksdbCommitFlushLatency", 0) + b["rocksdb"].get(
            "rocksdbCommitCheckpointLatency", 0) > 0]
        waited = _await_snapshots(self.chk / "state", max(made), timeout) if made else 0.0
        w, _ = self.window()
        return {"version": max(made, default=None), "wait_s": waited,
                "timed_out": waited >= timeout, "bytes": w["bytes"], "by_kind": w["by_kind"]}


def _summary(a: argparse.Namespace, batches: list[dict[str, Any]],
             final: dict[str, Any]) -> dict[str, Any]:
    up = batches[1:]
    ms, commit = [b["ms"] for b in up], [b["commit_ms"] for b in up]
    kinds = dict(final["by_kind"])
    for b in up:
        for k, v in b["by_kind"].items():
            kinds[k] = kinds.get(k, 0) + v
    in_rounds = sum(b["state_bytes_written"] for b in up)
    return {
        "ckpt_ms_p50": percentile(commit, 50), "ckpt_ms_p99": percentile(commit, 99),
        "ckpt_ms_per_partition_p50": percentile(commit, 50) / a.parallelism,
        "batch_ms_p50": percentile(ms, 50), "batch_ms_p99": percentile(ms, 99),
        "mat_upload_bytes": (in_rounds + final["bytes"]) / len(up),
        "mat_upload_bytes_total": in_rounds + final["bytes"],
        "mat_upload_bytes_in_rounds": in_rounds,
        "mat_upload_bytes_by_kind": kinds,
        "files_per_batch": sum(b["state_files_new"] for b in up) / len(up),
        "files_per_batch_all": sum(b["all_files_new"] for b in up) / len(up),
        "first_batch_ms": batches[0]["ms"], "first_batch_commit_ms": batches[0]["commit_ms"],
        "first_batch_state_bytes_written": batches[0]["state_bytes_written"],
        "rocksdb_commit_ms_p50": {k: percentile([b["rocksdb"].get(k, 0) for b in up], 50)
                                  for k in sorted(KEEP_METRICS) if k.startswith("rocksdbCommit")},
        "rocksdb_sst_bytes_max": max(b["rocksdb"].get("rocksdbSstFileSize", 0)
                                     for b in batches),
        "rows_total": up[-1]["rows_total"]}


def _child(a: argparse.Namespace) -> None:
    """The measurement, in the child process; writes the (partial) result after each phase."""
    work, out = Path(a.workdir), Path(a.child)
    staging, src, chk, local = (work / d for d in ("staging", "input", "chk", "local"))
    for d in (staging, src, chk, local):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    m = keys_per_update(a.keys, a.update_fraction)
    res: dict[str, Any] = {
        "backend": "spark-rocksdb", "keys": a.keys, "value_bytes": a.value_bytes,
        "state_bytes": a.keys * a.value_bytes, "rounds": a.rounds,
        "update_fraction": a.update_fraction, "keys_per_update_batch": m,
        "parallelism": a.parallelism, "driver_memory": a.driver_memory,
        "ckpt_ms_source": "stateOperators[].commitTimeMs (summed over the partitions' tasks)",
        "maintenance_s": a.maintenance_s, "loadavg_at_start": os.getloadavg()[0],
        "phase": "setup"}
    spark = q = None
    t_all = time.perf_counter()
    wait = a.maintenance_s + 300.0  # a maintenance tick, then the upload itself
    try:
        files = write_inputs(staging, a.keys, a.rounds, a.update_fraction, a.value_bytes,
                             a.seed)
        res["setup_s"] = round(time.perf_counter() - t_all, 1)
        res["phase"] = "spark start"
        _save(out, res)
        from pyspark.sql import functions as F

        from spark_glue.pipeline import publish

        spark = _session(a, work)
        pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
        res["spark_version"] = spark.version

        def start() -> Any:
            return (spark.readStream.schema("k BIGINT, v BINARY").option("maxFilesPerTrigger", 1)
                    .parquet(str(src)).groupBy("k").agg(F.last("v").alias("v"))
                    .writeStream.outputMode("update").format("noop")
                    .option("checkpointLocation", str(chk)).start())

        def feed(i: int) -> None:
            publish(files[i], src / files[i].name)  # in order, as the file source reads

        def run_batch(i: int) -> None:
            res["phase"] = f"batch {i}" + (" (first, all keys)" if i == 0 else "")
            _save(out, res)
            t0 = time.perf_counter()
            feed(i)
            q.processAllAvailable()
            batches.append(meter.batch(q, i, time.perf_counter() - t0))
            res["peak_rss_mb"] = round(_vmhwm_mb(pid), 1)
            _save(out, res)

        q, meter = start(), _Meter(chk)
        batches: list[dict[str, Any]] = []
        res["batches"] = batches
        run_batch(0)
        if a.settle:  # the rounds start from an uploaded snapshot of the state
            res["phase"] = "waiting for the first snapshot upload"
            _save(out, res)
            res["first_snapshot"] = meter.settle(batches, wait)
        t_rounds = time.perf_counter()
        for i in range(1, a.rounds + 1):
            run_batch(i)
        res["rounds_s"] = round(time.perf_counter() - t_rounds, 1)
        res["phase"] = "waiting for the last snapshot upload"
        _save(out, res)
        final = meter.settle(batches[1:], wait) if a.settle else {"bytes": 0, "by_kind": {}}
        res["final_snapshot"] = final
        res.update(_summary(a, batches, final))
        res["phase"] = "restart"
        _save(out, res)
        q.stop()
        q = None
        st = listing(chk / "state")
        res["state_dir_bytes_at_restart"] = sum(st.values())
        res["snapshot_versions_at_restart"] = sorted(
            {int(Path(p).name.split(".")[0]) for p in st if p.endswith(".zip")})
        res["loadavg_before_restart"] = os.getloadavg()[0]
        t0 = time.perf_counter()
        feed(a.rounds + 1)
        q = start()
        q.processAllAvailable()
        res["recovery_s"] = round(time.perf_counter() - t0, 3)
        p = _progress(q, a.rounds + 1)
        res.update({"recovery_batch_ms": p["durationMs"]["triggerExecution"],
                    "restart_first_batch_ms": p["durationMs"]["triggerExecution"],
                    "recovery_commit_ms": _ops(p)["commit_ms"],
                    "recovery_durations_ms": p["durationMs"],
                    "update_batch_ms_p50": res["batch_ms_p50"],
                    "peak_rss_mb": round(_vmhwm_mb(pid), 1), "phase": "done"})
    except Exception as e:  # report what was measured, and what failed at which size
        res["error"] = f"{res['phase']} failed at keys={a.keys}: {type(e).__name__}: " + \
            str(e)[:1500]
    finally:
        res["total_s"] = round(time.perf_counter() - t_all, 1)
        _save(out, res)
        try:
            if q is not None:
                q.stop()
            if spark is not None:
                spark.stop()
        finally:
            if not a.keep:
                for d in (staging, src, chk, local):
                    shutil.rmtree(d, ignore_errors=True)


def workload_parser(doc: str) -> argparse.ArgumentParser:
    """The workload's arguments (this module's and ``experiments.large_state_operator``'s),
    and the child's hidden ``--child RESULT``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=200_000)
    p.add_argument("--value-bytes", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--update-fraction", type=float, default=0.01)
    p.add_argument("--workdir", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    return p


def main() -> None:
    p = workload_parser(__doc__)
    p.add_argument("--parallelism", type=int, default=4)
    p.add_argument("--driver-memory", default="4g")
    p.add_argument("--maintenance-s", type=int, default=60,
                   help="state store maintenance interval (Spark's default: 60 s)")
    p.add_argument("--no-settle", dest="settle", action="store_false",
                   help="restart without waiting for the snapshot upload")
    p.add_argument("--keep", action="store_true", help="keep input and checkpoint files")
    a = p.parse_args()
    if a.child:
        _child(a)
        return
    import tempfile

    work = a.workdir or tempfile.mkdtemp(prefix="large-state-spark-")
    res = run_spark(a.keys, a.value_bytes, a.rounds, a.update_fraction, a.parallelism, work,
                    seed=a.seed, driver_memory=a.driver_memory, keep=a.keep,
                    maintenance_s=a.maintenance_s, settle=a.settle)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
