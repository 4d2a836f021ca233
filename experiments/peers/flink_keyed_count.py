"""Flink 2.3's changelog state backend on a keyed count, run by Flink's own interpreter.

    <flink-venv>/bin/python experiments/peers/flink_keyed_count.py --out result.json \
        [--taskmanagers N] [--parallelism 4] [--seconds 30] [--interval-ms 200]

A Flink SQL job ``INSERT INTO blackhole SELECT k, COUNT(*) FROM src GROUP BY k`` at 20,000
rows/s on a local MiniCluster, hashmap backend with ``state.changelog.enabled``, DSTL
on file://. Reports the REST API's checkpoint figures, files created (seen by the experiments'
``file_watcher``, in a process of its own, as on the dstl-ray side), and recovery: cancel the job (checkpoints retained), start it again from the
latest checkpoint, time until the restored job is RUNNING and has completed a checkpoint.

The source (``--input``): ``bursts`` is SQL's ``datagen`` connector, which emits each second's
rows at once and then sleeps until the next second (the legacy ``DataGeneratorSource.run``);
``even`` is the Source API's ``DataGeneratorSource`` with ``RateLimiterStrategy.perSecond``
(a Guava rate limiter per reader: the rows spread evenly over the second), generating the
sequence 0, 1, 2, ... through ``IndexLookupGeneratorFunction`` (both Java: no Python runs in
the pipeline), keyed ``k = value % 10000``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import urllib.request
from pathlib import Path

# the experiments' file watcher, shared with the dstl-ray side (plain stdlib: it runs here)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from file_watcher import FileWatcher  # noqa: E402


def rest(port: int, path: str):
    return json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10))


def file_kind(rel: str) -> str:
    """What a file Flink created is, from its path relative to the base directory:
    ``changelog`` (under ``dstl/``), ``metadata`` (``_metadata``), ``temp:<kind>`` (a
    RecoverableWriter's ``.NAME.inprogress.<uuid>`` before its commit renames it), state
    files of the checkpoint directory (``shared``, ``taskowned``, ``exclusive`` in
    ``chk-n/``), or ``other``."""
    parts = rel.split("/")
    name = parts[-1]
    if ".inprogress." in name:
        target = name[1:].split(".inprogress.")[0] if name.startswith(".") else name
        return "temp:" + file_kind("/".join([*parts[:-1], target]))
    if parts[0] == "dstl":
        return "changelog"
    if name == "_metadata":
        return "metadata"
    for d in ("shared", "taskowned"):
        if d in parts[:-1]:
            return d
    if any(p.startswith("chk-") for p in parts[:-1]):
        return "exclusive"
    return "other"


def even_source(conf, rows_per_second: int, rows: int):
    """A table environment whose view ``src (k BIGINT)`` is fed at an even rate: Flink's
    ``DataGeneratorSource`` with ``RateLimiterStrategy.perSecond`` (Java, through the
    gateway; its generator function is Java's ``IndexLookupGeneratorFunction`` over
    0..rows-1)."""
    from pyflink.common import Types, WatermarkStrategy
    from pyflink.datastream import StreamExecutionEnvironment
    from pyflink.datastream.connectors import Source
    from pyflink.java_gateway import get_gateway
    from pyflink.table import StreamTableEnvironment

    env = StreamExecutionEnvironment.get_execution_environment(conf)
    t = StreamTableEnvironment.create(env)
    jvm = get_gateway().jvm
    longs = Types.LONG().get_java_type_info()
    values = jvm.java.util.stream.LongStream.range(0, rows).boxed().collect(
        jvm.java.util.stream.Collectors.toList())
    gen = jvm.org.apache.flink.connector.datagen.functions.IndexLookupGeneratorFunction(
        longs, values)
    rate = jvm.org.apache.flink.api.connector.source.util.ratelimit.RateLimiterStrategy \
        .perSecond(float(rows_per_second))
    source = jvm.org.apache.flink.connector.datagen.source.DataGeneratorSource(
        gen, rows, rate, longs)
    stream = env.from_source(Source(source), WatermarkStrategy.no_watermarks(), "even",
                             Types.LONG())
    t.create_temporary_view("seq", stream)
    t.execute_sql("CREATE TEMPORARY VIEW src AS SELECT f0 % 10000 AS k FROM seq")
    return t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--base", default="/tmp/dstl-vs-flink")
    p.add_argument("--taskmanagers", type=int, default=1)
    p.add_argument("--parallelism", type=int, default=4)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--interval-ms", type=int, default=200)
    p.add_argument("--rows-per-second", type=int, default=20000)
    p.add_argument("--rest-port", type=int, default=18081)
    p.add_argument("--input", choices=("bursts", "even"), default="bursts")
    a = p.parse_args()
    from pyflink.common import Configuration
    from pyflink.table import EnvironmentSettings, TableEnvironment

    base = a.base
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    slots = max(1, -(-a.parallelism // a.taskmanagers))

    def env(restore: str | None = None) -> TableEnvironment:
        conf = Configuration()
        opts = {
            "execution.checkpointing.interval": f"{a.interval_ms} ms",
            "execution.checkpointing.externalized-checkpoint-retention":
                "RETAIN_ON_CANCELLATION",
            "state.backend.type": "hashmap",
            "state.changelog.enabled": "true",
            "state.changelog.storage": "filesystem",
            "state.changelog.dstl.dfs.base-path": f"file://{base}/dstl",
            "execution.checkpointing.dir": f"file://{base}/cp",
            "state.changelog.periodic-materialize.interval": "10 s",
            "parallelism.default": str(a.parallelism),
            "local.number-taskmanager": str(a.taskmanagers),
            "taskmanager.numberOfTaskSlots": str(slots),
            "rest.port": str(a.rest_port),
        }
        if restore:
            opts["execution.state-recovery.path"] = restore
            # the changelog backend cannot restore in the default NO_CLAIM mode
            opts["execution.state-recovery.claim-mode"] = "CLAIM"
        for k, v in opts.items():
            conf.set_string(k, v)
        if a.input == "even":
            # enough rows for the run, the recovery and its first checkpoints
            t = even_source(conf, a.rows_per_second,
                            int(a.rows_per_second * (a.seconds + 120)))
        else:
            t = TableEnvironment.create(EnvironmentSettings.new_instance().in_streaming_mode()
                                        .with_configuration(conf).build())
            t.execute_sql(f"CREATE TABLE src (k BIGINT) WITH ('connector'='datagen', "
                          f"'rows-per-second'='{a.rows_per_second}', 'fields.k.min'='0', "
                          f"'fields.k.max'='9999')")
        t.execute_sql("CREATE TABLE snk (k BIGINT, c BIGINT) WITH ('connector'='blackhole')")
        return t

    watcher = FileWatcher(Path(base)).__enter__()
    t = env()
    res = t.execute_sql("INSERT INTO snk SELECT k, COUNT(*) FROM src GROUP BY k")
    time.sleep(a.seconds)
    jid = rest(a.rest_port, "/jobs")["jobs"][0]["id"]
    cps = rest(a.rest_port, f"/jobs/{jid}/checkpoints")
    history = cps.get("history", [])
    e2e = cps["summary"]["end_to_end_duration"]
    size = cps["summary"].get("checkpointed_size", {})
    res.get_job_client().cancel().result()
    # the checkpoint retained on cancellation: the REST figure above may already have been
    # subsumed by a newer checkpoint completed before the cancel
    retained = [os.path.join(r, "") for r, _, fs in os.walk(os.path.join(base, "cp", jid))
                if "_metadata" in fs and os.path.basename(r).startswith("chk-")]
    if not retained:
        raise SystemExit(f"no checkpoint retained under {base}/cp/{jid}")
    latest = "file://" + max(retained, key=lambda d: int(os.path.basename(d[:-1])[4:]))
    watcher.__exit__()
    files = list(watcher.seen)
    dstl = [f for f in files if "/dstl/" in f]
    kinds: dict[str, int] = {}
    for f in files:
        k = file_kind(os.path.relpath(f, base))
        kinds[k] = kinds.get(k, 0) + 1
    completed = cps["counts"]["completed"]
    result = {
        "system": "flink", "version": "2.3.0", "taskmanagers": a.taskmanagers,
        "input": a.input,
        "parallelism": a.parallelism, "seconds": a.seconds, "interval_ms": a.interval_ms,
        "checkpoints_completed": completed, "checkpoints_failed": cps["counts"]["failed"],
        "e2e_ms": {k: e2e.get(k) for k in ("min", "p50", "p90", "p99", "max", "avg")},
        "checkpointed_size_avg_bytes": size.get("avg"),
        "changelog_files_created": len(dstl), "files_created": len(files),
        "changelog_files_per_checkpoint": len(dstl) / max(1, completed),
        "files_per_checkpoint": len(files) / max(1, completed),
        "files_per_checkpoint_by_kind": {
            k: n / max(1, completed) for k, n in sorted(kinds.items())},
        "history_sample": [{k: h.get(k) for k in ("id", "end_to_end_duration",
                                                   "checkpointed_size", "status")}
                           for h in history[:20]],
    }
    # recovery: a new job from the latest retained checkpoint
    t0 = time.time()
    t2 = env(restore=latest)
    res2 = t2.execute_sql("INSERT INTO snk SELECT k, COUNT(*) FROM src GROUP BY k")
    jid2 = res2.get_job_client().get_job_id().to_string() if hasattr(
        res2.get_job_client().get_job_id(), "to_string") else str(
        res2.get_job_client().get_job_id())
    recovered = None
    last = None
    while time.time() - t0 < 60:
        try:
            c2 = rest(a.rest_port, f"/jobs/{jid2}/checkpoints")
            last = c2
            if c2["counts"].get("restored", 0) >= 1 and c2["counts"]["completed"] >= 1:
                recovered = time.time() - t0
                break
        except Exception as e:  # noqa: BLE001 - REST not up yet
            last = repr(e)
        time.sleep(0.05)
    if recovered is None:
        try:
            exc = rest(a.rest_port, f"/jobs/{jid2}/exceptions")
            result["recovery_error"] = str(exc.get("root-exception") or exc)[:3000]
        except Exception as e:  # noqa: BLE001
            result["recovery_error"] = f"no exception history: {e}; last: {str(last)[:500]}"
        print("recovery failed:", result["recovery_error"][:1500], flush=True)
    result["recovery_s"] = recovered
    result["restored_from"] = latest
    res2.get_job_client().cancel().result()
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "history_sample"}), flush=True)


if __name__ == "__main__":
    main()
