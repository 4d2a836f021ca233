"""Reading the state of a retained checkpoint or savepoint without running the job (Flink's
State Processor API, Spark's state data source): the snapshots of one operator are restored,
key-group range by key-group range, into a throwaway table, and one state is read back as
plain Python objects.

Nothing is written: no changelog writer, no lease, no registry. Several readers may read
disjoint key-group ranges of one checkpoint in parallel (``spark_glue.read_state`` does, one
Spark task per range), each holding only its range in memory. Expired entries of TTL states
are left out, as the job would never return them (FLIP-158 leaves TTL to the backend;
Flink's StateTtlConfig "never return expired").
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import RestoreError, StateError
from ..format.materialized import spec_dropped, spec_schema
from ..keygroups import KeyGroupRange, key_group_range_for_subtask
from ..state.names import StateNames
from ..state.records import StateKind, TaggedSerializer
from ..state.restore import RestoreSource, restore_state
from ..state.table import StateTable
from ..state.tables import dump_table, open_table
from ..state.ttl import spec_ttl
from ..storage.base import join, normalize_url
from .metadata import METADATA_FILE
from .recovery import (
    CompletedCheckpoint,
    assign_sources,
    list_checkpoints,
    load_checkpoint,
)


@dataclass(frozen=True)
class StateInfo:
    """One state of an operator in a checkpoint: its name, kind, TTL (ms or None) and
    declared schema (canonical DDL; None: untyped)."""

    name: str
    kind: StateKind
    ttl_ms: int | None
    schema: str | None = None


def resolve_checkpoint(source: str) -> str:
    """The ``_metadata`` URL that ``source`` names: a ``_metadata`` URL, a checkpoint or
    savepoint directory (``.../chk-7``, ``.../savepoint-3f9c...``), or a job directory
    (its latest complete checkpoint)."""
    url = normalize_url(source).rstrip("/")
    if url.endswith("/" + METADATA_FILE):
        return url
    last = url.rsplit("/", 1)[-1]
    if last.startswith(("chk-", "savepoint-")):
        return join(url, METADATA_FILE)
    found = list_checkpoints(url)
    if not found:
        raise RestoreError(f"no complete checkpoint under {source} (give a job directory, a "
                           f"chk-n or savepoint-... directory, or a _metadata URL)",
                           checkpoint=source)
    return found[-1][1]


def operator_states(cc: CompletedCheckpoint, operator_id: str) -> dict[str, StateInfo]:
    """The states the snapshots of ``operator_id`` in ``cc`` name, by name."""
    out: dict[str, StateInfo] = {}
    snaps = [s for s in cc.metadata.snapshots if s.operator_id == operator_id]
    if not snaps:
        ops = sorted({s.operator_id for s in cc.metadata.snapshots})
        raise StateError(f"checkpoint {cc.metadata_url} has no operator {operator_id!r} "
                         f"(it has {', '.join(map(repr, ops)) or 'none'})")
    for s in snaps:
        for comp in s.components:
            for spec in comp.states:
                if not spec_dropped(spec):
                    out.setdefault(spec[0], StateInfo(spec[0], StateKind(spec[1]),
                                                      spec_ttl(spec), spec_schema(spec)))
    return out


def state_info(cc: CompletedCheckpoint, operator_id: str, state: str) -> StateInfo:
    """State ``state`` of ``operator_id`` in ``cc``; a :class:`StateError` names the states
    there are if it has none of that name."""
    states = operator_states(cc, operator_id)
    if state not in states:
        raise StateError(f"operator {operator_id!r} in {cc.metadata_url} has no state "
                         f"{state!r} (it has {sorted(states)})")
    return states[state]


def the_operator(cc: CompletedCheckpoint, operator_id: str | None) -> str:
    """``operator_id``, or the only operator of ``cc`` when None."""
    if operator_id is not None:
        return operator_id
    ops = sorted({s.operator_id for s in cc.metadata.snapshots})
    if len(ops) != 1:
        raise StateError(f"checkpoint {cc.metadata_url} holds operators {ops}: name one "
                         f"(operator_id=...)")
    return ops[0]


@dataclass(frozen=True)
class RestoredRange:
    """One key-group range of an operator of a checkpoint, restored (:func:`restored_range`):
    its range, the snapshots it came from, the table holding it and its states' names."""

    key_groups: KeyGroupRange
    sources: list[RestoreSource]
    table: StateTable
    names: StateNames


