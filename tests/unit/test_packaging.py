"""Packaging: pyproject.toml and environment.yml list the same dependencies; the wheel holds
the three packages and nothing else (experiments and tests run from the checkout), with the
license as a PEP 639 expression and matplotlib only in the ``plot`` extra."""

from __future__ import annotations

import ast
import email
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _norm(req: str) -> str:
    return re.sub(r"\s+", "", req).lower()


def test_environment_yml_matches_pyproject():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_norm(r) for r in py["dependencies"]}
    for extra in py["optional-dependencies"].values():
        wanted |= {_norm(r) for r in extra}
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


PACKAGES = ("dstl_ray", "topology", "spark_glue")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel built from a copy of the checkout (the build leaves build/ and egg-info
    behind, which must not land in the checkout)."""
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for name in (*PACKAGES, "experiments", "tests"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out),
           str(src)]
    try:  # offline and fast when the test extra is installed; else pip fetches setuptools
        import setuptools

        if int(setuptools.__version__.split(".")[0]) >= 77:
            cmd.insert(4, "--no-build-isolation")
    except ImportError:
        pass
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    (built,) = out.glob("dstl_ray-*.whl")
    with zipfile.ZipFile(built) as zf:
        yield zf


def test_the_wheel_holds_the_three_packages_only(wheel):
    names = wheel.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == set(PACKAGES)
    for package in PACKAGES:
        assert f"{package}/__init__.py" in names
    assert "dstl_ray/testing/__init__.py" in names  # test support ships (users test with it)
    assert "dstl_ray/testing/storage_suite.py" in names
    assert not [n for n in names if n.startswith(("experiments/", "tests/"))]


def test_the_wheel_metadata(wheel):
    (meta_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    meta = email.message_from_bytes(wheel.read(meta_name))
    assert meta["License-Expression"] == "Apache-2.0"
    assert "plot" in meta.get_all("Provides-Extra")
    requires = meta.get_all("Requires-Dist")
    plots = [r for r in requires if r.startswith("matplotlib")]
    assert plots and all("extra ==" in r for r in plots), plots
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert "dstl-ray = dstl_ray.cli.main:main" in wheel.read(entry_points).decode()


def _module_level_imports(path: Path) -> set[str]:
    """Top-level module names imported outside any function or class body."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        stack = [node]
        while stack:
            n = stack.pop()
            if isinstance(n, ast.Import):
                found |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                found.add(n.module.split(".")[0])
            elif isinstance(n, (ast.If, ast.Try)):  # a guarded import still runs at import
                stack.extend(ast.iter_child_nodes(n))
    return found


def test_no_installed_module_imports_matplotlib_at_import_time():
    """matplotlib is the ``plot`` extra: importing any module of the wheel must work without
    it (it is loaded by dstl_ray.plotting when a command draws)."""
    offenders = [str(p.relative_to(ROOT)) for package in PACKAGES
                 for p in (ROOT / package).rglob("*.py")
                 if "matplotlib" in _module_level_imports(p)]
    assert offenders == []


def test_drawing_without_matplotlib_says_which_extra_to_install(monkeypatch):
    from dstl_ray import MissingDependencyError
    from dstl_ray.plotting import pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(MissingDependencyError, match=r"dstl-ray\[plot\]") as err:
        pyplot("dstl-ray trace")
    assert "dstl-ray trace" in str(err.value)
