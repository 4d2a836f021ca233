"""``ChangelogKeyedStateBackend`` (FLIP-158 "StateBackend").

Keyed ValueState, ListState and MapState in a state table (:mod:`dstl_ray.state.table`):
``heap`` (Python dicts) or ``rocksdb`` (a local RocksDB, for state larger than memory); keys
and values are kept serialized, so restore and materialization move bytes. Every change is applied to the table AND appended to the backend's changelog writer
("Tracking the changes"). Materialization runs periodically and at most one at a time
("Materializing state changes", steps 1-4); a checkpoint snapshot is the materialized state
plus the changelog handle after the last materialized sqn ("Performing a checkpoint").

Thread model: state access from one thread (the task); upload completions arrive on pool
threads and take the backend lock for step 4 (FLIP: "Task Mailbox can be used"). No file
delete runs under the lock: what the lock's holders free goes to the background deleter
(:mod:`dstl_ray.storage.deleter`), and ``close`` waits for it.

Parts kept elsewhere: access to one state (:mod:`dstl_ray.state.access`), state TTL
(:mod:`dstl_ray.state.ttl`), restoring from snapshots (:mod:`dstl_ray.state.restore`), the files
the snapshots name with their registry pins and merged segments
(:mod:`dstl_ray.state.files`), and whole-table copies and dumps
(:mod:`dstl_ray.state.tables`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CheckpointError, DstlError, KeyGroupError
from ..format.incremental import RocksDBHandle
from ..format.materialized import MAT_SUFFIX, MaterializedHandle
from ..key_hashes import BLAKE2B, KeyHash
from ..keygroups import KeyGroupRange
from ..merging.pool import UNKNOWN_USE, FileMergingOptions, SubtaskFileManager
from ..storage.deleter import background_deleter
from ..storage.registry import get_storage
from .access import _STATE_CLASSES, ListState, MapState, ValueState, _State
from .evolution import Reshapes
from .files import SnapshotFiles, write_full
from .names import StateNames
from .records import (
    ListStateDescriptor,
    MapStateDescriptor,
    Serializer,
    StateDescriptor,
    TaggedSerializer,
    ValueStateDescriptor,
)
from .registry import SharedStateRegistry
from .restore import RestoreSource, restore_state
from .schedule import MaterializationSchedule
from .snapshot import ChangelogComponent, KeyedStateSnapshot
from .table import StateTable
from .tables import dump_table, open_table
from .ttl import StateTtlConfig, now_ms

log = logging.getLogger(__name__)
MATERIALIZED = (MaterializedHandle, RocksDBHandle)
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="dstl-mat")


class ChangelogKeyedStateBackend:
    """Keyed state of one operator subtask, logged to a changelog writer.

    >>> b = ChangelogKeyedStateBackend(client, "op", KeyGroupRange(0, 127), 128)  # doctest: +SKIP
    >>> b.value_state("count").update("k", 1)  # doctest: +SKIP
    """

    def __init__(self, client: Any, operator_id: str, key_group_range: KeyGroupRange,
                 max_parallelism: int, *, materialization_interval: float | None = 10.0,
                 serializer: Serializer | None = None, clock: Callable[[], float] = time.monotonic,
                 restore: Sequence[RestoreSource] = (),
                 executor: concurrent.futures.Executor | None = None,
                 materialize_in_background: bool = False,
                 file_merging: FileMergingOptions | None = None,
                 incarnation: str = "",
                 ttl_clock: Callable[[], float] = time.time, state_backend: str = "heap",
                 local_dir: str | None = None, key_hash: KeyHash = BLAKE2B) -> None:
        if not key_group_range.end < max_parallelism:
            raise KeyGroupError(f"range {key_group_range} exceeds max_parallelism "
                                f"{max_parallelism}")
        self.operator_id = operator_id
        self.key_group_range = key_group_range
        self.max_parallelism, self.key_hash = max_parallelism, key_hash  # (key_hashes)
        self.job_id: str = client.job_id
        self.job_path: str = client.job_path
        self.materialization_interval = materialization_interval
        self._schedule = MaterializationSchedule(lambda: self.materialization_interval, clock)
        # processing time of state TTL, in seconds since the epoch: stamps outlive processes
        self._ttl_clock = ttl_clock
        self._ser, self._refs = serializer or TaggedSerializer(), dict[Any, tuple[int, bytes]]()
        self._pool = executor or _POOL
        self._storage = get_storage(self.job_path)
        # deletes decided under our lock or on a delivery thread run here (deleter.py)
        self._deleter = background_deleter()
        merging = file_merging or FileMergingOptions.from_config(getattr(client, "config", None))
        # FLIP-306: materializations go into segment files of this subtask's own directory
        self._merging = (SubtaskFileManager(self._storage, self.job_path, operator_id,
                                            key_group_range, merging)
                         if merging.enabled else None)
        self._lock = threading.RLock()
        # "heap" or "rocksdb" (its working directory under local_dir goes on close)
        self._table: StateTable = open_table(state_backend, key_group_range, local_dir, operator_id)
        self._states = StateNames(self._table.add_state)
        # declared types, retyped and dropped states (dstl_ray.state.evolution)
        self.schemas = Reshapes(self._states, self._table, key_group_range, self._ser,
                                self._lock, lambda: now_ms(self._ttl_clock()))
        # (the state classes of dstl_ray.state.access read these)
        self._names, self._kinds, self._ttls = (self._states.names, self._states.kinds,
                                                self._states.ttls)
        self._closed = False
        self._files = SnapshotFiles(self._storage, self.job_path, self.job_id, operator_id,
                                    key_group_range, self._merging, lock=self._lock,
                                    pool=self._pool, deleter=self._deleter,
                                    is_closed=lambda: self._closed)
        self._mat_future: concurrent.futures.Future | None = None
        # counters: materializations done and failed, expired entries purged (metrics)
        self.materializations = self.materialization_failures = self.ttl_evicted = 0
        # FLIP-158 "Recovery and rescaling" (FLIP-306 4.5 for merged files)
        try:
            restored = restore_state(restore, key_group_range, self.job_id,
                                     self._states.register_restored, self._table, self._merging,
                                     self.job_path)
        except BaseException:
            self._table.close()  # a rocksdb table's working directory goes with it
            raise
        self._files.restored(restored.components, restored.files)
        self._files.ssts.seed(restored.uploaded)  # SST files our database opened as its own
        # (expired entries stay until get_state confirms this run's TTL: it may be longer)
        self._writer = client.create_writer(operator_id, key_group_range)
        self._writer.incarnation = incarnation
        # restored changelog in nodes' merged files: our snapshots name it until our first
        # materialization, so its nodes must keep it for us too (FLIP-306 take-over)
        self._restored_named = -1  # newest checkpoint whose snapshot named it
        self._writer.adopt([seg for c in self._files.base if isinstance(c, ChangelogComponent)
                            for seg in c.handle.segments])
        if restored.foreign:
            # FLIP-306 4.2: after a rescale our state sits in other subtasks' files; write
            # our own copy at once (the old directories then go by reference count)
            self.materialize(force=True)
        self._stop = self._schedule.stop
        if materialize_in_background:  # FLIP-158: on a schedule of its own too
            self._schedule.run_in_background(self.maybe_materialize,
                                             f"dstl-mat-timer-{operator_id}")

    # ------------------------------------------------------------------ states

    def get_state(self, descriptor: StateDescriptor) -> _State:
        """The state ``descriptor`` names, registered if new (a typed one holding values of
        another type migrated first: :attr:`schemas`, :mod:`dstl_ray.state.evolution`)."""
        with self._lock:
            sid = self.schemas.confirm(descriptor)
        return _STATE_CLASSES[descriptor.kind](self, sid)

    def value_state(self, name: str, ttl: StateTtlConfig | float | None = None,
                           schema: Any = None) -> ValueState:
        return self.get_state(ValueStateDescriptor(name, ttl, schema))  # type: ignore[return-value]

    def list_state(self, name: str, ttl: StateTtlConfig | float | None = None,
                          schema: Any = None) -> ListState:
        return self.get_state(ListStateDescriptor(name, ttl, schema))  # type: ignore[return-value]

    def map_state(self, name: str, ttl: StateTtlConfig | float | None = None,
                         schema: Any = None) -> MapState:
        return self.get_state(MapStateDescriptor(name, ttl, schema))  # type: ignore[return-value]

    def _purge_expired(self, lock: Any = None) -> None:
        """Drop the entries of TTL states expired now from the live tables (with the lock
        held), for states whose TTL this run confirmed (``get_state``). Unlogged: an expired
        entry stays expired, and reads never return it."""
        ttls = self._states.confirmed_ttls()
        if any(t is not None for t in ttls):
            self.ttl_evicted += self._table.purge_expired(ttls, now_ms(self._ttl_clock()), lock)

    @property
    def writer(self) -> Any:
        return self._writer

    @property
    def materialized_sqn(self) -> int:
        return self._files.materialized_sqn

    def set_incarnation(self, incarnation: str) -> None:
        """The run of the job this backend writes for (:mod:`dstl_ray.checkpoint.lease`): its requests
        carry it, so node actors keep the job's state per incarnation."""
        self._writer.incarnation = incarnation

    def attach_registry(self, registry: SharedStateRegistry) -> None:
        """Let ``registry`` know which files this backend may still put in a snapshot."""
        self._files.attach_registry(registry)

    # ------------------------------------------------------------------ snapshots

    def snapshot(self, checkpoint_id: int = -1
                 ) -> concurrent.futures.Future[KeyedStateSnapshot]:
        """Checkpoint snapshot: the base (materialized) components + the changelog after
        the last materialized sqn (FLIP-158 "Performing a checkpoint"). ``checkpoint_id``
        (optional) goes with the persist request, so nodes batch one checkpoint together."""
        self.schemas.settle(self.materialize, self.wait_materialization)  # after a reshape
        self.maybe_materialize()
        with self._lock:
            if self._closed:
                raise CheckpointError(f"backend of {self.operator_id} is closed")
            base, states = self._files.base, self._states.spec()
            after = self._files.materialized_sqn
            self._files.mark_used(checkpoint_id)
            if any(isinstance(c, ChangelogComponent) for c in base):
                self._restored_named = max(self._restored_named, checkpoint_id
                                           if checkpoint_id >= 0 else UNKNOWN_USE)
            pf = self._writer.persist_durably(after=after, checkpoint_id=checkpoint_id)
        owned = self.owned_dir
        out: concurrent.futures.Future[KeyedStateSnapshot] = self._files.expect()

        def done(f: concurrent.futures.Future) -> None:
            try:
                if f.exception() is not None:
                    out.set_exception(f.exception())
                    return
                h = f.result()
                self._files.track(h)
                comps = (base if h.is_empty()
                         else base + (ChangelogComponent(self.job_id, states, h),))
                out.set_result(KeyedStateSnapshot(self.operator_id, self.key_group_range,
                                                  comps, owned))
            except BaseException as e:  # noqa: BLE001 - never leave the snapshot pending
                if not out.done():
                    out.set_exception(CheckpointError(f"snapshot of {self.operator_id} "
                                                      f"failed: {type(e).__name__}: {e}"))

        pf.add_done_callback(done)
        return out

    def savepoint(self, target_dir: str) -> concurrent.futures.Future[KeyedStateSnapshot]:
        """A full, self-contained snapshot written under ``target_dir`` (FLINK-5053); it does
        not occupy the materialization slot."""
        with self._lock:
            self._purge_expired()  # expired entries are never saved
            tables, states = self._table.view(), self._states.spec()
        rel = f"{uuid.uuid4().hex}{MAT_SUFFIX}"

        def run() -> KeyedStateSnapshot:
            h = write_full(self._storage, tables, states, self.key_group_range, target_dir,
                           rel, None, 0)
            return KeyedStateSnapshot(self.operator_id, self.key_group_range, (h,))

        return self._pool.submit(run)

    # ------------------------------------------------------------------ materialization

    def materialization_due(self) -> bool:
        return self._schedule.due()

    def maybe_materialize(self) -> concurrent.futures.Future | None:
        """Start a materialization if the interval elapsed and none is running."""
        if self.materialization_due():
            return self.materialize()
        return None

    def materialize(self, force: bool = False) -> concurrent.futures.Future | None:
        """FLIP-158 "Materializing state changes": (1) remember the sqn and (2) snapshot the
        tables atomically, (3) upload asynchronously, (4) record the sqn and truncate. At most
        one at a time: returns None if one is running or (unless ``force``) nothing changed."""
        with self._lock:
            if self._closed or (self._mat_future is not None and not self._mat_future.done()):
                return None
            self._schedule.started()
            sqn = self._writer.last_appended_sqn()  # step 1
            base = self._files.base
            if sqn == self._files.materialized_sqn and not force and (
                    not base or isinstance(base[0], MATERIALIZED) and len(base) == 1):
                return None
            result: concurrent.futures.Future = concurrent.futures.Future()
            box = [sqn, self.schemas.generation]
            if self._table.copies_under_lock:  # heap: step 2 copies the tables
                self._purge_expired()  # expired entries never reach a materialized file
                tables, states = self._table.materialization_source(), self._states.spec()
                fut = self._pool.submit(self._files.write, tables, states, sqn)  # step 3
            else:  # rocksdb: steps 1-2 are redone on the pool, after the purge
                fut = self._pool.submit(self._checkpoint_and_write, box)
            # (only once started: a copy or submit that raised leaves no future that never
            # ends, which would refuse every later materialization)
            self._mat_future = result  # done only after step 4

        def done(f: concurrent.futures.Future) -> None:  # step 4
            try:
                self._materialized(f, box[0], box[1])
            except BaseException as e:  # noqa: BLE001 - report through the future
                result.set_exception(e)
            else:
                result.set_result(f.result())

        fut.add_done_callback(done)
        return result

    def _checkpoint_and_write(self, box: list[int]) -> Any:
        """Materialization of a table whose snapshot is a local checkpoint: the TTL purge
        holds the lock for one key group at a time, then steps 1-2 hold it only while the
        local RocksDB checkpoint (a flush and hard links) is taken; step 3 uploads. A
        database mostly not uploaded yet is compacted first (outside the lock)."""
        self._purge_expired(self._lock)
        if self._closed:  # (a closed table would fail with a LocalStateError)
            raise CheckpointError("backend closed during materialization")
        self._table.compact_before_upload(self._files.ssts.names())
        with self._lock:
            if self._closed:
                raise CheckpointError("backend closed during materialization")
            box[0] = self._writer.last_appended_sqn()
            box[1] = self.schemas.generation
            source, states = self._table.materialization_source(), self._states.spec()
        return self._files.write(source, states, box[0])

    def _materialized(self, f: concurrent.futures.Future, sqn: int, generation: int) -> None:
        self._materialized_locked(f, sqn, generation)
        # the restored changelog is no longer named by our snapshots (outside the lock: it
        # calls the nodes)
        self._writer.release_adopted(self._restored_named)

    def _materialized_locked(self, f: concurrent.futures.Future, sqn: int,
                             generation: int) -> None:
        err = f.exception()
        with self._lock:
            if err is not None:
                self.materialization_failures += 1
                log.warning("materialization of %s failed: %s", self.operator_id, err)
                raise err
            h: MaterializedHandle = f.result()
            if self._closed:  # never part of any checkpoint
                self._files.discard(h)
                raise CheckpointError("backend closed during materialization")
            self._files.materialized(h, sqn)
            self.schemas.clean = max(self.schemas.clean, generation)
            self._writer.truncate(before=sqn)
            self.materializations += 1
            self._files.repin()

    def materialize_now(self, timeout: float = 300.0) -> None:
        """Materialize and wait, raising what it raised (one the restore started counts):
        after a restore from another job's checkpoint no snapshot may name its files."""
        f = self.materialize(force=True) or self._mat_future
        if f is not None:
            f.result(timeout=timeout)

    def wait_materialization(self, timeout: float | None = None) -> None:
        f = self._mat_future
        if f is not None:
            concurrent.futures.wait([f], timeout=timeout)

    # ------------------------------------------------------------------ file merging

    @property
    def owned_dir(self) -> str | None:
        """This subtask's directory of merged files, relative to the job directory (FLIP-306
        "DirectoryStateHandle"); None without file merging."""
        return self._files.owned_dir

    def take_over(self, checkpoints: Sequence[Any]) -> None:
        """Adopt the segments of our directory that other retained checkpoints (of
        :class:`~dstl_ray.checkpoint.recovery.CompletedCheckpoint`) name, so their files are freed
        once those are subsumed."""
        self._files.take_over(checkpoints)

    def notify_checkpoint_subsumed(self, watermark: int) -> None:
        """Every checkpoint up to ``watermark`` is subsumed or declined (FLIP-306 4.4: a
        watermark, so a lost notification is made good by the next). Frees dead segment
        files and starts a compaction when space amplification calls for one (4.7)."""
        self._writer.subsumed(watermark)  # nodes merging changelog files learn it too
        self._files.subsumed(watermark, self._writer.last_appended_sqn)

    def file_merging_stats(self) -> dict[str, Any]:
        return self._files.stats()

    # ------------------------------------------------------------------ introspection

    def entries(self) -> int:
        """Entries in the tables (:meth:`~dstl_ray.state.table.StateTable.entries`)."""
        with self._lock:
            return self._table.entries()

    def dump(self) -> dict[str, dict[Any, Any]]:
        """Every state as plain Python objects: {state name: {key: value}} (tests, tools)."""
        with self._lock:  # live entries only, without TTL stamps
            return dump_table(self._names, self._kinds, self._ttls, now_ms(self._ttl_clock()),
                              self._table, self.key_group_range, self._ser.deserialize,
                              lambda sid: self._states.serializer(sid, self._ser).deserialize)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """FLIP-158 "Cleanup on shutdown": unpersisted changes are dropped with the writer,
        and materialized files that no checkpoint includes are deleted (via the registry)."""
        if self._closed:
            return
        self._stop.set()
        f = self._mat_future
        if f is not None:
            concurrent.futures.wait([f], timeout=60)
        with self._lock:
            self._closed = True
        deadline = time.monotonic() + 60
        try:
            self._writer.release_adopted(self._restored_named)
            self._writer.wait_uploads(timeout=60)  # late ones too (their changes truncated)
            self._writer.close()
        except DstlError as e:
            log.warning("closing writer of %s: %s", self.operator_id, e)
        self._files.close(max(0.0, deadline - time.monotonic()))  # see SnapshotFiles.close
        self._table.close()  # a rocksdb table deletes its working directory
        # what closing freed (unused uploads, unpinned and unused files) is gone on return
        if not self._deleter.flush(timeout=60):
            log.warning("closing %s: deletes still pending after 60 s; orphan cleanup after "
                        "recovery removes what is left", self.operator_id)
