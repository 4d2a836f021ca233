"""The Spark-pipeline chaos harness in its CI size: seeded faults (executor kill, node-actor
kill, task failure, driver restart) over 3 rounds, then one micro-batch of 20,000 distinct keys
(requests far above Ray's inline limit) with faults while it runs; no change lost, no file
leaked. Where hosts can be made (root) it runs on 3 network-namespace hosts, an executor on
each, and every small round also cuts a host off from the Spark driver for 5-9 s."""

from __future__ import annotations

import json

import pytest


@pytest.mark.background("chaos_spark")
def test_chaos_spark_quick(background_run):
    # --quick --seed 3 [--hosts 3] (tests/conftest.py RUNS)
    run = background_run("chaos_spark")
    proc = run.proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    on_hosts = (run.out / "chaos_spark_hosts.json").exists()
    data = json.loads((run.out / ("chaos_spark_hosts.json" if on_hosts
                                  else "chaos_spark.json")).read_text())
    if on_hosts:  # executors on several hosts, one cut off from the driver every round
        assert data["hosts"] == 3 and len(set(data["executor_hosts"])) >= 2, data
        assert data["faults_by_kind"]["host_partition"] == len(data["host_partitions"]) >= 3
    assert data["faults_injected"] >= 3
    assert data["changes_lost"] == 0 and data["leaked_files"] == 0
    assert data["missing_files"] == 0 and data["changes_verified"] > 0
    assert data["checkpoints_completed"] >= 6
    assert data["max_keys_per_batch"] >= 20_000 and data["big_batches"][0]["faults"]
