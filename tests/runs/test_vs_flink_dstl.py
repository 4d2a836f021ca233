"""The dstl-ray side of ``experiments.vs_flink`` in CI size: 4 subtasks on 2 Ray nodes
checkpointing every 200 ms write exactly ONE changelog file per checkpoint (issue target) and
no file per checkpoint besides it and the ``_metadata``, every checkpoint completes, and the
job restores from its latest checkpoint."""

from __future__ import annotations

import json

import pytest


@pytest.mark.background("vs_flink")
def test_vs_flink_dstl_side_one_file_per_checkpoint(background_run):
    # --no-flink --nodes 2 --seconds 4 --input even (tests/conftest.py RUNS)
    done = background_run("vs_flink")
    proc = done.proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = json.loads((done.out / "vs_flink.json").read_text())["runs"]
    d = run["dstl_ray"]
    assert d["checkpoints_completed"] >= 10
    assert d["changelog_files_per_checkpoint"] == 1.0, d["batch_triggers"]
    # every checkpoint of an even input has changes, and each wrote one file
    assert d["checkpoints_with_changes"] == d["checkpoints_completed"]
    assert d["changelog_files_per_checkpoint_with_changes"] == 1.0
    # every file created per checkpoint is accounted for: one changelog file, one _metadata,
    # and no temp names (file:// writes link an unnamed inode); the job lease, taken at the
    # first checkpoint (a temp name renamed over it: the watcher sees every name), is the
    # only other file of a run this short (no materialization yet)
    kinds = d["files_per_checkpoint_by_kind"]
    assert kinds["changelog"] == kinds["metadata"] == 1.0, kinds
    assert set(kinds) <= {"changelog", "metadata", "lease", "temp:lease"}, (
        kinds, d["other_files_sample"])
    assert d["input"] == "even"
    assert d["ack_ms"]["p50"] <= d["e2e_ms"]["p50"]
    assert d["batch_triggers"]["delay"] == 0
    assert d["e2e_ms"]["n"] == d["checkpoints_completed"]
    assert 0 < d["recovery_s"] < 60
