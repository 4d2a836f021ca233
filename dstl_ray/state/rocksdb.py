"""The ``rocksdb`` state table: keyed state in a local RocksDB (through ``rocksdict``), so
state may be larger than memory (FLIP-158 is "generalized": the changelog wraps any state
backend; Flink runs it over RocksDB).

One database per backend, in a working directory of its own under the directory the backend
gives (deleted on close, and when opening fails); views for materialization are RocksDB
checkpoints in it. Key layout, all integers big-endian::

    u16 key group | u16 state id | u32 key length | key [| user key]   (user key: MapState)

so every key group is one contiguous range of the database, and so is a key-group range
(restore and rescale read and drop key groups by range). Values: ValueState the value;
ListState the items joined as u32-length-prefixed runs (``records.join_items``); MapState
one entry per user key, under the key's prefix. The write-ahead log is off: the changelog
is what makes state durable, and a restore rebuilds the database.

Errors of RocksDB or of the file system (a full disk, an I/O error, a table used after
close) raise :class:`~dstl_ray.errors.LocalStateError` naming the directory.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import threading
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rocksdict import (
    AccessType,
    Checkpoint,
    DbClosedError,
    Options,
    Rdict,
    WriteBatch,
    WriteOptions,
)

from ..errors import LocalStateError
from ..keygroups import KeyGroupRange
from .records import Op, StateKind, decode_record, join_items, split_items
from .table import TableView
from .ttl import alive, check_stamped

_PREFIX = struct.Struct(">HH")
_KLEN = struct.Struct(">I")
MAX_KEY_GROUPS = 1 << 16


def kg_prefix(kg: int, sid: int) -> bytes:
    """The first bytes of every entry of state ``sid`` in key group ``kg``."""
    return _PREFIX.pack(kg, sid)


def entry_key(kg: int, sid: int, key: bytes) -> bytes:
    """The database key of ``key`` (of a value or list; a map's entries extend it)."""
    return _PREFIX.pack(kg, sid) + _KLEN.pack(len(key)) + key


def key_group_bounds(key_groups: KeyGroupRange) -> tuple[bytes, bytes]:
    """``[lower, upper)`` of the database keys of a key-group range (every state)."""
    return _PREFIX.pack(key_groups.start, 0), (key_groups.end + 1).to_bytes(2, "big")


class _Io:
    """Turns RocksDB's and the file system's errors into :class:`LocalStateError`."""

    __slots__ = ("_where", "_what")

    def __init__(self, where: str, what: str) -> None:
        self._where, self._what = where, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type | None, e: BaseException | None, tb: Any) -> bool:
        # rocksdict raises plain Exception (and DbClosedError); anything else is a bug
        if e is not None and (et is Exception or isinstance(e, (OSError, DbClosedError))):
            raise LocalStateError(f"RocksDB state table in {self._where}: {self._what} "
                                  f"failed: {e}") from e
        return False


class _Closed:
    """Stands in for the database once the table is closed."""

    def __init__(self, where: str) -> None:
        self._where = where

    def __getattr__(self, name: str) -> Any:
        raise LocalStateError(f"RocksDB state table in {self._where} is closed")


