"""The change feed between two checkpoints of one job, read from the changelog (Spark's state
data source ``readChangeFeed``; the changelog of FLIP-158 "State changelog" is exactly this
record): every change one state went through after checkpoint ``start`` up to checkpoint
``end``, per log in append (sqn) order.

For each log ``end`` names, the changes after ``start``'s position in that log are read from
``end``'s handle; a log that ``start`` does not name (begun by a restore after it, or empty at
``start``: snapshots leave empty logs out) counts from its beginning. That needs ``end`` to
still hold those changes: a materialization between the two checkpoints may have truncated
a log past ``start``'s position (FLIP-158 "Materializing state changes"), or a log of
``start`` may be gone (restored away). Such a window is read as a **diff** of the two
checkpoints' states instead: per key that differs, its net change (value_set or value_clear
of the new value; list_set of the whole new list or list_clear; map_put and map_remove per
user key that differs, map_clear for a map gone), with ``log`` empty and ``order`` and
``sqn`` 0; intermediate values are not seen, and an entry a state TTL expired and a
materialization purged reads as cleared. :func:`window_mode` says up front which a window
gets. Both checkpoints must be of one job (savepoints hold no changelog).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import StateError
from ..format.materialized import spec_dropped, spec_schema
from ..keygroups import KeyGroupRange, key_group_range_for_subtask
from ..state.records import Op, StateKind, TaggedSerializer, decode_record, split_items
from ..state.snapshot import ChangelogComponent
from ..state.ttl import spec_ttl, unstamp
from .reader import (
    operator_states,
    read_range,
    resolve_checkpoint,
    state_info,
    the_operator,
)
from .recovery import CompletedCheckpoint, load_checkpoint

_OP_NAMES = {op: op.name.lower() for op in Op}
CHANGELOG, DIFF = "changelog", "diff"  # how a window is read (window_mode)


class _Gone(StateError):
    """The changelog no longer holds every change of the window (it is read as a diff)."""


@dataclass(frozen=True)
class Change:
    """One state change: ``op`` is one of value_set, value_clear, list_add, list_set,
    list_clear, map_put, map_remove, map_clear; ``value`` is the new value (value_set,
    list_add, map_put), the whole list (list_set) or None; ``user_key`` is set for map_put
    and map_remove. The changes of one key sort by ``(order, sqn)``: ``order`` ranks the
    logs of the key's subtask (a log restored from before a restart comes before the log
    written since), ``sqn`` the changes within a log. Entries that a state TTL expired are
    not changes (the purge is not logged)."""

    key: Any
    op: str
    user_key: Any
    value: Any
    log: str
    order: int
    sqn: int


def _logs(cc: CompletedCheckpoint, op: str) -> dict[str, int]:
    """Log id -> the last sqn ``cc`` names of it, over the snapshots of ``op``."""
    out: dict[str, int] = {}
    for s in cc.metadata.snapshots:
        if s.operator_id == op:
            for c in s.components:
                if isinstance(c, ChangelogComponent):
                    out[c.handle.log_id] = max(out.get(c.handle.log_id, 0), c.handle.sqn_to)
    return out


def _check_pair(start: CompletedCheckpoint, end: CompletedCheckpoint, op: str) -> None:
    for cc in (start, end):
        if cc.metadata.kind != "checkpoint":
            raise StateError(f"{cc.metadata_url} is a {cc.metadata.kind}: the change feed "
                             f"runs between two checkpoints of one job (a savepoint holds no "
                             f"changelog)")
    if start.metadata.job_id != end.metadata.job_id:
        raise StateError(f"the change feed runs within one job: {start.metadata_url} is of "
                         f"job {start.metadata.job_id!r}, {end.metadata_url} of "
                         f"{end.metadata.job_id!r}")
    if start.checkpoint_id >= end.checkpoint_id:
        raise StateError(f"the change feed runs from an earlier checkpoint to a later one, "
                         f"got {start.checkpoint_id} to {end.checkpoint_id}")
    for cc in (start, end):
        if not any(s.operator_id == op for s in cc.metadata.snapshots):
            raise StateError(f"checkpoint {cc.metadata_url} has no operator {op!r}")


def _window(start: CompletedCheckpoint, end: CompletedCheckpoint, op: str
            ) -> list[tuple[ChangelogComponent, int, int]]:
    """The changelog components of ``end`` to read, each with the sqn after which its
    changes are new and its rank among its snapshot's components; fails if any change in
    between is no longer held."""
    _check_pair(start, end, op)
    before, after = _logs(start, op), _logs(end, op)
    missing = sorted(before.keys() - after.keys())
    if missing:
        raise _Gone(f"log {missing[0]} of checkpoint {start.checkpoint_id} is not named "
                         f"by checkpoint {end.checkpoint_id} (materialized or restored away): "
                         f"the changes between them are gone")
    out = []
    for s in end.metadata.snapshots:
        if s.operator_id != op:
            continue
        for rank, c in enumerate(s.components):
            if not isinstance(c, ChangelogComponent):
                continue
            log = c.handle.log_id
            # a log that start does not name: begun after it, so from its first change on
            # (a snapshot leaves out an empty log: one truncated since is not known whole)
            since = before.get(log, 0)
            if since < c.handle.sqn_from:
                raise _Gone(
                    f"log {log} was truncated at sqn {c.handle.sqn_from} by a materialization, "
                    f"and checkpoint {start.checkpoint_id} names it only up to sqn {since}: "
                    f"the changes between checkpoints {start.checkpoint_id} and "
                    f"{end.checkpoint_id} are no longer held")
            out.append((c, since, rank))
    return out


def _open(start: str, end: str, operator_id: str | None, state: str
          ) -> tuple[CompletedCheckpoint, CompletedCheckpoint, str]:
    """The two checkpoints and the operator read; fails if ``state`` is unknown."""
    cs, ce = load_checkpoint(resolve_checkpoint(start)), load_checkpoint(resolve_checkpoint(end))
    op = the_operator(ce, operator_id)
    state_info(ce, op, state)
    return cs, ce, op


def check_window(start: str, end: str, operator_id: str | None, state: str) -> str:
    """Fail as :func:`read_change_feed` would if ``state`` is unknown or the two are not
    checkpoints of one job, earlier to later; returns the operator id."""
    cs, ce, op = _open(start, end, operator_id, state)
    _check_pair(cs, ce, op)
    return op


def window_mode(start: str, end: str, state: str, operator_id: str | None = None) -> str:
    """How :func:`read_change_feed` reads the window: :data:`CHANGELOG` (every change, in
    order) while the changelog holds it, else :data:`DIFF` (each key's net change)."""
    cs, ce, op = _open(start, end, operator_id, state)
    try:
        _window(cs, ce, op)
    except _Gone:
        return DIFF
    return CHANGELOG


def read_change_feed(start: str, end: str, state: str, operator_id: str | None = None,
                     parts: int = 1, index: int = 0) -> Iterator[Change]:
    """The changes of ``state`` after checkpoint ``start`` up to checkpoint ``end`` (see
    :func:`~dstl_ray.checkpoint.reader.resolve_checkpoint` for what names one), in key-group
    range ``index`` of ``parts``: from the changelog, or as a diff when a materialization
    truncated it (the module docstring)."""
    cs, ce, op = _open(start, end, operator_id, state)
    try:
        window = _window(cs, ce, op)
    except _Gone:
        yield from _diff(cs, ce, op, state, parts, index)
        return
    mine = key_group_range_for_subtask(ce.metadata.max_parallelism, parts, index)
    untyped = TaggedSerializer()
    for comp, since, rank in window:
        sid = next((i for i, spec in enumerate(comp.states)
                    if spec[0] == state and not spec_dropped(spec)), None)
        if sid is None:
            continue
        kinds = [StateKind(spec[1]) for spec in comp.states]
        stamped = spec_ttl(comp.states[sid]) is not None
        schema = spec_schema(comp.states[sid])
        if schema is None:
            dv = untyped.deserialize
        else:
            from ..state.typed import serializer_for  # (pyarrow: only for typed states)

            dv = serializer_for(schema).deserialize
        want = comp.key_group_range.intersect(mine)
        if want is None:
            continue
        yield from _changes(comp, since, rank, want, sid, kinds, stamped,
                            untyped.deserialize, dv)


def _diff(start: CompletedCheckpoint, end: CompletedCheckpoint, op: str, state: str,
          parts: int, index: int) -> Iterator[Change]:
    """Each key's net change of ``state`` from ``start`` to ``end`` (TTL stamps ignored:
    read as stored)."""
    kind = state_info(end, op, state).kind
    before = (dict(read_range(start.metadata_url, op, state, parts, index, now_ms=0))
              if state in operator_states(start, op) else {})  # a new state: all entries new
    after = dict(read_range(end.metadata_url, op, state, parts, index, now_ms=0))

    def change(key: Any, op_name: str, value: Any = None, user_key: Any = None) -> Change:
        return Change(key, op_name, user_key, value, "", 0, 0)

    for key, new in after.items():
        old = before.get(key)
        if kind is StateKind.MAP:
            old = old or {}
            for uk, v in new.items():
                if uk not in old or old[uk] != v:
                    yield change(key, "map_put", v, uk)
            for uk in old.keys() - new.keys():
                yield change(key, "map_remove", None, uk)
        elif key not in before or old != new:
            yield change(key, "list_set" if kind is StateKind.LIST else "value_set", new)
    gone = {StateKind.MAP: "map_clear", StateKind.LIST: "list_clear"}.get(kind, "value_clear")
    for key in before.keys() - after.keys():
        yield change(key, gone)


def _changes(comp: ChangelogComponent, since: int, rank: int, want: KeyGroupRange,
             sid: int, kinds: list[StateKind], stamped: bool, de: Any, dv: Any
             ) -> Iterator[Change]:
    """The changes of state ``sid`` after ``since``: keys and map keys decoded by ``de``,
    values by ``dv`` (a typed state's decoder, or ``de``)."""
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
                value = dv(strip(payload))
            elif op == Op.LIST_SET:
                value = [dv(strip(x)) for x in split_items(payload)]
            yield Change(de(key), _OP_NAMES[Op(op)], None if ukey is None else de(ukey),
                         value, comp.handle.log_id, rank, sqn)
