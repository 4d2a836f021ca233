"""Shared fixtures: ONE Ray cluster per test session (several Ray nodes on this machine via
``ray.cluster_utils.Cluster``), shared by integration and cluster tests; start-up is the slow
part. Every test deploys its own tree in its own namespace, so tests do not see each other."""

from __future__ import annotations

import os
import uuid

import pytest

N_NODES = int(os.environ.get("DSTL_TEST_NODES", "5"))


@pytest.fixture(scope="session")
def ray_cluster():
    """A Ray cluster of N_NODES nodes (head + workers), each with 1 logical CPU."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(N_NODES - 1):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="dstl_tests", log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


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
