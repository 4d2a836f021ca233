"""A short libFuzzer run (atheris) on each reader of persisted data: no input may raise
anything but the format's own error, hang or blow up memory."""

from __future__ import annotations

import subprocess
import sys

import pytest

from experiments.fuzz import seed_corpus


@pytest.mark.parametrize("target", ["format", "handle"])
def test_fuzz_target_finds_nothing(target, tmp_path):
    seed_corpus(str(tmp_path / "corpus"))
    (tmp_path / "work").mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "experiments.fuzz_target", target, "-runs=3000", "-timeout=5",
         "-rss_limit_mb=2048", f"-artifact_prefix={tmp_path}/", str(tmp_path / "work"),
         str(tmp_path / "corpus" / target)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Done 3000 runs" in out.stderr
