"""The chaos harness (``experiments.chaos``) in its CI size: one episode per fault kind on
file://, and the DFS faults on the loopback S3 server, each against the oracle. One test per
fault kind fails if that kind lost a change, leaked or lost a file, or kept a clean
checkpoint from completing. The kinds of a job's life (clock skew, savepoint cycles, long
stalls) take minutes of quiet windows and stalls each: they run in the experiment, not here;
how their recovery latency ratio is taken is checked without a cluster
(tests/unit/test_chaos_report.py)."""

from __future__ import annotations

import json

import pytest

from experiments.chaos import FAILOVER, KINDS, LIFE_KINDS

CI_KINDS = [k for k in KINDS if k not in LIFE_KINDS]


@pytest.fixture(scope="module")
def chaos_run(background_run):
    """``--quick --seed 5`` over CI_KINDS (tests/conftest.py RUNS: it runs in the background
    from the start of the session)."""
    run = background_run("chaos")
    proc, result = run.proc, run.out / "chaos.json"
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(result.read_text()), proc


def _check(episode: dict) -> None:
    assert episode["changes_lost"] == 0, episode
    assert episode["leaked_files"] == 0 and episode["missing_files"] == 0, episode
    assert episode["clean_checkpoint_failures"] == 0, episode
    assert episode["changes_verified"] > 0 and episode["checkpoints_completed"] >= 1, episode
    # another job on the same tree: faults aimed at this one never reach it
    assert episode["other_job_checkpoints"] >= 1, episode
    assert episode["other_job_declines"] == 0 and episode["other_job_lost"] == 0, episode
    assert episode["other_job_leaked_files"] == 0 == episode["other_job_missing_files"], episode


@pytest.mark.background("chaos")
@pytest.mark.parametrize("kind", CI_KINDS)
def test_fault_kind_loses_no_change_and_leaks_no_file(chaos_run, kind):
    data, _ = chaos_run
    (episode,) = [e for e in data["episodes"]
                  if e["storage"] == "file" and set(e["faults_by_kind"]) == {kind}]
    assert episode["faults_by_kind"][kind] >= 1
    if kind in FAILOVER:
        assert episode["recoveries"] >= episode["faults_by_kind"][kind]
    _check(episode)


@pytest.mark.background("chaos")
def test_dfs_faults_on_s3(chaos_run):
    data, proc = chaos_run
    (episode,) = [e for e in data["episodes"] if e["storage"] == "s3"]
    assert {k for k in episode["faults_by_kind"]} == {k for k in CI_KINDS
                                                      if k.startswith("dfs_")}
    _check(episode)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert data["changes_lost"] == 0 and data["peak_rss_mb"]["node_actors"] > 0


@pytest.mark.background("chaos_merged")
def test_merged_files_under_faults(background_run):
    """FLIP-306 across checkpoints (nodes append flushes, subtasks append materializations)
    under node kills, writer kills, torn appends, coordinator restarts, rescales and a job
    restarted under its id after DELETE_ON_CANCELLATION."""
    kinds = "node_kill,writer_kill,dfs_torn,coordinator_restart,rescale,job_restart"
    run = background_run("chaos_merged")  # --quick --seed 3 --file-merging across_checkpoints
    proc, result = run.proc, run.out / "chaos.json"
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(result.read_text())
    assert {k for e in data["episodes"] for k in e["faults_by_kind"]} == set(kinds.split(","))
    for episode in data["episodes"]:
        _check(episode)
    assert proc.returncode == 0, proc.stdout[-3000:]
