"""A Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``), for the demo
(``dstl-ray demo``), tests and experiments: the aggregation tree places one node actor per Ray
node, so a tree needs several Ray nodes, and this is how one machine gets them. A runtime
module, since the demo is a runtime command; ``dstl_ray.testing`` re-exports it. Several
*hosts* on this machine, each with an IP of its own: :mod:`dstl_ray.local.hosts`.

>>> with local_cluster(3, namespace="demo") as cluster:    # doctest: +SKIP
...     tree = dstl_ray.deploy("file:///tmp/dstl")
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster


def start_local_cluster(nodes: int, cpus: int = 1, namespace: str | None = None) -> Cluster:
    """Start ``nodes`` Ray nodes (a head and ``nodes - 1`` workers) of ``cpus`` logical CPUs
    each, and connect this process's Ray to them in ``namespace``. Stop it with
    :func:`stop_local_cluster` (or use :func:`local_cluster`)."""
    import ray
    from ray.cluster_utils import Cluster

    if nodes < 1:
        raise ValueError(f"a local cluster needs at least 1 node, got {nodes}")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=namespace, log_to_driver=False)
    except BaseException:
        cluster.shutdown()  # no raylets left behind by a start that failed half-way
        raise
    return cluster


def stop_local_cluster(cluster: Cluster) -> None:
    """Disconnect this process's Ray, then stop every node of ``cluster``."""
    import ray

    ray.shutdown()
    cluster.shutdown()


@contextmanager
def local_cluster(nodes: int, cpus: int = 1, namespace: str | None = None
                  ) -> Iterator[Cluster]:
    """:func:`start_local_cluster` for the ``with`` block, stopped at its end."""
    cluster = start_local_cluster(nodes, cpus, namespace)
    try:
        yield cluster
    finally:
        stop_local_cluster(cluster)
