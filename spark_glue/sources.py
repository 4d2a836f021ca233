"""What a state source names: the one place that turns what a user passes to ``read_state``,
``read_change_feed`` or an operator's ``initial_state`` into a checkpoint's ``_metadata``
URL.

A source is a running job's operator (its latest checkpoint), a URL or absolute path of a
job directory (its latest checkpoint), checkpoint, savepoint or ``_metadata`` file, or a
job id on the tree of a namespace (its latest checkpoint). An operator is recognized by the
attributes it has (:class:`JobOperator`), so the modules the operator itself imports can
resolve sources too.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from dstl_ray.checkpoint.reader import resolve_checkpoint
from dstl_ray.errors import ConfigError
from dstl_ray.storage.base import join


@runtime_checkable
class JobOperator(Protocol):
    """What a source needs of an operator: where its job's checkpoints are, and which of
    the job's operators it is."""

    base_path: str
    job_id: str
    operator_id: str


def checkpoint_url(source: Any, namespace: str | None = None,
                   what: str = "source") -> tuple[str, str | None]:
    """``(the _metadata URL, the operator id the source names or None)`` of ``source``
    (see the module); ``what`` names the argument in the error for anything else."""
    if isinstance(source, JobOperator):
        return resolve_checkpoint(join(source.base_path, source.job_id)), source.operator_id
    if not isinstance(source, str) or not source:
        raise ConfigError(f"{what} must be a checkpoint or savepoint (a URL or path), a job "
                          f"id or an operator, got {source!r}")
    if "://" in source or source.startswith("/"):
        return resolve_checkpoint(source), None
    from dstl_ray.log.client import StateChangelogClient

    client = StateChangelogClient(source, namespace=namespace)
    try:
        return resolve_checkpoint(join(client.transport.base_path, source)), None
    finally:
        client.close()
