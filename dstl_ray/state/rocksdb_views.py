"""Views of the ``rocksdb`` state table for savepoints (:meth:`RocksDBStateTable.view
<dstl_ray.state.rocksdb.RocksDBStateTable.view>`): a RocksDB checkpoint of the table opened
read-only, read one key group at a time, so a savepoint never holds the whole state in
memory. Not a RocksDB snapshot: rocksdict's snapshot iterators read the live database.
"""

from __future__ import annotations

import shutil
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import LocalStateError
from .records import StateKind
from .rocksdb_keys import entries, kg_prefix, scan
from .rocksdb_local import Closed, Io


class ViewDb:
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


class StateView(Mapping[int, Mapping[bytes, Any]]):
    """(``table``: the :class:`~dstl_ray.state.rocksdb.RocksDBStateTable`, whose guard, path
    and database it reads.) One state of a :meth:`RocksDBStateTable.view`: key group -> {key: value}, read from
    the view's checkpoint one key group at a time (a key group's entries are in memory at
    once, never the whole state)."""

    def __init__(self, table: Any, src: ViewDb, sid: int,
                 kind: StateKind) -> None:
        self._table, self._src, self._sid, self._kind = table, src, sid, kind

    def _read(self, kg: int) -> dict[bytes, Any]:
        t = self._table
        with t._guard:
            if isinstance(t._db, Closed):
                raise LocalStateError(f"RocksDB state table in {t.path} is closed")
            with Io(t.path, "reading a snapshot"):
                return dict(entries(self._src.db, kg, self._sid, self._kind))

    def __getitem__(self, kg: int) -> Mapping[bytes, Any]:
        d = self._read(kg) if isinstance(kg, int) and kg in self._table.key_groups else None
        if not d:
            raise KeyError(kg)
        return d

    def __iter__(self) -> Iterator[int]:
        t = self._table
        for kg in t.key_groups:
            with t._guard:
                if isinstance(t._db, Closed):
                    raise LocalStateError(f"RocksDB state table in {t.path} is closed")
                with Io(t.path, "reading a snapshot"):
                    found = next(scan(self._src.db, kg_prefix(kg, self._sid)), None)
            if found is not None:
                yield kg

    def __len__(self) -> int:
        return sum(1 for _ in self)
