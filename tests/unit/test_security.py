"""Security rules that hold already: no pickle for persisted data, no path steering."""

from __future__ import annotations

import ast
import uuid
from pathlib import Path

import pytest

from dstl_ray import ConfigError, DirectTransport, KeyGroupRange, StateChangelogClient
from dstl_ray.storage.registry import get_storage

ROOT = Path(__file__).resolve().parents[2]


def test_package_code_never_unpickles():
    for pkg in ("dstl_ray", "topology", "spark_glue"):
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in ("load", "loads") and \
                        isinstance(node.value, ast.Name) and node.value.id in (
                            "pickle", "cloudpickle", "marshal", "dill"):
                    pytest.fail(f"{path}:{node.lineno} unpickles")


@pytest.mark.parametrize("operator_id", ["../../etc/passwd", "/abs", "a/b", "..", "x\\y"])
def test_operator_ids_do_not_steer_file_names(operator_id):
    base = f"memory://sec-{uuid.uuid4().hex}"
    t = DirectTransport("job", base)
    w = StateChangelogClient("job", transport=t).create_writer(operator_id, KeyGroupRange(0, 0))
    w.append(0, b"x")
    h = w.persist_durably(0).result(timeout=10)
    files = get_storage(base).list_files(f"{base}/job")
    assert files == h.file_paths()
    for f in files:
        assert f.startswith(f"{base}/job/dstl/") and ".." not in f
        assert operator_id not in f.split("/job/", 1)[1]


@pytest.mark.parametrize("job_id", ["../other", "/abs", "a/b", "", ".", "..", "x" * 200,
                                    "white space"])
def test_job_ids_that_would_steer_paths_are_refused(job_id):
    with pytest.raises(ConfigError, match="job id"):
        DirectTransport(job_id, "memory://sec")
