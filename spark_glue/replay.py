"""What a micro-batch of :class:`~spark_glue.operator.KeyedStatefulOperator` learns from the
latest complete checkpoint before it runs: whether it is Spark's replay of that checkpoint's
batch, and the times the checkpoint's subtasks recorded (where the watermark resumes, and
the processing time a replay runs at)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dstl_ray.errors import ConfigError


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
