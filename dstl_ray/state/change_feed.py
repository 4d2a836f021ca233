"""The change feed between two checkpoints of one job, read from the changelog (Spark's state
data source ``readChangeFeed``; the changelog of FLIP-158 "State changelog" is exactly this
record): every change one state went through after checkpoint ``start`` up to checkpoint
``end``, per log in append (sqn) order.

For each log ``end`` names, the changes after ``start``'s position in that log are read from
``end``'s handle; a log that ``start`` does not name (begun by a restore after it) counts from
its beginning. The feed exists only while ``end`` still holds those changes: once a
materialization between the two checkpoints truncated a log past ``start``'s position (FLIP-158
"Materializing state changes"), or a log of ``start`` was dropped, the changes in between are
gone and reading fails with a :class:`~dstl_ray.errors.StateError` that says so. Keep
materialization less frequent than the window you read, or read windows as they complete.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..checkpoint.recovery import CompletedCheckpoint, load_checkpoint
from ..checkpoint.snapshot import ChangelogComponent
from ..errors import StateError
from ..keygroups import KeyGroupRange, key_group_range_for_subtask
from .reader import resolve_checkpoint, the_operator
from .records import Op, StateKind, TaggedSerializer, decode_record, split_items
from .ttl import spec_ttl, unstamp

_OP_NAMES = {op: op.name.lower() for op in Op}


@dataclass(frozen=True)
class Change:
    """One state change: ``op`` is one of value_set, value_clear, list_add, list_set,
    list_clear, map_put, map_remove, map_clear; ``value`` is the new value (value_set,
    list_add, map_put), the whole list (list_set) or None; ``user_key`` is set for map_put
    and map_remove. ``log`` and ``sqn`` order the changes of one key."""

    key: Any
    op: str
    user_key: Any
    value: Any
    log: str
    sqn: int


def _logs(cc: CompletedCheckpoint, op: str) -> dict[str, list[ChangelogComponent]]:
    out: dict[str, list[ChangelogComponent]] = {}
    for s in cc.metadata.snapshots:
        if s.operator_id == op:
            for c in s.components:
                if isinstance(c, ChangelogComponent):
                    out.setdefault(c.handle.log_id, []).append(c)
    return out


def _window(start: CompletedCheckpoint, end: CompletedCheckpoint, op: str
            ) -> list[tuple[ChangelogComponent, int]]:
    """The changelog components of ``end`` to read, each with the sqn after which its
    changes are new; fails if any change in between is no longer held."""
    if start.checkpoint_id >= end.checkpoint_id:
        raise StateError(f"the change feed runs from an earlier checkpoint to a later one, "
                         f"got {start.checkpoint_id} to {end.checkpoint_id}")
    before, after = _logs(start, op), _logs(end, op)
    for log in before.keys() - after.keys():
        if any(c.handle.sqn_to > c.handle.sqn_from for c in before[log]):
            raise StateError(f"log {log} of checkpoint {start.checkpoint_id} is not named by "
                             f"checkpoint {end.checkpoint_id} (materialized or restored "
                             f"away): the changes between them are gone")
    out = []
    for log, comps in after.items():
        seen = max((c.handle.sqn_to for c in before.get(log, ())), default=None)
        for c in comps:
            since = c.handle.sqn_from if seen is None else seen
            if since < c.handle.sqn_from:
                raise StateError(
                    f"log {log} was truncated at sqn {c.handle.sqn_from} by a materialization "
                    f"after checkpoint {start.checkpoint_id} (which ends at sqn {since}): "
                    f"the changes between checkpoints {start.checkpoint_id} and "
                    f"{end.checkpoint_id} are no longer held")
            out.append((c, since))
    return out


def check_window(start: str, end: str, operator_id: str | None = None) -> str:
    """Fail as :func:`read_change_feed` would if the changes between checkpoints ``start``
    and ``end`` are not all held; returns the operator id read."""
    cs, ce = load_checkpoint(resolve_checkpoint(start)), load_checkpoint(resolve_checkpoint(end))
    op = the_operator(ce, operator_id)
    _window(cs, ce, op)
    return op


def read_change_feed(start: str, end: str, state: str, operator_id: str | None = None,
                     parts: int = 1, index: int = 0) -> Iterator[Change]:
    """The changes of ``state`` after checkpoint ``start`` up to checkpoint ``end`` (see
    :func:`~dstl_ray.state.reader.resolve_checkpoint` for what names one), in key-group
    range ``index`` of ``parts``."""
    cs, ce = load_checkpoint(resolve_checkpoint(start)), load_checkpoint(resolve_checkpoint(end))
    op = the_operator(ce, operator_id)
    mine = key_group_range_for_subtask(ce.metadata.max_parallelism, parts, index)
    de = TaggedSerializer().deserialize
    for comp, since in _window(cs, ce, op):
        names = [spec[0] for spec in comp.states]
        if state not in names:
            continue
        sid = names.index(state)
        kinds = [StateKind(spec[1]) for spec in comp.states]
        stamped = spec_ttl(comp.states[sid]) is not None
        want = comp.key_group_range.intersect(mine)
        if want is None:
            continue
        yield from _changes(comp, since, want, sid, kinds, stamped, de)


def _changes(comp: ChangelogComponent, since: int, want: KeyGroupRange, sid: int,
             kinds: list[StateKind], stamped: bool, de: Any) -> Iterator[Change]:
    strip = unstamp if stamped else (lambda b: b)
    seen: set[tuple[int, int]] = set()  # a changeset may be stored twice (merged files)
    sets = [(kg, sqn, recs) for kg, sqn, recs in comp.handle.iter_changesets()
            if sqn > since and kg in want]  # only this range's new changes in memory
    for kg, sqn, records in sorted(sets, key=lambda t: t[1]):
        if (kg, sqn) in seen:
            continue
        seen.add((kg, sqn))
        for rec in records:
            op, local, key, ukey, payload = decode_record(rec, kinds)
            if local != sid:
                continue
            value: Any = None
            if op in (Op.VALUE_SET, Op.LIST_ADD, Op.MAP_PUT):
                value = de(strip(payload))
            elif op == Op.LIST_SET:
                value = [de(strip(x)) for x in split_items(payload)]
            yield Change(de(key), _OP_NAMES[Op(op)], None if ukey is None else de(ukey),
                         value, comp.handle.log_id, sqn)
