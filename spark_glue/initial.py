"""Initial state: a job that starts from another job's checkpoint or savepoint (Spark's
``initialState``, Flink's State Processor API bootstrap; FLIP-158 "Recovery and rescaling"
for how a subtask takes its key groups of it).

The operator's ``initial_state`` names a ``read_state`` source. It is resolved once, when
the job has neither a checkpoint nor a restore point: the driver's coordinator restores from
it in NO_CLAIM mode, which protects its files and pins it as the job's restore point
(:mod:`dstl_ray.checkpoint.restore_point`), so every later run resolves nothing (the source
may be gone by then) and a replay of the first batch restores the very same checkpoint,
not the other job's newest. Whenever the job has no complete checkpoint of its own at a
batch (its first batch, or a replay of it), each subtask restores its key groups from the
restore point instead of starting empty, at any parallelism, and materializes its state into
files of its own before the batch's snapshot (so no checkpoint of the job names the source's
files). Nothing of the source is ever written or deleted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dstl_ray.checkpoint.reader import operator_states
from dstl_ray.checkpoint.recovery import list_checkpoints, load_checkpoint
from dstl_ray.checkpoint.restore import RestoreMode
from dstl_ray.errors import ConfigError, StateError
from dstl_ray.storage.base import normalize_url

from .sources import checkpoint_url


@dataclass(frozen=True)
class InitialState:
    """The checkpoint or savepoint a job starts from: its ``_metadata`` URL (the
    coordinator's NO_CLAIM restore from it protects its files)."""

    metadata_url: str

    @classmethod
    def start(cls, source: Any, coordinator: Any, operator_id: str,
              namespace: str | None = None) -> dict[str, Any]:
        """The options of the driver's first ``coordinator.restore`` call: from ``source``
        in NO_CLAIM mode when given and the job has neither a checkpoint nor a restore
        point yet; else none (the job's own state, or its pinned restore point)."""
        if source is None or coordinator.restore_point.current() is not None \
                or list_checkpoints(coordinator.job_path, coordinator.storage):
            return {}
        point = cls.resolve(source, operator_id, coordinator.max_parallelism, namespace,
                            job_path=coordinator.job_path)
        return {"checkpoint": point.metadata_url, "mode": RestoreMode.NO_CLAIM}

    @classmethod
    def resolve(cls, source: Any, operator_id: str, max_parallelism: int,
                namespace: str | None = None, job_path: str | None = None) -> InitialState:
        """``source``: a URL or path of a job directory (its latest checkpoint), checkpoint,
        savepoint or ``_metadata`` file; a job id on the tree of ``namespace``; or an
        operator (its latest checkpoint). A source with another max parallelism, without
        a snapshot of ``operator_id``, or in the job's own directory ``job_path``, is a
        :class:`ConfigError` naming what it holds."""
        url = checkpoint_url(source, namespace, "initial_state")[0]
        if job_path is not None and normalize_url(url).startswith(
                normalize_url(job_path).rstrip("/") + "/"):
            raise ConfigError(f"initial_state {url} is the job's own: a job restarts from its "
                              f"own checkpoints by itself (initial_state is for another "
                              f"job's checkpoint or savepoint)")
        cc = load_checkpoint(url)
        if cc.metadata.max_parallelism != max_parallelism:
            raise ConfigError(
                f"initial_state {url} has max_parallelism {cc.metadata.max_parallelism}, the "
                f"operator {max_parallelism}: key groups must be the same to restore")
        try:
            operator_states(cc, operator_id)
        except StateError as e:
            raise ConfigError(f"initial_state {url}: {e}") from None
        return cls(cc.metadata_url)

