"""The host cluster the multi-host tests share (dstl_ray.local.hosts): three network
namespaces on a bridge, each a Ray node started by ``ray start`` in a token-authenticated
cluster, made once per session (three ``ray start`` take ~20 s on two cores) and checked to
leave nothing behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dstl_ray.local.hosts import HostCluster

from .hosts_util import leftovers


@pytest.fixture(scope="session")
def hosts() -> Iterator[HostCluster]:
    cluster = HostCluster(3).start()
    try:
        yield cluster
    finally:
        cluster.stop()
    assert leftovers(cluster.tag) == []  # no namespace, link or Ray process left
