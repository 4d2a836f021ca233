"""``StateChangelogClient``: attaches a job's writers to the nearest node actor
(FLIP-158 "API": StateChangelogClient.createWriter)."""

from __future__ import annotations

import logging

from ..config import ChangelogConfig
from ..errors import (
    ConfigError,
)
from ..keygroups import KeyGroupRange
from ..storage.deleter import background_deleter
from ..transport.base import Transport, check_job_id
from ..transport.ray import RayNodeTransport, ensure_ray
from .writer import StateChangelogWriter

log = logging.getLogger(__name__)


class StateChangelogClient:
    """Scoped to one job on one process; creates writers attached to the nearest node actor.

    >>> client = StateChangelogClient("job-1")              # doctest: +SKIP
    >>> writer = client.create_writer("op", KeyGroupRange(0, 127))  # doctest: +SKIP
    """

    def __init__(self, job_id: str, *, namespace: str | None = None,
                 address: str | None = None, node: str | None = None,
                 transport: Transport | None = None,
                 caller_namespace: str | None = None) -> None:
        self.job_id = check_job_id(job_id)
        if transport is None:
            ns = namespace or ChangelogConfig.from_env().namespace
            ensure_ray(ns, address)
            transport = RayNodeTransport(job_id, ns, node, caller_namespace)
        self.transport = transport
        self._writers: list[StateChangelogWriter] = []

    @property
    def job_path(self) -> str:
        return self.transport.job_path

    @property
    def config(self) -> ChangelogConfig:
        return self.transport.config

    @property
    def node_name(self) -> str:
        return getattr(self.transport, "node_name", "")

    def create_writer(self, operator_id: str, key_group_range: KeyGroupRange
                      ) -> StateChangelogWriter:
        """A new writer (log) with a fresh, unique LogID for ``operator_id``'s backend."""
        if not isinstance(operator_id, str) or not operator_id:
            raise ConfigError(f"operator_id must be a non-empty str, got {operator_id!r}")
        w = StateChangelogWriter(self.transport, self.job_id, operator_id, key_group_range)
        self._writers.append(w)
        return w

    def close(self) -> None:
        """Close every writer; what they released is deleted (or its node told) on return."""
        for w in self._writers:
            w.close()
        self._writers.clear()
        background_deleter().flush(timeout=60)
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> StateChangelogClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
