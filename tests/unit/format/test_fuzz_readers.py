"""A short libFuzzer run (atheris) on each reader of persisted data: no input may raise
anything but dstl-ray's own error, break an invariant, hang or blow up memory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from experiments.fuzz import MAX_LEN, TARGETS, seed_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, dict[str, str]]:
    directory = str(tmp_path_factory.mktemp("corpus"))
    return directory, seed_corpus(directory)


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_target_finds_nothing(target, corpus, tmp_path):
    directory, env = corpus
    (tmp_path / "work").mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "experiments.fuzz_target", target, "-runs=1000",
         f"-max_len={MAX_LEN}", "-timeout=5", "-rss_limit_mb=2048",
         f"-artifact_prefix={tmp_path}/", str(tmp_path / "work"), os.path.join(directory, target)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Done 1000 runs" in out.stderr
