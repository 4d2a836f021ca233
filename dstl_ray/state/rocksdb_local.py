"""The local side of the ``rocksdb`` state table (:mod:`dstl_ray.state.rocksdb`): its
database options and opening, its working directories and the errors of both.

A working directory holds the database, its local checkpoints and restores in progress, and
an owner file naming the host and pid of the process using it: a new table deletes the
directories of dead processes of its host (a killed worker cannot close its table), so a
restarted worker does not fill the disk with copies of state. Errors of RocksDB or of the
file system (a full disk, an I/O error, a table used after close) raise
:class:`~dstl_ray.errors.LocalStateError` naming the directory.
"""

from __future__ import annotations

import os
import shutil
import socket
from typing import Any

from rocksdict import DbClosedError, DBCompactionStyle, Options, Rdict, WriteOptions

from ..errors import LocalStateError

WRITE_BUFFER = 64 << 20  # memtable size: what one flush writes at most
SST_TARGET = 32 << 20


class Io:
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


class Closed:
    """Stands in for the database once the table is closed."""

    def __init__(self, where: str) -> None:
        self._where = where

    def __getattr__(self, name: str) -> Any:
        raise LocalStateError(f"RocksDB state table in {self._where} is closed")


WORKDIR_PREFIX = "dstl-rocksdb-"
OWNER_FILE = "OWNER"  # "host pid" of the process whose table uses the directory


def sweep_stale(local_dir: str) -> list[str]:
    """Delete the working directories under ``local_dir`` whose process is gone (killed
    before it could close its table): a restarted worker would otherwise fill the disk
    with copies of state. Returns what went."""
    gone = []
    try:
        names = os.listdir(local_dir)
    except FileNotFoundError:
        return gone
    for name in names:
        path = os.path.join(local_dir, name)
        if not name.startswith(WORKDIR_PREFIX):
            continue
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                host, pid_text = f.read().split()
                pid = int(pid_text)
        except (OSError, ValueError):
            continue  # not ours, or being created this instant
        # only a process of this host (and pid namespace) can be asked whether it lives
        if host == socket.gethostname() and pid != os.getpid() and not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def db_options() -> Options:
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.increase_parallelism(2)  # flushes and compactions beside each other
    opts.set_write_buffer_size(WRITE_BUFFER)
    opts.set_target_file_size_base(SST_TARGET)  # uploads read one SST into memory at once
    # universal compaction: a materialization's new SST files are merged with other recent
    # ones, rarely with the whole database, so an incremental upload stays near the bytes
    # changed (leveled compaction rewrote ~4x as much in experiments/large_state.py)
    opts.set_compaction_style(DBCompactionStyle.universal())
    return opts


def open_db(path: str, where: str) -> Any:
    """Open (or create) the database in ``path``, without a write-ahead log: the changelog
    is the log, and a restore rebuilds the database."""
    with Io(where, "opening"):
        db = Rdict(path, db_options())
        wo = WriteOptions()
        wo.disable_wal = True
        db.set_write_options(wo)
    return db