def _scan(source: Any, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Entries of ``source`` (database or snapshot) whose key starts with ``prefix``."""
    it = source.iter()
    it.seek(prefix)
    n = len(prefix)
    while it.valid():
        k = it.key()
        if k[:n] != prefix:
            return
        yield k, it.value()
        it.next()


def _entries(source: Any, kg: int, sid: int, kind: StateKind
             ) -> Iterator[tuple[bytes, Any]]:
    """``(key, value)`` of state ``sid`` in key group ``kg``, values decoded by kind."""
    cur: bytes | None = None
    m: dict[bytes, bytes] = {}
    for k, v in _scan(source, kg_prefix(kg, sid)):
        (klen,) = _KLEN.unpack_from(k, 4)
        key = k[8:8 + klen]
        if kind is StateKind.VALUE:
            yield key, v
        elif kind is StateKind.LIST:
            yield key, split_items(v)
        else:
            if key != cur:
                if cur is not None:
                    yield cur, m
                cur, m = key, {}
            m[k[8 + klen:]] = v
    if cur is not None:
        yield cur, m


class RocksDBStateTable:
    """:class:`~dstl_ray.state.table.StateTable` over a local RocksDB of ``key_groups``."""

    name = "rocksdb"

    def __init__(self, key_groups: KeyGroupRange, local_dir: str | None = None) -> None:
        if key_groups.end >= MAX_KEY_GROUPS:
            raise LocalStateError(f"the rocksdb state table holds key groups below "
                                  f"{MAX_KEY_GROUPS}, got {key_groups}")
        self.key_groups = key_groups
        self._kinds: list[StateKind] = []
        self._guard = threading.Lock()  # views are made and read under it; close takes it
        self._views: weakref.WeakSet[_ViewDb] = weakref.WeakSet()
        with _Io(str(local_dir or tempfile.gettempdir()), "creating a working directory"):
            self.path = tempfile.mkdtemp(prefix="dstl-rocksdb-", dir=local_dir)
        try:
            with _Io(self.path, "opening"):
                opts = Options(raw_mode=True)
                opts.create_if_missing(True)
                self._db: Any = Rdict(f"{self.path}/db", opts)
                wo = WriteOptions()
                wo.disable_wal = True  # the changelog is the log (restore rebuilds the db)
                self._db.set_write_options(wo)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        self._read, self._write = _Io(self.path, "read"), _Io(self.path, "write")

    def add_state(self, kind: StateKind) -> None:
        self._kinds.append(kind)

    # ValueState
    def get_value(self, sid: int, kg: int, key: bytes) -> bytes | None:
        with self._read:
            return self._db.get(entry_key(kg, sid, key))

    def set_value(self, sid: int, kg: int, key: bytes, value: bytes) -> None:
        with self._write:
            self._db.put(entry_key(kg, sid, key), value)

    # ListState (read-modify-write: rocksdict has no merge operator for Python)
    def get_list(self, sid: int, kg: int, key: bytes) -> list[bytes]:
        with self._read:
            v = self._db.get(entry_key(kg, sid, key))
        return [] if v is None else split_items(v)

    def add_to_list(self, sid: int, kg: int, key: bytes, item: bytes) -> None:
        k = entry_key(kg, sid, key)
        with self._write:
            old = self._db.get(k)
            self._db.put(k, join_items([item]) if old is None else old + join_items([item]))

    def set_list(self, sid: int, kg: int, key: bytes, items: Sequence[bytes]) -> None:
        with self._write:
            if items:
                self._db.put(entry_key(kg, sid, key), join_items(list(items)))
            else:
                self._db.delete(entry_key(kg, sid, key))

    # MapState
    def get_map_value(self, sid: int, kg: int, key: bytes, ukey: bytes) -> bytes | None:
        with self._read:
            return self._db.get(entry_key(kg, sid, key) + ukey)

    def get_map(self, sid: int, kg: int, key: bytes) -> dict[bytes, bytes]:
        prefix = entry_key(kg, sid, key)
        n = len(prefix)
        with self._read:
            return {k[n:]: v for k, v in _scan(self._db, prefix)}

    def put_map_value(self, sid: int, kg: int, key: bytes, ukey: bytes, value: bytes) -> None:
        with self._write:
            self._db.put(entry_key(kg, sid, key) + ukey, value)

    def remove_map_value(self, sid: int, kg: int, key: bytes, ukey: bytes) -> None:
        with self._write:
            self._db.delete(entry_key(kg, sid, key) + ukey)

    # every kind
    def clear(self, sid: int, kg: int, key: bytes) -> None:
        k = entry_key(kg, sid, key)
        with self._write:
            if self._kinds[sid] is not StateKind.MAP:
                self._db.delete(k)
                return
            wb = WriteBatch(raw_mode=True)
            for ek, _ in _scan(self._db, k):
                wb.delete(ek)
            self._db.write(wb)

    def keys(self, sid: int) -> Iterator[bytes]:
        for _kg, k, _v in self.items(sid, self.key_groups):
            yield k

    def items(self, sid: int, key_groups: Sequence[int]) -> Iterator[tuple[int, bytes, Any]]:
        kind = self._kinds[sid]
        for kg in key_groups:
            with self._read:
                # one key group at a time: no iterator stays open between yields
                entries = list(_entries(self._db, kg, sid, kind))
            for k, v in entries:
                yield kg, k, v

    def apply_records(self, recs: list[bytes], kg: int, sid_map: list[int] | None) -> None:
        for rec in recs:
            op, sid, key, ukey, payload = decode_record(rec, self._kinds, sid_map)
            if op == Op.VALUE_SET:
                self.set_value(sid, kg, key, payload)
            elif op == Op.MAP_PUT:
                self.put_map_value(sid, kg, key, ukey, payload)  # type: ignore[arg-type]
            elif op == Op.MAP_REMOVE:
                self.remove_map_value(sid, kg, key, ukey)  # type: ignore[arg-type]
            elif op == Op.LIST_ADD:
                self.add_to_list(sid, kg, key, payload)
            elif op == Op.LIST_SET:
                self.set_list(sid, kg, key, split_items(payload))
            else:  # a clear (decode_record checked the op)
                self.clear(sid, kg, key)

    def purge_expired(self, ttls: Sequence[int | None], now: int) -> int:
        """Flink's full-scan cleanup, key group by key group, in one write batch each (a
        reader sees a key before or after, never half). Costs a scan of the TTL states."""
        dropped = 0
        for sid, ttl in enumerate(ttls):
            if ttl is None:
                continue
            kind = self._kinds[sid]

            def live(x: bytes, ttl: int = ttl) -> bool:
                check_stamped(x)
                return alive(x, now, ttl)

            for kg in self.key_groups:
                wb = WriteBatch(raw_mode=True)
                n = 0
                with self._read:
                    entries = list(_entries(self._db, kg, sid, kind))
                for key, v in entries:
                    ek = entry_key(kg, sid, key)
                    if kind is StateKind.VALUE:
                        if not live(v):
                            wb.delete(ek)
                            n += 1
                    elif kind is StateKind.LIST:
                        kept = [x for x in v if live(x)]
                        if len(kept) != len(v):
                            n += len(v) - len(kept)
                            if kept:
                                wb.put(ek, join_items(kept))
                            else:
                                wb.delete(ek)
                    else:
                        for uk, x in v.items():
                            if not live(x):
                                wb.delete(ek + uk)
                                n += 1
                if n:
                    with self._write:
                        self._db.write(wb)
                    dropped += n
        return dropped

    def view(self) -> TableView:
        """A RocksDB checkpoint of the table (hard links to its SST files, after a flush of
        the memtable) opened read-only. Not a RocksDB snapshot: rocksdict's snapshot
        iterators read the live database. The checkpoint goes when the view is garbage
        collected, or with the table."""
        with self._guard, _Io(self.path, "taking a checkpoint"):
            path = f"{self.path}/views/{uuid.uuid4().hex}"
            os.makedirs(f"{self.path}/views", exist_ok=True)
            try:
                Checkpoint(self._db).create_checkpoint(path)
                db = Rdict(path, Options(raw_mode=True), access_type=AccessType.read_only())
            except BaseException:
                shutil.rmtree(path, ignore_errors=True)
                raise
            src = _ViewDb(db, path)
            self._views.add(src)
        return [_StateView(self, src, sid, kind) for sid, kind in enumerate(self._kinds)]

    def close(self) -> None:
        """Close the database and its views and delete the working directory (views fail
        afterwards)."""
        with self._guard:
            if isinstance(self._db, _Closed):
                return
            db, self._db = self._db, _Closed(self.path)
            try:
                for v in list(self._views):
                    v.close()
                with _Io(self.path, "closing"):
                    db.close()
            finally:
                shutil.rmtree(self.path, ignore_errors=True)


class _ViewDb:
    """The read-only checkpoint behind a view; closed and deleted when the view's last
    reference goes (or with its table)."""

    def __init__(self, db: Any, path: str) -> None:
        self.db, self.path = db, path
        self._finalizer = weakref.finalize(self, _drop_view, db, path)

    def close(self) -> None:
        self._finalizer()


def _drop_view(db: Any, path: str) -> None:
    try:
        db.close()
    except Exception:  # noqa: BLE001 - closing a read-only copy; its files go next anyway
        pass
    shutil.rmtree(path, ignore_errors=True)


class _StateView(Mapping[int, Mapping[bytes, Any]]):
    """One state of a :meth:`RocksDBStateTable.view`: key group -> {key: value}, read from
    the view's checkpoint one key group at a time (a key group's entries are in memory at
    once, never the whole state)."""

    def __init__(self, table: RocksDBStateTable, src: _ViewDb, sid: int,
                 kind: StateKind) -> None:
        self._table, self._src, self._sid, self._kind = table, src, sid, kind

    def _read(self, kg: int) -> dict[bytes, Any]:
        t = self._table
        with t._guard:
            if isinstance(t._db, _Closed):
                raise LocalStateError(f"RocksDB state table in {t.path} is closed")
            with _Io(t.path, "reading a snapshot"):
                return dict(_entries(self._src.db, kg, self._sid, self._kind))

    def __getitem__(self, kg: int) -> Mapping[bytes, Any]:
        d = self._read(kg) if isinstance(kg, int) and kg in self._table.key_groups else None
        if not d:
            raise KeyError(kg)
        return d

    def __iter__(self) -> Iterator[int]:
        t = self._table
        for kg in t.key_groups:
            with t._guard:
                if isinstance(t._db, _Closed):
                    raise LocalStateError(f"RocksDB state table in {t.path} is closed")
                with _Io(t.path, "reading a snapshot"):
                    found = next(_scan(self._src.db, kg_prefix(kg, self._sid)), None)
            if found is not None:
                yield kg

    def __len__(self) -> int:
        return sum(1 for _ in self)
