"""Whole-table operations on a keyed state backend's in-memory tables.

The tables hold serialized state, one per state id: ``{key group: {key: value}}``, where a
value is bytes (ValueState), a list of bytes (ListState) or a dict of bytes to bytes
(MapState). Materialization copies them atomically under the backend's lock (FLIP-158
"Materializing state changes", step 2: the copy is then encoded while state access goes on),
and tools read them back as plain Python objects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .records import StateKind

Tables = list[dict[int, dict[bytes, Any]]]


def copy_tables(tables: Tables, kinds: Sequence[StateKind]) -> Tables:
    """A copy of ``tables`` that later changes to them do not reach (empty key groups
    left out)."""
    out = []
    for sid, per_kg in enumerate(tables):
        kind = kinds[sid]
        if kind is StateKind.VALUE:
            out.append({kg: d.copy() for kg, d in per_kg.items() if d})
        elif kind is StateKind.LIST:
            out.append({kg: {k: list(v) for k, v in d.items()} for kg, d in per_kg.items()
                        if d})
        else:
            out.append({kg: {k: dict(v) for k, v in d.items()} for kg, d in per_kg.items()
                        if d})
    return out


def dump_tables(names: Mapping[str, int], kinds: Sequence[StateKind], tables: Tables,
                deserialize: Callable[[bytes], Any]) -> dict[str, dict[Any, Any]]:
    """Every state as plain Python objects: {state name: {key: value}}."""
    de = deserialize
    out: dict[str, dict[Any, Any]] = {}
    for name, sid in names.items():
        kind, d = kinds[sid], {}
        for per_key in tables[sid].values():
            for k, v in per_key.items():
                if kind is StateKind.VALUE:
                    d[de(k)] = de(v)
                elif kind is StateKind.LIST:
                    d[de(k)] = [de(x) for x in v]
                else:
                    d[de(k)] = {de(uk): de(x) for uk, x in v.items()}
        out[name] = d
    return out
