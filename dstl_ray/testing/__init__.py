"""Test support for dstl-ray, for this project's tests and experiments and for users testing
their own jobs; not part of the runtime API (``dstl_ray.__all__``).

- :mod:`~dstl_ray.testing.faults`: fault and latency injection into a storage (``FaultyStorage``,
  configured by the ``fault_spec`` option, so node actors inject the same faults).
- :mod:`~dstl_ray.testing.s3server`: a real S3 server on loopback (moto), needs ``moto[server]``.
- :mod:`~dstl_ray.testing.cluster`: several Ray nodes on this machine (``local_cluster``).
- :mod:`~dstl_ray.testing.storage_suite`: the conformance suite every
  :class:`~dstl_ray.storage.base.Storage` binds (needs pytest; import it explicitly).

Importing this package imports neither Ray, moto, boto3 nor pytest: the runtime imports
:mod:`~dstl_ray.testing.faults` (config validation, ``storage_for``), and that must stay cheap.
"""

from .cluster import local_cluster, start_local_cluster, stop_local_cluster
from .faults import (
    FLIP158_QUANTILES_MS,
    KINDS,
    FaultSpec,
    FaultyStorage,
    InjectedFault,
    LatencyDistribution,
)
from .s3server import LoopbackS3

__all__ = [
    "FLIP158_QUANTILES_MS",
    "KINDS",
    "FaultSpec",
    "FaultyStorage",
    "InjectedFault",
    "LatencyDistribution",
    "LoopbackS3",
    "local_cluster",
    "start_local_cluster",
    "stop_local_cluster",
]
