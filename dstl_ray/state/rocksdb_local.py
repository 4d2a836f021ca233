"""The local side of the ``rocksdb`` state table (:mod:`dstl_ray.state.rocksdb`): its
database options and opening, its working directories and the errors of both.

A working directory holds the database, its local checkpoints and restores in progress, and
an owner file naming the process using it (its machine, pid namespace included, pid and start
time: :mod:`dstl_ray.process_identity`): a new table deletes the directories of dead processes
of its machine (a killed worker cannot close its table), so a restarted worker does not fill
the disk with copies of state. Errors of RocksDB or of the
file system (a full disk, an I/O error, a table used after close) raise
:class:`~dstl_ray.errors.LocalStateError` naming the directory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Collection, Iterator
from typing import Any

from rocksdict import (
    AccessType,
    BlockBasedOptions,
    DbClosedError,
    DBCompactionStyle,
    Options,
    Rdict,
    UniversalCompactOptions,
    WriteBatch,
    WriteOptions,
)

from ..errors import FormatError, LocalStateError
from ..keygroups import KeyGroupRange
from ..process_identity import ProcessId
from .local_recovery import LocalRecovery
from .rocksdb_keys import kg_prefix, scan

WRITE_BUFFER = 64 << 20  # memtable size: what one flush writes at most
SST_TARGET = 32 << 20
RUN_TRIGGER = 12  # sorted runs before universal compaction merges
MIN_MERGE_WIDTH = 6


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
# the owning process (JSON: its machine, pid and start time, dstl_ray.process_identity)
OWNER_FILE = "OWNER"


def owner_record() -> str:
    """What this process writes to the owner file of a working directory it creates."""
    return json.dumps(ProcessId.current().to_dict())


def new_workdir(local_dir: str | None, kind: str = "", what: str = "a working directory"
                ) -> str:
    """A new working directory (its name starting with :data:`WORKDIR_PREFIX` and ``kind``)
    under ``local_dir`` (default: the temp directory) holding its owner record, made after
    sweeping what is stale there: the working directories of dead processes
    (:func:`sweep_stale`) and local recovery folders not written for a day
    (:meth:`~dstl_ray.state.local_recovery.LocalRecovery.sweep`). Errors name ``what``."""
    where = local_dir or tempfile.gettempdir()
    with Io(where, f"creating {what}"):
        os.makedirs(where, exist_ok=True)
        sweep_stale(where)
        LocalRecovery(where).sweep()
        path = tempfile.mkdtemp(prefix=WORKDIR_PREFIX + kind, dir=where)
        try:
            with open(f"{path}/{OWNER_FILE}", "w") as f:
                f.write(owner_record())
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)  # (no sweep takes it, ownerless)
            raise
    return path


def sweep_stale(local_dir: str) -> list[str]:
    """Delete the working directories under ``local_dir`` whose process is gone (killed
    before it could close its table): a restarted worker would otherwise fill the disk
    with copies of state. Returns what went.

    Only an owner known dead goes (:meth:`ProcessId.dead`): one of this machine (host, boot
    and pid namespace: a directory shared with another container is never swept for a pid
    that means another process there) whose pid names no process, or a process started at
    another time than the owner (a reused pid would otherwise keep the directory for
    good). A directory without a readable owner record (being created this instant, or
    written by an older version, which recorded no pid namespace) is left alone."""
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
                owner = ProcessId.from_dict(json.loads(f.read()))
        except (OSError, ValueError):
            continue  # not ours, or being created this instant
        if owner is not None and owner.dead():
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone


def db_options() -> Options:
    """The table's RocksDB options, chosen for incremental uploads (what a materialization
    uploads is what compaction wrote since the last one)."""
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.increase_parallelism(2)  # flushes and compactions beside each other
    opts.set_write_buffer_size(WRITE_BUFFER)
    opts.set_target_file_size_base(SST_TARGET)
    # universal compaction merges runs of like size, MIN_MERGE_WIDTH at a time, and lets
    # RUN_TRIGGER sorted runs build up first: a byte is rewritten (and uploaded again) a few
    # times in its life, not at every flush. experiments/large_state.py, 500k keys, 100
    # rounds of 1% updates, uploaded bytes over changed bytes: leveled 11.6x (2M keys),
    # universal defaults 8.1x, these settings 2.5x (p50 1.07x)
    opts.set_compaction_style(DBCompactionStyle.universal())
    uco = UniversalCompactOptions()
    uco.min_merge_width = MIN_MERGE_WIDTH
    opts.set_universal_compaction_options(uco)
    opts.set_level_zero_file_num_compaction_trigger(RUN_TRIGGER)
    # with up to RUN_TRIGGER runs a point read would look into each: bloom filters spare it
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)
    opts.set_block_based_table_factory(table)
    return opts


def worth_compacting(db: Any, uploaded: Collection[str]) -> bool:
    """Whether a full compaction should come before the next upload: the database has
    more than one sorted run and over half its bytes are in files not uploaded yet (after
    a bulk load, a restore that copied entries, or a first materialization). Those go up
    anyway; merged first, they go up once, where otherwise universal compaction would merge
    the runs a few rounds later (its space-amplification rule) and upload them all again."""
    files = db.live_files()
    runs = sum(1 for f in files if f["level"] == 0) + len(
        {f["level"] for f in files if f["level"] > 0})
    new = sum(f["size"] for f in files if f["name"].lstrip("/") not in uploaded)
    return runs > 1 and 2 * new > sum(f["size"] for f in files)


def open_db(path: str, where: str) -> Any:
    """Open (or create) the database in ``path``, without a write-ahead log: the changelog
    is the log, and a restore rebuilds the database."""
    with Io(where, "opening"):
        db = Rdict(path, db_options())
        wo = WriteOptions()
        wo.disable_wal = True
        db.set_write_options(wo)
    return db


def copy_batches(path: str, key_groups: KeyGroupRange, sid_map: list[int]
                 ) -> Iterator[Any]:
    """The entries of the RocksDB in ``path`` (a restored handle's files), one write batch
    per key group of ``key_groups``, state ids translated by ``sid_map``: a rescale that
    merges subtasks copies them into the table's database."""
    try:
        src = Rdict(path, Options(raw_mode=True), access_type=AccessType.read_only())
    except Exception as e:  # noqa: BLE001 - rocksdict raises plain Exception
        raise FormatError(f"the RocksDB files of the handle do not open: {e}") from e
    try:
        for kg in key_groups:
            wb, n = WriteBatch(raw_mode=True), 0
            with Io(path, "read"):
                for k, v in scan(src, kg.to_bytes(2, "big")):
                    sid = sid_map[int.from_bytes(k[2:4], "big")]
                    wb.put(kg_prefix(kg, sid) + k[4:], v)
                    n += 1
            if n:
                yield wb
    except IndexError:
        raise FormatError("the restored RocksDB holds a state id its handle does not "
                          "list") from None
    finally:
        src.close()
