"""Shared fixtures: ONE Ray cluster per test session (several Ray nodes on this machine via
``ray.cluster_utils.Cluster``), shared by integration and cluster tests; start-up is the slow
part. Every test deploys its own tree in its own namespace, so tests do not see each other.

Tests under ``tests/cluster`` and ``tests/spark`` get the ``cluster`` and ``spark`` markers
from their directory, so ``pytest -m "not spark"`` leaves the Spark tests out."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from dstl_ray.testing import start_local_cluster, stop_local_cluster

N_NODES = int(os.environ.get("DSTL_TEST_NODES", "5"))
# Ray's worker processes (node actors, tasks, Spark's executors) inherit this from the raylets
# the session starts: each prints every DeprecationWarning and FutureWarning, once per place,
# to its log, where tests/integration/test_node_warnings.py looks for them
WORKER_WARNINGS = "default::DeprecationWarning,default::FutureWarning"
TESTS = Path(__file__).resolve().parent
MARKED_DIRS = {"cluster": TESTS / "cluster", "spark": TESTS / "spark"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test by the directory it lives in (the markers are declared in
    pyproject.toml)."""
    for item in items:
        path = Path(str(item.path)).resolve()
        for marker, directory in MARKED_DIRS.items():
            if path.is_relative_to(directory):
                item.add_marker(getattr(pytest.mark, marker))


@pytest.fixture(scope="session")
def ray_cluster():
    """A Ray cluster of N_NODES nodes (head + workers), each with 1 logical CPU, whose
    worker processes show deprecation warnings (WORKER_WARNINGS; only they: processes this
    one starts later keep the usual filters)."""
    before = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = ",".join(w for w in (before, WORKER_WARNINGS) if w)
    try:
        cluster = start_local_cluster(N_NODES, cpus=1, namespace="dstl_tests")
    finally:
        if before is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = before
    try:
        yield cluster
    finally:
        stop_local_cluster(cluster)


@pytest.fixture
def namespace() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def tree_factory(ray_cluster, tmp_path, namespace):
    """Deploy trees in this test's namespace; shut them down afterwards."""
    import dstl_ray

    trees = []

    def make(base=None, **options):
        cfg = dstl_ray.ChangelogConfig(namespace=namespace, **options)
        tree = dstl_ray.deploy(base or f"file://{tmp_path}/dstl", cfg, detached=False)
        trees.append(tree)
        return tree

    yield make
    for t in trees:
        t.shutdown()
