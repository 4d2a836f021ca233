"""The files behind a keyed state backend's snapshots, and how long each must live.

A checkpoint snapshot names the backend's base (its materialized state, or the components a
restore brought until the first materialization) and the changelog after the materialized sqn
(FLIP-158 "Performing a checkpoint"). :class:`SnapshotFiles` keeps that base, the changelog
files written since, and the shared state registry's pins on all of them: a pinned file is one
the backend may still put in a snapshot, so cleanup must not delete it (FLIP-158 "Cleanup").

With file merging (FLIP-306 "Unified file merging mechanism") materialized state goes into
segments of the subtask's own directory; here the backend reports which checkpoint used which
segment (4.4), takes over the segments of retained checkpoints (4.5) and compacts its state's
segment when space amplification calls for it (4.7).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import DstlError, FormatError
from ..format.incremental import RocksDBHandle
from ..format.materialized import (
    MAT_SUFFIX,
    MaterializedHandle,
    StateKind,
    StatesSpec,
    encode_file,
)
from ..keygroups import KeyGroupRange
from ..merging.pool import SubtaskFileManager
from ..storage.base import Storage, join
from ..storage.deleter import Deleter
from .incremental import LocalCheckpoint, SstUploads
from .records import encode_full
from .registry import SharedStateRegistry
from .snapshot import Component, file_name

log = logging.getLogger(__name__)


TablesSnapshot = list[dict[int, dict[bytes, Any]]]  # [state id][key group][key] -> value


def encode_tables(tables: TablesSnapshot, states: StatesSpec, key_groups: KeyGroupRange
                  ) -> tuple[bytes, tuple[tuple[int, int, int], ...]]:
    """A snapshot of the tables as one materialized file (``format.materialized``): per key
    group, the records that recreate each entry. Returns the bytes and the section index."""
    kinds = [StateKind(s[1]) for s in states]

    def records(kg: int) -> list[bytes]:
        out: list[bytes] = []
        for sid, per_kg in enumerate(tables):
            for key, value in (per_kg.get(kg) or {}).items():
                out += encode_full(sid, kinds[sid], key, value)
        return out

    return encode_file((kg, records(kg)) for kg in key_groups)


def write_full(storage: Storage, tables: list, states: StatesSpec, key_groups: KeyGroupRange,
               root: str, rel: str, job: str | None, sqn: int) -> MaterializedHandle:
    """Write ``tables`` as one whole materialized file ``root/rel`` (a materialization without
    file merging, or a savepoint) and return its handle."""
    data, sections = encode_tables(tables, states, key_groups)
    storage.write_file(join(root, rel), data)
    return MaterializedHandle(job, rel, key_groups, states, sections, len(data), sqn)


class SnapshotFiles:
    """The base, the changelog files and the merged segments of one backend's snapshots.

    ``lock`` is the backend's: methods documented as taking it are called without it, the
    others with it held. ``is_closed`` tells whether the backend was closed (then nothing new
    is tracked or compacted)."""

    def __init__(self, storage: Storage, job_path: str, job_id: str, operator_id: str,
                 key_groups: KeyGroupRange, merging: SubtaskFileManager | None, *,
                 lock: threading.RLock,
                 pool: concurrent.futures.Executor, deleter: Deleter,
                 is_closed: Callable[[], bool]) -> None:
        self._storage, self._job_path, self._job_id = storage, job_path, job_id
        self._operator_id, self._key_groups = operator_id, key_groups
        self._merging = merging
        self._lock, self._pool, self._deleter, self._is_closed = lock, pool, deleter, is_closed
        self.base: tuple[Component, ...] = ()  # materialized state or restored components
        self.base_files: dict[str, str] = {}  # file name -> URL of the files the base names
        self.materialized_sqn = 0  # the base holds every change up to it
        self.segment_files: dict[str, tuple[str, int]] = {}  # name -> (url, max sqn)
        self._registry: SharedStateRegistry | None = None
        self._owner = uuid.uuid4().hex
        self._compacting = False
        self._snapshots: set[concurrent.futures.Future] = set()  # not tracked yet
        # files given to the registry (:meth:`track`) while those snapshots are in flight:
        # two late handles of one upload hand its file over once (one delete)
        self._handed: set[str] = set()
        # SST files of the rocksdb table uploaded so far (incremental materialization)
        self.ssts = SstUploads(storage, job_path, job_id, deleter)
        self.last_upload_bytes = 0  # by the last materialization

    # ------------------------------------------------------------------ the base

    def restored(self, components: tuple[Component, ...], files: dict[str, str]) -> None:
        """The base is what a restore brought (before anything else is tracked)."""
        self.base = components
        self.base_files.update(files)

    def write(self, source: list | LocalCheckpoint, states: StatesSpec, sqn: int
              ) -> MaterializedHandle | RocksDBHandle:
        """FLIP-158 materialization step 3: upload a local RocksDB checkpoint incrementally
        (its SST files not uploaded before), or the copied tables as a segment of the
        subtask's merged files (FLIP-306) or as a file of their own."""
        if isinstance(source, LocalCheckpoint):
            try:
                h = self.ssts.upload(source, self._key_groups, states, sqn)
            finally:
                source.close()
            self.last_upload_bytes = self.ssts.uploaded_bytes
            return h
        tables = source
        if self._merging is None:
            h = write_full(self._storage, tables, states, self._key_groups, self._job_path,
                           f"mat/{uuid.uuid4().hex}{MAT_SUFFIX}", self._job_id, sqn)
            self.last_upload_bytes = h.size
            return h
        data, sections = encode_tables(tables, states, self._key_groups)
        rel, offset = self._merging.write(data)
        self.last_upload_bytes = len(data)
        return MaterializedHandle(self._job_id, rel, self._key_groups, states, sections,
                                  len(data), sqn, offset)

    def materialized(self, h: MaterializedHandle | RocksDBHandle, sqn: int) -> None:
        """Step 4: ``h`` holds every change up to ``sqn`` and is now the base."""
        self.set_base(h)
        self.materialized_sqn = max(self.materialized_sqn, sqn)

    def set_base(self, h: MaterializedHandle | RocksDBHandle) -> None:
        """The materialized state is now ``h`` alone."""
        self.base = (h,)
        self.base_files = {file_name(u): u for u in self._urls(h)}
        if self._merging is not None:
            self._merging.set_base(*((h.path, h.offset) if isinstance(h, MaterializedHandle)
                                     else (None,)))

    def _urls(self, h: MaterializedHandle | RocksDBHandle) -> list[str]:
        paths = [f.path for f in h.files()] if isinstance(h, RocksDBHandle) else [h.path]
        return [join(self._job_path, p) for p in paths]

    def discard(self, h: MaterializedHandle | RocksDBHandle) -> None:
        """Drop a materialization no checkpoint will ever include (the backend closed while
        it was written); never deletes under the lock: a slow delete would hold up state
        access, so the background deleter does it. Of an incremental one, only the files
        the base does not name go."""
        if isinstance(h, RocksDBHandle):
            for url in self._urls(h):
                if file_name(url) not in self.base_files:
                    self._deleter.delete(self._storage, url)
        elif self._merging is not None:
            self._merging.discard(h.path, h.offset)
        else:
            self._deleter.delete(self._storage, join(self._job_path, h.path))

    def mark_used(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` names the base: its segments live until that
        checkpoint is subsumed (FLIP-306 4.4)."""
        if self._merging is None:
            return
        for c in self.base:
            if isinstance(c, MaterializedHandle) and self._merging.owns(c.path):
                self._merging.used(c.path, c.offset, checkpoint_id)

    # ------------------------------------------------------------------ registry pins

    def attach_registry(self, registry: SharedStateRegistry) -> None:
        """Let ``registry`` know which files the backend may still put in a snapshot (takes
        the lock)."""
        with self._lock:
            self._registry = registry
            self.repin()

    def repin(self) -> None:
        """Pin the base's files and the changelog files after the materialized sqn."""
        # changelog files wholly before the materialized sqn can never be named again: drop
        # them, with or without a registry (a backend in a Spark task or another process
        # has none, and a long run would otherwise track every file it ever wrote)
        self.segment_files = {n: v for n, v in self.segment_files.items()
                              if v[1] > self.materialized_sqn}
        if self._registry is None:
            return
        pins = dict(self.base_files)
        for name, (url, _max_sqn) in self.segment_files.items():
            pins[name] = url
        self._registry.set_pins(self._owner, pins)

    def track(self, handle: Any) -> None:
        """The changelog files of a persisted changelog handle may be named from now on
        (takes the lock). A file whose changes are all truncated already (a declined
        checkpoint's late snapshot: a materialization ended while it uploaded), or that
        comes after the backend closed, is never pinned: the registry considers it at once,
        or nothing would ever delete it (its node or transport left it to the registry,
        since it went out in a handle)."""
        with self._lock:
            # (a node's file may hold sections of other logs that no handle named yet: the
            # registry keeps it until a checkpoint started later completed, see
            # state/registry.py shared_changelog_file)
            files = {file_name(u): u for u in handle.file_paths()}
            if not self._is_closed():
                for seg in handle.segments:
                    url = join(handle.job_path, seg.path)
                    name = file_name(url)
                    old = self.segment_files.get(name)
                    self.segment_files[name] = (url, max(seg.sqn_max, old[1] if old else 0))
                self.repin()  # drops the files wholly before the materialized sqn
                files = {n: u for n, u in files.items() if n not in self.segment_files}
            files = {n: u for n, u in files.items() if n not in self._handed}
            if files and self._registry is not None:
                self._handed.update(files)
                self._registry.consider(files)

    def expect(self) -> concurrent.futures.Future:
        """A new snapshot's future: it resolves once its handle went to :meth:`track`, and
        :meth:`close` waits for it, so a late one's files reach the registry before the
        backend is gone (after the job's shutdown nobody would delete them)."""
        snapshot: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._snapshots.add(snapshot)
        snapshot.add_done_callback(self._snapshot_done)
        return snapshot

    def _snapshot_done(self, snapshot: concurrent.futures.Future) -> None:
        with self._lock:
            self._snapshots.discard(snapshot)
            if not self._snapshots:  # every handle that could name them is tracked
                self._handed.clear()

    # ------------------------------------------------------------------ file merging

    @property
    def owned_dir(self) -> str | None:
        """The subtask's directory of merged files, relative to the job directory (FLIP-306
        "DirectoryStateHandle"); None without file merging."""
        return self._merging.dir if self._merging is not None else None

    def take_over(self, checkpoints: Sequence[Any]) -> None:
        """Adopt the segments of our directory that other retained checkpoints (of
        :class:`~dstl_ray.checkpoint.recovery.CompletedCheckpoint`) name, so their files are freed
        once those are subsumed."""
        if self._merging is None:
            return
        for cc in checkpoints:
            for snap in cc.metadata.snapshots:
                if snap.owned_dir != self._merging.dir:
                    continue
                for c in snap.components:
                    if (isinstance(c, MaterializedHandle) and c.job == self._job_id
                            and self._merging.owns(c.path)):
                        self._merging.adopt(c.path, c.offset, c.size, cc.checkpoint_id,
                                            base=False)

    def subsumed(self, watermark: int, last_appended_sqn: Callable[[], int]) -> None:
        """Every checkpoint up to ``watermark`` is subsumed or declined (FLIP-306 4.4): free
        dead segment files and start a compaction if one is due (4.7) and the state stays
        put, i.e. nothing was appended after the materialized sqn (takes the lock)."""
        if self._merging is None:
            return
        self._merging.subsumed(watermark)
        cand = self._merging.compaction_candidate()
        with self._lock:
            # while state changes, the next materialization rewrites it anyway (and frees
            # the old file): compact only state that stays put
            quiet = last_appended_sqn() == self.materialized_sqn and len(self.base) == 1
            if cand is None or not quiet or self._compacting or self._is_closed():
                return
            self._compacting = True
        self._pool.submit(self._compact, *cand)

    def _compact(self, rel: str, offset: int, length: int) -> None:
        """Rewrite the current state's segment into a fresh file; the next snapshot names
        the copy, the old file goes once the checkpoints using it are subsumed."""
        assert self._merging is not None
        try:
            data = self._storage.read_range(join(self._job_path, rel), offset, length)
            if len(data) != length:
                raise FormatError(f"segment has {len(data)} of {length} bytes",
                                  path=join(self._job_path, rel), offset=offset)
            new_rel, new_off = self._merging.write(data)
            with self._lock:
                h = self.base[0] if len(self.base) == 1 else None
                if (self._is_closed() or not isinstance(h, MaterializedHandle)
                        or (h.path, h.offset) != (rel, offset)):
                    self._merging.discard(new_rel, new_off)  # the state moved on meanwhile
                    return
                self.set_base(dataclasses.replace(h, path=new_rel, offset=new_off))
                self._merging.compacted(length)
                self.repin()
        except DstlError as e:
            log.warning("compaction of %s in %s failed: %s", rel, self._operator_id, e)
        finally:
            with self._lock:
                self._compacting = False

    def stats(self) -> dict[str, Any]:
        """File merging counters and space use ({} without file merging)."""
        if self._merging is None:
            return {}
        return {**dataclasses.asdict(self._merging.stats), **self._merging.space()}

    # ------------------------------------------------------------------ shutdown

    def close(self, timeout: float = 60.0) -> None:
        """Wait (up to ``timeout`` seconds) for the snapshots still uploading (late ones'
        files go to the registry), then unpin every file (the registry deletes those no
        checkpoint includes) and close the merged files."""
        with self._lock:
            snapshots = list(self._snapshots)
        concurrent.futures.wait(snapshots, timeout=timeout)
        if self._registry is not None:
            self._registry.unpin_all(self._owner)
        if self._merging is not None:
            self._merging.close()
