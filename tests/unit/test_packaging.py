"""pyproject.toml and environment.yml must list the same dependencies."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _norm(req: str) -> str:
    return re.sub(r"\s+", "", req).lower()


def test_environment_yml_matches_pyproject():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_norm(r) for r in py["dependencies"] + py["optional-dependencies"]["test"]}
    pip_lines = []
    in_pip = False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        s = line.strip()
        if s == "- pip:":
            in_pip = True
            continue
        if in_pip and s.startswith("- "):
            item = s[2:].strip()
            if item != "-e .":
                pip_lines.append(_norm(item))
    assert set(pip_lines) == wanted, (
        f"only in environment.yml: {set(pip_lines) - wanted}; "
        f"only in pyproject.toml: {wanted - set(pip_lines)}")
    env = (ROOT / "environment.yml").read_text()
    assert "openjdk=17" in env and "python=3.11" in env


def test_layout():
    for d in ("dstl_ray", "topology", "spark_glue", "experiments", "tests/unit",
              "tests/integration", "tests/cluster", "tests/spark"):
        assert (ROOT / d).is_dir(), d
    assert "make test" in (ROOT / ".ci/run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
