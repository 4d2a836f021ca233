"""What a checkpoint through the :class:`~dstl_ray.checkpoint.hub.CheckpointHub` must hold
before it completes: each participant's answer read as snapshots (a bad one declines the
checkpoint naming its participant), every operator the job has, and each operator's key
groups covered exactly once. A checkpoint that passed would otherwise restore without some
state, silently, and subsume the good one before it."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ..errors import CheckpointDeclinedError, DstlError, HandleError
from ..state.json_memo import DecodeMemo
from ..state.snapshot import KeyedStateSnapshot


def read_answers(n: int, answers: Mapping[str, list[Any]], base_path: str,
                 memo: DecodeMemo | None = None) -> list[KeyedStateSnapshot]:
    """The snapshots of every participant's answer (each snapshot's JSON text), in
    participant order; an answer without snapshots (a process whose backends are not there
    yet) or with one that does not read declines checkpoint ``n``. ``memo``: the same text
    decodes to the same snapshot (:mod:`~dstl_ray.state.json_memo`)."""
    out: list[KeyedStateSnapshot] = []

    def read(text: str) -> KeyedStateSnapshot:
        return KeyedStateSnapshot.from_json(text, base_path)

    for name, snaps in sorted(answers.items()):
        if not snaps:
            raise CheckpointDeclinedError(f"checkpoint {n}: participant {name!r} answered "
                                          f"with no snapshots")
        try:
            for text in snaps:
                if not isinstance(text, str):
                    raise HandleError(f"a snapshot is sent as its JSON text, got "
                                      f"{type(text).__name__}")
                out.append(memo.decode(text, read) if memo is not None else read(text))
        except DstlError as e:
            raise CheckpointDeclinedError(f"checkpoint {n}: participant {name!r} answered "
                                          f"with a snapshot that does not read: {e}") from e
    return out


def check_operators(n: int, snapshots: list[KeyedStateSnapshot], expected: Collection[str]
                    ) -> None:
    """Every operator of ``expected`` has snapshots in checkpoint ``n``."""
    missing = sorted(set(expected) - {s.operator_id for s in snapshots})
    if missing:
        raise CheckpointDeclinedError(f"checkpoint {n}: no snapshots of operators {missing}, "
                                      f"which the job has")


def check_coverage(snapshots: list[KeyedStateSnapshot], max_parallelism: int) -> None:
    """Each operator's snapshots cover key groups ``0..max_parallelism-1``, each once; there
    is at least one snapshot."""
    if not snapshots:
        raise CheckpointDeclinedError("a checkpoint without snapshots")
    ranges: dict[str, list[tuple[int, int]]] = {}
    for s in snapshots:
        ranges.setdefault(s.operator_id, []).append((s.key_group_range.start,
                                                     s.key_group_range.end))
    for op, rs in sorted(ranges.items()):
        rs.sort()
        nxt = 0
        for start, end in rs:
            if start != nxt:
                raise CheckpointDeclinedError(
                    f"operator {op!r}: the snapshots cover key groups {rs}, not 0.."
                    f"{max_parallelism - 1} each once ({'overlap' if start < nxt else 'gap'}"
                    f" at {min(start, nxt)})")
            nxt = end + 1
        if nxt != max_parallelism:
            raise CheckpointDeclinedError(f"operator {op!r}: the snapshots cover key groups "
                                          f"{rs}, not 0..{max_parallelism - 1}")
