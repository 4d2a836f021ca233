"""What a micro-batch of :class:`~spark_glue.operator.KeyedStatefulOperator` learns from the
latest complete checkpoint before it runs: whether the state it builds on is there at all,
whether it is Spark's replay of that checkpoint's batch, and the times the checkpoint's
subtasks recorded (where the watermark resumes, and the processing time a replay runs at)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dstl_ray.errors import ConfigError, MissingStateError

# what a batch does when the state it builds on is gone (the operator's on_missing_state)
ON_MISSING_STATE = ("fail", "start_empty")


def missing_state(job_id: str, batch_id: int, latest_id: int | None, base_path: str
                  ) -> MissingStateError | None:
    """The error micro-batch ``batch_id`` must fail with because the state it builds on is
    gone, or None when it is there (``latest_id``: the job's latest complete checkpoint under
    ``base_path``, None if it has none).

    Batch ``n`` builds on the state after batch ``n - 1``: Spark runs it only once its commit
    log holds batch ``n - 1``, whose checkpoint completed before that commit. So a batch
    ``n > 0`` finds checkpoint ``n - 1``, or ``n`` when Spark replays it after a driver
    restart (:func:`is_replay`); batch 0 starts a query and finds none. Anything older (or
    nothing) means the job's checkpoints are not where this query left them: a new or
    emptied changelog base path under an old ``checkpointLocation``. Running the batch on
    empty (or old) state would give wrong results with no error, where Spark's own state
    store fails when the version it needs is missing; so this is an error unless the
    operator was told to start over (``on_missing_state="start_empty"``).
    """
    if batch_id <= 0 or (latest_id is not None and latest_id >= batch_id - 1):
        return None
    found = ("no complete checkpoint" if latest_id is None
             else f"only checkpoint {latest_id} as the latest complete one")
    return MissingStateError(
        f"job {job_id!r}: micro-batch {batch_id} builds on the state of checkpoint "
        f"{batch_id - 1}, but the job has {found} under base path {base_path!r}. Spark's "
        f"checkpointLocation says batches up to {batch_id - 1} ran, so their state is gone "
        f"(a new or emptied base path, or another job id). Nothing was run. Restart with "
        f"the base path and job id that hold the job's checkpoints, or pass "
        f"on_missing_state='start_empty' to start over from empty state",
        job_id=job_id, batch_id=batch_id, latest_id=latest_id, base_path=base_path)


def is_replay(job_id: str, batch_id: int, latest_id: int | None) -> bool:
    """Whether micro-batch ``batch_id`` is Spark's replay of a batch whose checkpoint is
    complete (``latest_id``: the latest complete checkpoint, None if there is none).

    Spark runs batch n+1 only after writing batch n's commit log, so after a driver restart
    it replays at most its LAST batch: the one whose checkpoint completed but whose commit
    did not. That batch's id equals the latest checkpoint's. An older batch id means the
    query is not the one that wrote these checkpoints (a new ``checkpointLocation`` with
    an existing job id restarts the batch ids at 0); treating it as a replay would delete
    every newer checkpoint, so it is a :class:`~dstl_ray.errors.ConfigError` (the job id and
    the checkpoint location do not belong together; retrying cannot help).
    """
    if latest_id is None or batch_id > latest_id:
        return False
    if batch_id == latest_id:
        return True
    raise ConfigError(
        f"job {job_id!r}: micro-batch {batch_id} is older than the latest complete checkpoint "
        f"{latest_id}; Spark replays only its last batch, so this query's checkpointLocation "
        f"did not write job {job_id!r}'s checkpoints. Nothing was deleted. Use a new job id "
        f"for a new checkpointLocation, or restart with the job's old checkpointLocation")


def snapshot_time(checkpoint: Any, name: str, pick: Callable[..., int] = min) -> int | None:
    """A time its subtasks recorded in a complete checkpoint (None: none did):
    ``event_time_ms`` (with ``max``: where the watermark resumes, spark_glue.timers) or
    ``processing_time_ms`` (the batch's processing time)."""
    if checkpoint is None:
        return None
    seen = [getattr(s, name) for s in checkpoint.metadata.snapshots
            if getattr(s, name) is not None]
    return pick(seen) if seen else None
