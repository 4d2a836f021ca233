"""The Spark-pipeline chaos harness in its CI size: seeded faults (executor kill, node-actor
kill, task failure, driver restart) over 3 rounds, then one micro-batch of 20,000 distinct keys
(requests far above Ray's inline limit) with faults while it runs; no change lost, no file
leaked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_chaos_spark_quick(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.chaos_spark", "--quick",
                           "--seed", "3", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "chaos_spark.json").read_text())
    assert data["faults_injected"] >= 3
    assert data["changes_lost"] == 0 and data["leaked_files"] == 0
    assert data["missing_files"] == 0 and data["changes_verified"] > 0
    assert data["checkpoints_completed"] >= 6
    assert data["max_keys_per_batch"] >= 20_000 and data["big_batches"][0]["faults"]
