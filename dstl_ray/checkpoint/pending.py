"""Pending checkpoints and their deadline (docs/architecture.md "Checkpoint lifecycle";
FLIP-158 "Performing a checkpoint"; Flink's ``execution.checkpointing.timeout``).

A triggered checkpoint waits for every backend's snapshot. It has ONE deadline,
``checkpoint_timeout_s`` from its trigger, for all its backends together: the first failed
snapshot, the deadline, or a newer checkpoint completing (its ``abort``) declines it at once,
and snapshots still running then are not waited for (what they upload stays pinned by their
backends). Each pending checkpoint waits on its own, so a hung one never holds up later ones.

This module says what a pending checkpoint is and how it waits; the coordinator keeps the
checkpoints pending, and commits or declines each one once its wait is over.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Callable, Iterable

from ..errors import CheckpointDeclinedError, ConfigError, DstlError
from ..state.backend import ChangelogKeyedStateBackend
from ..state.snapshot import KeyedStateSnapshot
from .recovery import CompletedCheckpoint

DEFAULT_CHECKPOINT_TIMEOUT_S = 600.0  # Flink's execution.checkpointing.timeout: 10 min


def checkpoint_timeout(value: object) -> float:
    """``value`` as a checkpoint timeout in seconds; :class:`ConfigError` naming the option
    unless it is a finite number > 0 (a bool is not a number of seconds)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0 < value < math.inf):
        raise ConfigError(f"option checkpoint_timeout_s must be a number of seconds > 0 "
                          f"(Flink's checkpoint timeout, default "
                          f"{DEFAULT_CHECKPOINT_TIMEOUT_S:g}), got {value!r}")
    return float(value)


class PendingCheckpoint:
    """A triggered checkpoint; ``result()`` gives the :class:`CompletedCheckpoint` or raises
    :class:`CheckpointDeclinedError`."""

    def __init__(self, checkpoint_id: int, future: concurrent.futures.Future,
                 abort: concurrent.futures.Future | None = None,
                 snapshots: list[concurrent.futures.Future] | None = None) -> None:
        self.checkpoint_id = checkpoint_id
        self.future = future
        # set (to the reason) to decline it before its snapshots are in
        self.abort: concurrent.futures.Future = abort or concurrent.futures.Future()
        self.snapshots = snapshots or []  # its backends' snapshot futures

    def ready(self) -> bool:
        """Every snapshot is in (or failed): it commits or declines without waiting."""
        return all(f.done() for f in self.snapshots)

    def result(self, timeout: float | None = 60.0) -> CompletedCheckpoint:
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()


def start_snapshots(n: int, backends: Iterable[ChangelogKeyedStateBackend], pending: int,
                    max_concurrent: int
                    ) -> tuple[list[concurrent.futures.Future], BaseException | None]:
    """Start checkpoint ``n``'s snapshot on every backend. Returns their futures and the
    error that declines ``n`` at once, if any: ``max_concurrent`` checkpoints were already
    ``pending`` when it was triggered (then no snapshot starts), or a backend refused to
    snapshot (then the snapshots started before it are returned, to be left running)."""
    if pending >= max_concurrent:
        return [], CheckpointDeclinedError(f"checkpoint {n}: {max_concurrent} checkpoints "
                                           f"are already pending")
    futures: list[concurrent.futures.Future] = []
    for b in backends:
        try:
            futures.append(b.snapshot(checkpoint_id=n))
        except DstlError as e:
            return futures, e
    return futures, None


def snapshot_names(backends: Iterable[ChangelogKeyedStateBackend]) -> list[str]:
    """``operator[first-last key group]`` of each backend: an expired checkpoint's error
    names the backends whose snapshots were late."""
    return [f"{b.operator_id}[{b.key_group_range.start}-{b.key_group_range.end}]"
            for b in backends]


def await_snapshots(n: int, futures: list[concurrent.futures.Future], names: list[str],
                    error: BaseException | None, deadline: float,
                    abort: concurrent.futures.Future, timeout_s: float,
                    older_ready: Callable[[], list[concurrent.futures.Future]]
                    ) -> tuple[list[KeyedStateSnapshot], BaseException | None]:
    """Wait for checkpoint ``n``'s snapshots until its ``deadline`` (``time.monotonic()``);
    returns the snapshots that are in and the error that declines ``n`` (None: commit it).

    The first failed snapshot, the deadline, or ``abort`` completing (set to the reason:
    a newer checkpoint completed) ends the wait at once. Once every snapshot is in, it waits
    (until the deadline) for the futures ``older_ready()`` gives: older checkpoints whose
    snapshots are in too finish first, so checkpoints that are not held up complete in
    trigger order, and an older one still waiting for a snapshot is not waited for (it is
    subsumed when ``n`` completes)."""
    waiting = set(futures)
    while error is None and waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            late = [name for name, f in zip(names, futures, strict=False) if f in waiting]
            error = TimeoutError(
                f"checkpoint {n} expired: {len(late)} of {len(futures)} backend "
                f"snapshot(s) not done within checkpoint_timeout_s={timeout_s:g}s: "
                f"{', '.join(late)}")
            break
        done, _ = concurrent.futures.wait(waiting | {abort}, timeout=left,
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        if abort in done:
            error = abort.result()
            break
        waiting -= done
        for f in done:
            if f.cancelled() or f.exception() is not None:
                error = (concurrent.futures.CancelledError() if f.cancelled()
                         else f.exception())
                break
    if error is None:
        concurrent.futures.wait(older_ready(),
                                timeout=max(0.0, deadline - time.monotonic()))
    snaps = [f.result() for f in futures
             if f.done() and not f.cancelled() and f.exception() is None]
    return snaps, error


def abort_older(older: Iterable[PendingCheckpoint], n: int) -> None:
    """Checkpoint ``n`` completed: decline every pending checkpoint ``older`` than it as
    subsumed (Flink aborts them; they could only complete into the past)."""
    for p in older:
        if not p.abort.done():
            p.abort.set_result(CheckpointDeclinedError(
                f"checkpoint {p.checkpoint_id} subsumed: checkpoint {n} completed first"))
