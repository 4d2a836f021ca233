"""Test support for dstl-ray, for this project's tests and experiments and for users testing
their own jobs; not part of the runtime API (``dstl_ray.__all__``).

- :mod:`~dstl_ray.testing.faults`: fault and latency injection into a storage (``FaultyStorage``,
  configured by the ``fault_spec`` option, so node actors inject the same faults).
- :mod:`~dstl_ray.testing.s3server`: a real S3 server on loopback (moto), needs ``moto[server]``.
- ``local_cluster``: several Ray nodes on this machine, and ``HostCluster``: several hosts on
  it (network namespaces with their own IPs, ``ray start`` in each; needs root and ``ip``):
  :mod:`dstl_ray.local` and :mod:`dstl_ray.local.hosts`, runtime modules since the demo uses
  them (``dstl-ray demo --hosts N``); re-exported here.
- :mod:`~dstl_ray.testing.storage_suite`: the conformance suite every
  :class:`~dstl_ray.storage.base.Storage` binds (needs pytest; import it explicitly).

No runtime module imports this package: importing it registers the fault injection behind the
``fault_spec`` option (``dstl_ray.config.register_option_check``,
``dstl_ray.storage.registry.register_storage_wrapper``), and processes started elsewhere (node
actors) import it when option ``plugins`` names it. Importing it imports neither Ray, moto,
boto3 nor pytest, so that stays cheap.
"""

from ..local import local_cluster, start_local_cluster, stop_local_cluster
from ..local.hosts import HostCluster
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
    "HostCluster",
    "InjectedFault",
    "LatencyDistribution",
    "LoopbackS3",
    "local_cluster",
    "start_local_cluster",
    "stop_local_cluster",
]
