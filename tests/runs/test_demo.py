"""`make demo` (the main job) in a short run: its own 3-node Ray cluster, RayDP, a node actor
and an executor killed half-way, and the final state checked against a batch recomputation."""

from __future__ import annotations

import json

import pytest


@pytest.mark.background("demo")
def test_demo_short_run(background_run):
    # dstl-ray demo --duration 14 --window 5 --before-checkpoints 3 (tests/conftest.py RUNS)
    run = background_run("demo")
    base, proc = run.out / "demo", run.proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[demo] OK" in proc.stdout
    # the terminal gets progress lines and the summary; Ray's, Spark's and the JVM's logs
    # (the stack traces after the injected kill among them) go to a file
    assert all(line.startswith(("[demo]", "  ")) or not line.strip()
               for line in proc.stdout.splitlines()), proc.stdout[-3000:]
    assert not proc.stderr.strip(), proc.stderr[-3000:]
    assert (base / "logs" / "demo.log").stat().st_size > 1000
    summary = json.loads((base / "summary.json").read_text())
    assert summary["state_matches_recomputation"] is True
    assert summary["state_reader_rows"] >= 3 * summary["users"] > 0  # count, sum, hist
    assert summary["batches"] >= 2 and summary["killed"] and summary["recovery_s"] is not None
    # recovery restores speed: p50 before the failure and after the cluster healed
    before = summary["checkpoint_ms_p50_before_failure"]
    after = summary["checkpoint_ms_p50_after_recovery"]
    assert before > 0 and "healed_s" in summary
    assert after is None or after > 0
    if summary["checkpoints_after_recovery"] >= 10:  # enough to mean something
        assert after <= 1.2 * before, summary
    # the operator's metrics: its counts, and the same per batch in the query's progress
    metrics, shown = summary["metrics"], summary["last_progress_metrics"]
    assert metrics["rows"] == summary["rows"] and metrics["timers_fired"] > 0, metrics
    assert metrics["files_written"] > 0 and metrics["state_rows"] > 0
    assert summary["progress_updates_with_metrics"] >= 1 and shown["checkpoint_ms"] > 0
    assert (base / "checkpoint_latency.png").stat().st_size > 1000
