"""The state-table contract under a keyed state backend (FLIP-158 is "generalized": the
changelog wraps any state backend).

A :class:`StateTable` holds the serialized keyed state of one backend: for every state id
(registered in order with :meth:`StateTable.add_state`) and key group, keys to a value
(ValueState), a non-empty list of items (ListState) or a non-empty map of user keys to
values (MapState). Keys, user keys, values and items are bytes made by the backend's
serializer; the table never looks inside them. Clearing, an empty list and removing a map's
last entry all leave the key absent, on every table.

Two implementations: ``heap`` (:mod:`dstl_ray.state.heap`, Python dicts) and ``rocksdb``
(:mod:`dstl_ray.state.rocksdb`, a local RocksDB through ``rocksdict``), whose keys start
with their key group so a key-group range is one contiguous range of the database.

Threads: changes come from one thread at a time (the backend's lock), reads may run
concurrently with them. :meth:`StateTable.view` is the consistent copy that materialization
and savepoints encode while state access goes on (FLIP-158 "Materializing state changes",
step 2).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ..format.incremental import RocksDBHandle, UploadedFile
from ..keygroups import KeyGroupRange
from .incremental import LocalCheckpoint
from .records import StateKind

STATE_BACKENDS = ("heap", "rocksdb")

# per state id: {key group: {key: value}}, where a value is bytes, a list of bytes or a
# dict of bytes to bytes, by the state's kind (what encode_file and dump_tables read)
TableView = Sequence[Mapping[int, Mapping[bytes, Any]]]


@runtime_checkable
class StateTable(Protocol):
    """Serialized keyed state of one backend, per state id, key group and key."""

    name: str  # "heap" or "rocksdb"
    # whether materialization_source copies the state (under the backend's lock, so a TTL
    # purge may hold it too), or is a local checkpoint taken in an instant
    copies_under_lock: bool

    def add_state(self, kind: StateKind) -> None:
        """Register the next state id (ids count up from 0) as a state of ``kind``."""

    # ValueState
    def get_value(self, sid: int, kg: int, key: bytes) -> bytes | None: ...

    def set_value(self, sid: int, kg: int, key: bytes, value: bytes) -> None: ...

    def set_values(self, sid: int, entries: Sequence[tuple[int, bytes, bytes | None]]
                   ) -> None:
        """:meth:`set_value` of each ``(key group, key, value)`` in order, :meth:`clear`
        where the value is None: a columnar update of a value state."""

    # ListState
    def get_list(self, sid: int, kg: int, key: bytes) -> list[bytes]:
        """The items of the key's list, in the order added ([] when absent)."""

    def add_to_list(self, sid: int, kg: int, key: bytes, item: bytes) -> None: ...

    def set_list(self, sid: int, kg: int, key: bytes, items: Sequence[bytes]) -> None:
        """Replace the key's list; no items clears the key."""

    # MapState
    def get_map_value(self, sid: int, kg: int, key: bytes, ukey: bytes) -> bytes | None: ...

    def get_map(self, sid: int, kg: int, key: bytes) -> dict[bytes, bytes]:
        """Every user key and value of the key's map ({} when absent)."""

    def put_map_value(self, sid: int, kg: int, key: bytes, ukey: bytes,
                      value: bytes) -> None: ...

    def remove_map_value(self, sid: int, kg: int, key: bytes, ukey: bytes) -> None: ...

    # every kind
    def clear(self, sid: int, kg: int, key: bytes) -> None:
        """Remove the key (its value, list or whole map) from state ``sid``."""

    def keys(self, sid: int) -> Iterator[bytes]:
        """Every key with state in ``sid``, over all key groups (order unspecified)."""

    def items(self, sid: int, key_groups: Sequence[int]) -> Iterator[tuple[int, bytes, Any]]:
        """``(key group, key, value)`` of state ``sid`` for the key groups given, key group
        by key group in their order; a value as in :data:`TableView`."""

    def entries(self) -> int:
        """Entries held, over every state: a key of a value or list state, an entry of a
        map state (RocksDB: its estimate, ``rocksdb.estimate-num-keys``). For metrics."""

    def apply_records(self, recs: list[bytes], kg: int, sid_map: list[int] | None) -> None:
        """Apply change records of key group ``kg`` (FLIP-158 "Recovery and rescaling"),
        with the record checks of :func:`dstl_ray.state.records.decode_record`."""

    def purge_expired(self, ttls: Sequence[int | None], now: int, lock: Any = None) -> int:
        """Drop every entry of a TTL state (``ttls[sid]`` ms; None: no TTL) expired at
        ``now`` (ms): values, list elements, map entries (:mod:`dstl_ray.state.ttl`); keys
        left empty go too. Unlogged. Returns how many entries went. Concurrent readers see
        each key either before or after. Given ``lock`` (the backend's, not held by the
        caller), it is held while one key group is purged, so writes go on in between and
        an entry is never deleted after a write renewed it."""

    def materialization_source(self) -> TableView | LocalCheckpoint:
        """What a materialization uploads, taken under the backend's lock (FLIP-158
        "Materializing state changes", step 2): a :meth:`view` (encoded as one file), or a
        local RocksDB checkpoint (uploaded incrementally, :mod:`dstl_ray.state.incremental`)."""

    def compact_before_upload(self, uploaded: Collection[str]) -> bool:
        """Before a materialization, outside the backend's lock: merge the table's files
        if most of them would be uploaded anyway (none named ``uploaded``), so they go up
        once in merged form instead of now and again after their merge. Returns whether
        it compacted (a heap table never does)."""

    def load_incremental(self, handle: RocksDBHandle, base_path: str,
                         key_groups: KeyGroupRange, sid_map: list[int]
                         ) -> dict[str, UploadedFile] | None:
        """Restore the entries of an incremental RocksDB materialization in ``key_groups``
        (state ids translated by ``sid_map``). Returns the SST files of the database the
        table now is, as they were uploaded (local name -> upload), if the handle's files
        replaced the table's database (any earlier such answer no longer holds); None if
        entries were copied instead."""

    def view(self) -> TableView:
        """A point-in-time view of every state that later changes do not reach; cheap to
        take under the backend's lock, read afterwards on another thread."""

    def close(self) -> None:
        """Release the table (and its local files); reads and changes afterwards fail."""
