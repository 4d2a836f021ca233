"""The ``rocksdb`` state table: keyed state in a local RocksDB (through ``rocksdict``), so
state may be larger than memory (FLIP-158 is "generalized": the changelog wraps any state
backend; Flink runs it over RocksDB).

One database per backend, in a working directory of its own under the directory the backend
gives (deleted on close, and when opening fails). Keys start with their key group and state
id (:mod:`dstl_ray.state.rocksdb_keys`), so a key-group range is one contiguous range. The
write-ahead log is off: the changelog is what makes state durable, and a restore rebuilds the
database.

Materialization is incremental (:mod:`dstl_ray.state.incremental`): a local RocksDB
checkpoint whose SST files not uploaded before are uploaded. A restore downloads a handle's
files (those of a materialization on this machine hard-linked from its local copy:
:mod:`dstl_ray.state.local_recovery`) and, for the first one, opens them as the database
and drops the key groups outside its range with ``delete_range`` (Flink's restore of
incremental RocksDB state); any further handle (a rescale that merges subtasks) is copied
over key group by key group. Views for savepoints are RocksDB checkpoints opened read-only.

Errors of RocksDB or of the file system (a full disk, an I/O error, a table used after
close) raise :class:`~dstl_ray.errors.LocalStateError` naming the directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import uuid
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from rocksdict import (
    AccessType,
    Checkpoint,
    Options,
    Rdict,
    WriteBatch,
)

from ..errors import FormatError, LocalStateError
from ..format.incremental import RocksDBHandle, UploadedFile
from ..keygroups import KeyGroupRange
from .incremental import LocalCheckpoint, download
from .local_recovery import LocalRecovery
from .records import (
    HDR,
    RECORD_VERSION,
    Op,
    StateKind,
    decode_record,
    join_items,
    local_value_sid,
    split_items,
)
from .rocksdb_keys import MAX_KEY_GROUPS, entries, entry_key, kg_prefix, scan
from .rocksdb_local import (
    Closed,
    Io,
    copy_batches,
    new_workdir,
    open_db,
    worth_compacting,
)
from .rocksdb_views import StateView, ViewDb
from .table import TableView
from .ttl import alive, check_stamped

VSET = int(Op.VALUE_SET)
_BEYOND = b"\xff" * 8  # above every key (key groups are u16)
class RocksDBStateTable:
    """:class:`~dstl_ray.state.table.StateTable` over a local RocksDB of ``key_groups``."""

    name = "rocksdb"
    copies_under_lock = False

    def __init__(self, key_groups: KeyGroupRange, local_dir: str | None = None,
                 operator: str = "") -> None:
        if key_groups.end >= MAX_KEY_GROUPS:
            raise LocalStateError(f"the rocksdb state table holds key groups below "
                                  f"{MAX_KEY_GROUPS}, got {key_groups}")
        self.key_groups = key_groups
        self._kinds: list[StateKind] = []
        self._guard = threading.Lock()  # views are made and read under it; close takes it
        self._idle = threading.Condition()  # close waits until no compaction runs
        self._compacting = 0
        self._views: weakref.WeakSet[ViewDb] = weakref.WeakSet()
        # set by close() only: _db is also a Closed while a restore swaps the database
        # (and stays one if the swap failed), and the directory must go all the same
        self._closed = False
        self.path = new_workdir(local_dir)
        self.recovery = LocalRecovery(local_dir or tempfile.gettempdir(), operator)
        self._read, self._write = Io(self.path, "read"), Io(self.path, "write")
        try:
            self._db: Any = open_db(f"{self.path}/db", self.path)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def add_state(self, kind: StateKind) -> None:
        self._kinds.append(kind)

    # ValueState
    def get_value(self, sid: int, kg: int, key: bytes) -> bytes | None:
        with self._read:
            return self._db.get(entry_key(kg, sid, key))

    def set_value(self, sid: int, kg: int, key: bytes, value: bytes) -> None:
        with self._write:
            self._db.put(entry_key(kg, sid, key), value)

    def set_values(self, sid: int, entries: Sequence[tuple[int, bytes, bytes | None]]
                   ) -> None:
        wb = WriteBatch(raw_mode=True)  # a value state's keys: a delete clears one
        for kg, key, value in entries:
            if value is None:
                wb.delete(entry_key(kg, sid, key))
            else:
                wb.put(entry_key(kg, sid, key), value)
        with self._write:
            self._db.write(wb)

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
            return {k[n:]: v for k, v in scan(self._db, prefix)}

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
            for ek, _ in scan(self._db, k):
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
                found = list(entries(self._db, kg, sid, kind))
            for k, v in found:
                yield kg, k, v

    def apply_records(self, recs: list[bytes], kg: int, sid_map: list[int] | None) -> None:
        """Replay in write batches: value sets, map puts and removes, list sets and value
        or list clears go into the batch; a list add or a map clear reads the database, so
        the batch is written before it."""
        wb, n = WriteBatch(raw_mode=True), 0
        hsize, hunpack, kinds = HDR.size, HDR.unpack_from, self._kinds
        value_prefix: dict[int, bytes | None] = {}  # record sid -> kg+sid prefix if a value
        for rec in recs:
            # the bulk of a changelog, value sets, inline (decode_record's checks)
            if len(rec) >= hsize:
                ver, op, rsid, klen = hunpack(rec)
                if op == VSET and ver == RECORD_VERSION and hsize + klen <= len(rec):
                    pre = value_prefix.get(rsid, False)
                    if pre is False:
                        local = local_value_sid(rsid, kinds, sid_map)
                        pre = kg_prefix(kg, local) if local >= 0 else None
                        value_prefix[rsid] = pre
                    if pre is not None:
                        p = hsize + klen
                        wb.put(pre + rec[4:8][::-1] + rec[hsize:p], rec[p:])
                        n += 1
                        continue
            op, sid, key, ukey, payload = decode_record(rec, self._kinds, sid_map)
            ek = entry_key(kg, sid, key)
            if op == Op.VALUE_SET:
                wb.put(ek, payload)
            elif op == Op.MAP_PUT:
                wb.put(ek + ukey, payload)  # type: ignore[operator]
            elif op == Op.MAP_REMOVE:
                wb.delete(ek + ukey)  # type: ignore[operator]
            elif op == Op.LIST_SET:
                items = split_items(payload)
                if items:
                    wb.put(ek, payload)
                else:
                    wb.delete(ek)
            elif op in (Op.VALUE_CLEAR, Op.LIST_CLEAR):
                wb.delete(ek)
            else:  # LIST_ADD, MAP_CLEAR (decode_record checked the op)
                if n:
                    with self._write:
                        self._db.write(wb)
                    wb, n = WriteBatch(raw_mode=True), 0
                if op == Op.LIST_ADD:
                    self.add_to_list(sid, kg, key, payload)
                else:
                    self.clear(sid, kg, key)
                continue
            n += 1
        if n:
            with self._write:
                self._db.write(wb)

    def entries(self) -> int:
        with self._guard:
            if isinstance(self._db, Closed):
                return 0
            with self._read:
                return int(self._db.property_int_value("rocksdb.estimate-num-keys") or 0)

    def purge_expired(self, ttls: Sequence[int | None], now: int, lock: Any = None) -> int:
        """Flink's full-scan cleanup, key group by key group, in one write batch each (a
        reader sees a key before or after, never half). Costs a scan of the TTL states;
        given ``lock``, writes go on between key groups."""
        dropped = 0
        for sid, ttl in enumerate(ttls):
            if ttl is None:
                continue
            kind = self._kinds[sid]

            def live(x: bytes, ttl: int = ttl) -> bool:
                check_stamped(x)
                return alive(x, now, ttl)

            for kg in self.key_groups:
                dropped += self._purge_key_group(kg, sid, kind, live, lock)
        return dropped

    def _purge_key_group(self, kg: int, sid: int, kind: StateKind,
                         live: Callable[[bytes], bool], lock: Any) -> int:
        with lock or contextlib.nullcontext():
            wb, n = WriteBatch(raw_mode=True), 0
            with self._read:
                found = list(entries(self._db, kg, sid, kind))
            for key, v in found:
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
            return n

    # materialization and restore (dstl_ray.state.incremental)

    def materialization_source(self) -> LocalCheckpoint:
        """A local RocksDB checkpoint: the memtable is flushed, the SST files hard-linked.
        That is all that runs under the backend's lock; uploading reads the links."""
        with self._guard, Io(self.path, "taking a checkpoint"):
            os.makedirs(f"{self.path}/ckpt", exist_ok=True)
            ckpt = LocalCheckpoint(f"{self.path}/ckpt/{uuid.uuid4().hex}", self.recovery)
            try:
                Checkpoint(self._db).create_checkpoint(ckpt.path)
            except BaseException:
                ckpt.close()
                raise
        return ckpt

    def compact_before_upload(self, uploaded: Collection[str]) -> bool:
        """A full compaction if :func:`worth_compacting`. RocksDB's manual compaction holds
        neither the GIL nor ``_guard`` (a savepoint's view, taken under the backend's lock,
        must not wait for it): state access and views go on; only close waits for it."""
        with self._guard, Io(self.path, "compacting"):
            if not worth_compacting(self._db, uploaded):
                return False
            db = self._db
            with self._idle:
                self._compacting += 1
        try:
            with Io(self.path, "compacting"):
                db.compact_range(None, None)
        finally:
            with self._idle:
                self._compacting -= 1
                self._idle.notify_all()
        return True

    def _empty(self) -> bool:
        with self._read:
            it = self._db.iter()
            it.seek_to_first()
            return not it.valid()

    def load_incremental(self, handle: RocksDBHandle, base_path: str,
                         key_groups: KeyGroupRange, sid_map: list[int]
                         ) -> dict[str, UploadedFile] | None:
        """Restore the entries of ``handle`` in ``key_groups``. Into an empty table whose
        state ids are the handle's, the downloaded files become the database (only key
        groups outside ``key_groups`` are dropped, by range): returns its SST files, local
        name to upload (the database before, and what it held, is gone). Otherwise entries
        are copied over, state ids translated by ``sid_map``, and None is returned."""
        tmp = f"{self.path}/restore-{uuid.uuid4().hex}"
        try:
            download(handle, base_path, tmp, local=self.recovery)  # (local: LocalStateError)
            if self._empty() and sid_map == list(range(len(sid_map))):
                return self._adopt(tmp, handle, key_groups)
            self._copy_from(tmp, key_groups, sid_map)
            return None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _adopt(self, tmp: str, handle: RocksDBHandle, key_groups: KeyGroupRange
               ) -> dict[str, UploadedFile]:
        with self._guard:
            with Io(self.path, "closing"):
                self._db.close()
            self._db = Closed(self.path)
            shutil.rmtree(f"{self.path}/db", ignore_errors=True)
            with Io(self.path, "moving the restored files into place"):
                os.rename(tmp, f"{self.path}/db")
            try:
                self._db = open_db(f"{self.path}/db", self.path)
            except LocalStateError as e:  # the downloaded files do not form a database
                self._db = open_db(f"{self.path}/empty-{uuid.uuid4().hex}", self.path)
                raise FormatError(f"the RocksDB files of the handle do not open: {e}",
                                  path=handle.bundle.path) from e
        with self._write:
            if key_groups.start > 0:
                self._db.delete_range(b"", kg_prefix(key_groups.start, 0))
            if key_groups.end + 1 < MAX_KEY_GROUPS:
                self._db.delete_range(kg_prefix(key_groups.end + 1, 0), _BEYOND)
        return {f.name: f for f in handle.ssts}

    def _copy_from(self, path: str, key_groups: KeyGroupRange, sid_map: list[int]) -> None:
        for wb in copy_batches(path, key_groups, sid_map):
            with self._write:
                self._db.write(wb)

    def view(self) -> TableView:
        """A RocksDB checkpoint of the table (hard links to its SST files, after a flush of
        the memtable) opened read-only. Not a RocksDB snapshot: rocksdict's snapshot
        iterators read the live database. The checkpoint goes when the view is garbage
        collected, or with the table."""
        with self._guard, Io(self.path, "taking a checkpoint"):
            path = f"{self.path}/views/{uuid.uuid4().hex}"
            os.makedirs(f"{self.path}/views", exist_ok=True)
            try:
                Checkpoint(self._db).create_checkpoint(path)
                db = Rdict(path, Options(raw_mode=True), access_type=AccessType.read_only())
            except BaseException:
                shutil.rmtree(path, ignore_errors=True)
                raise
            src = ViewDb(db, path)
            self._views.add(src)
        return [StateView(self, src, sid, kind) for sid, kind in enumerate(self._kinds)]

    def close(self) -> None:
        """Close the database and its views and delete the working directory (views fail
        afterwards)."""
        with self._guard:
            if self._closed:
                return
            self._closed = True
            db, self._db = self._db, Closed(self.path)
            with self._idle:  # (no compaction starts on a Closed)
                while self._compacting:
                    self._idle.wait()
            try:
                for v in list(self._views):
                    v.close()
                if not isinstance(db, Closed):  # (a restore that failed swapping it)
                    with Io(self.path, "closing"):
                        db.close()
            finally:
                shutil.rmtree(self.path, ignore_errors=True)
