"""The ``heap`` state table: every key in Python dicts (the backend's original tables).

Per state id ``{key group: {key: value}}``, a value being bytes (ValueState), a list of
bytes (ListState) or a dict of bytes to bytes (MapState): exactly the shape of
:data:`~dstl_ray.state.table.TableView`, so a view is a copy (:func:`copy_tables`) and
replay applies records to the dicts directly (:func:`~dstl_ray.state.records.apply_records`).
State is bounded by the process's memory.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from ..format.incremental import RocksDBHandle, UploadedFile
from ..keygroups import KeyGroupRange
from . import records
from .incremental import read_changes
from .records import StateKind
from .table import TableView
from .ttl import purge_expired

_EMPTY: dict = {}
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


class HeapStateTable:
    """:class:`~dstl_ray.state.table.StateTable` over dicts."""

    name = "heap"
    copies_under_lock = True

    def __init__(self, local_dir: str | None = None) -> None:
        self._local_dir = local_dir  # where a restored RocksDB handle is read (then deleted)
        self._tables: Tables = []
        self._kinds: list[StateKind] = []

    def add_state(self, kind: StateKind) -> None:
        self._kinds.append(kind)
        self._tables.append({})

    def _kg(self, sid: int, kg: int) -> dict[bytes, Any]:
        per_kg = self._tables[sid]
        d = per_kg.get(kg)
        if d is None:
            d = per_kg[kg] = {}
        return d

    # ValueState
    def get_value(self, sid: int, kg: int, key: bytes) -> bytes | None:
        return self._tables[sid].get(kg, _EMPTY).get(key)

    def set_value(self, sid: int, kg: int, key: bytes, value: bytes) -> None:
        self._kg(sid, kg)[key] = value

    def set_values(self, sid: int, entries: Sequence[tuple[int, bytes, bytes | None]]
                   ) -> None:
        per_kg = self._tables[sid]
        for kg, key, value in entries:
            d = per_kg.get(kg)
            if value is not None:
                if d is None:
                    d = per_kg[kg] = {}
                d[key] = value
            elif d is not None:
                d.pop(key, None)

    # ListState
    def get_list(self, sid: int, kg: int, key: bytes) -> list[bytes]:
        return list(self._tables[sid].get(kg, _EMPTY).get(key, ()))

    def add_to_list(self, sid: int, kg: int, key: bytes, item: bytes) -> None:
        self._kg(sid, kg).setdefault(key, []).append(item)

    def set_list(self, sid: int, kg: int, key: bytes, items: Sequence[bytes]) -> None:
        d = self._kg(sid, kg)
        if items:
            d[key] = list(items)
        else:
            d.pop(key, None)

    # MapState
    def get_map_value(self, sid: int, kg: int, key: bytes, ukey: bytes) -> bytes | None:
        return self._tables[sid].get(kg, _EMPTY).get(key, _EMPTY).get(ukey)

    def get_map(self, sid: int, kg: int, key: bytes) -> dict[bytes, bytes]:
        return dict(self._tables[sid].get(kg, _EMPTY).get(key, _EMPTY))

    def put_map_value(self, sid: int, kg: int, key: bytes, ukey: bytes, value: bytes) -> None:
        self._kg(sid, kg).setdefault(key, {})[ukey] = value

    def remove_map_value(self, sid: int, kg: int, key: bytes, ukey: bytes) -> None:
        d = self._tables[sid].get(kg, _EMPTY)
        m = d.get(key)
        if m is not None:
            m.pop(ukey, None)
            if not m:
                del d[key]

    # every kind
    def clear(self, sid: int, kg: int, key: bytes) -> None:
        d = self._tables[sid].get(kg)
        if d is not None:
            d.pop(key, None)

    def keys(self, sid: int) -> Iterator[bytes]:
        for d in list(self._tables[sid].values()):
            yield from list(d)

    def items(self, sid: int, key_groups: Sequence[int]) -> Iterator[tuple[int, bytes, Any]]:
        per_kg = self._tables[sid]
        for kg in key_groups:
            d = per_kg.get(kg)
            if d:
                for k, v in list(d.items()):
                    yield kg, k, v

    def entries(self) -> int:
        n = 0
        for kind, per_kg in zip(self._kinds, self._tables, strict=True):
            for d in per_kg.values():
                n += sum(map(len, d.values())) if kind is StateKind.MAP else len(d)
        return n

    def apply_records(self, recs: list[bytes], kg: int, sid_map: list[int] | None) -> None:
        records.apply_records(recs, self._tables, self._kinds, kg, sid_map)

    def purge_expired(self, ttls: Sequence[int | None], now: int, lock: Any = None) -> int:
        if lock is None:
            return purge_expired(self._tables, self._kinds, ttls, now)
        with lock:
            return purge_expired(self._tables, self._kinds, ttls, now)

    def materialization_source(self) -> TableView:
        return self.view()

    def compact_before_upload(self, uploaded: Collection[str]) -> bool:
        return False

    def load_incremental(self, handle: RocksDBHandle, base_path: str,
                         key_groups: KeyGroupRange, sid_map: list[int]
                         ) -> dict[str, UploadedFile] | None:
        if self._local_dir is not None:
            os.makedirs(self._local_dir, exist_ok=True)
        for kg, recs in read_changes(handle, base_path, key_groups,
                                     local_dir=self._local_dir):
            self.apply_records(recs, kg, sid_map)
        return None

    def view(self) -> TableView:
        return copy_tables(self._tables, self._kinds)

    def close(self) -> None:
        """Nothing to release: the dicts go with the table (a closed backend's state can
        still be dumped, as before the contract)."""