@contextmanager
def restored_range(cc: CompletedCheckpoint, operator_id: str, parts: int, index: int,
                   table: str = "heap", local_dir: str | None = None
                   ) -> Iterator[RestoredRange]:
    """Key-group range ``index`` of ``parts`` of ``operator_id`` in ``cc``, restored into a
    throwaway ``table`` (``"heap"`` or ``"rocksdb"``) in a temporary directory (under
    ``local_dir``), closed and removed on exit: what this reader and a savepoint of a
    checkpoint (:mod:`~dstl_ray.checkpoint.savepoint_parts`) read."""
    kgr = key_group_range_for_subtask(cc.metadata.max_parallelism, parts, index)
    sources = assign_sources(cc, operator_id, parts)[index]
    if local_dir is not None:
        os.makedirs(local_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dstl-reader-", dir=local_dir) as local:
        t = open_table(table, kgr, local)
        try:
            names = StateNames(t.add_state)
            restore_state(sources, kgr, "", names.register_restored, t, None)
            yield RestoredRange(kgr, sources, t, names)
        finally:
            t.close()


def _dump(cc: CompletedCheckpoint, operator_id: str, parts: int, index: int,
          now_ms: int | None, state: str | None) -> dict[str, dict[Any, Any]]:
    """The states of ``operator_id`` in key-group range ``index`` of ``parts`` of ``cc``
    (only ``state`` if given), restored into a heap table in a temporary directory."""
    untyped = TaggedSerializer()
    with restored_range(cc, operator_id, parts, index) as r:
        names, kgr = r.names, r.key_groups
        wanted = names.names if state is None else \
            ({state: names.names[state]} if state in names.names else {})
        return dump_table(wanted, names.kinds, names.ttls,
                          int(time.time() * 1000) if now_ms is None else now_ms, r.table,
                          range(kgr.start, kgr.end + 1), untyped.deserialize,
                          lambda sid: names.serializer(sid, untyped).deserialize)


def read_range(metadata_url: str, operator_id: str, state: str, parts: int, index: int,
               now_ms: int | None = None) -> Iterator[tuple[Any, Any]]:
    """The ``(key, value)`` pairs of ``state`` in key-group range ``index`` of ``parts``
    (the ranges a job of parallelism ``parts`` would give its subtasks). Values are as the
    job reads them: a value, a list, or a dict for a map state. ``now_ms``: the time TTL
    expiry is judged at (default now)."""
    cc = load_checkpoint(metadata_url)
    state_info(cc, operator_id, state)
    yield from _dump(cc, operator_id, parts, index, now_ms, state).get(state, {}).items()


def read_states(metadata_url: str, operator_id: str, now_ms: int | None = None
                ) -> dict[str, dict[Any, Any]]:
    """Every state of ``operator_id`` in the checkpoint or savepoint ``metadata_url``, read
    in this process: {state name: {key: value}} (expired TTL entries left out)."""
    return _dump(load_checkpoint(metadata_url), operator_id, 1, 0, now_ms, None)


def read_state(source: str, state: str, operator_id: str | None = None,
               now_ms: int | None = None) -> dict[Any, Any]:
    """Every entry of ``state`` in the checkpoint or savepoint ``source`` (see
    :func:`resolve_checkpoint`), read in this process: {key: value}."""
    url = resolve_checkpoint(source)
    op = the_operator(load_checkpoint(url), operator_id)
    return dict(read_range(url, op, state, 1, 0, now_ms))


__all__ = ["RestoredRange", "StateInfo", "operator_states", "read_range", "read_state",
           "read_states", "resolve_checkpoint", "restored_range", "state_info", "the_operator"]
