"""``ChangelogKeyedStateBackend`` (FLIP-158 "StateBackend").

Keyed ValueState, ListState and MapState over in-memory tables, per state and key group; keys
and values are kept serialized (like a RocksDB backend), so restore and materialization move
bytes. Every change is applied to the table AND appended to the backend's changelog writer
("Tracking the changes"). Materialization runs periodically and at most one at a time
("Materializing state changes", steps 1-4); a checkpoint snapshot is the materialized state
plus the changelog handle after the last materialized sqn ("Performing a checkpoint").

Thread model: state access from one thread (the task); upload completions arrive on pool
threads and take the backend lock for step 4 (FLIP: "Task Mailbox can be used"). No file
delete runs under the lock: what the lock's holders free goes to the background deleter
(:mod:`dstl_ray.deleter`), and ``close`` waits for it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .deleter import background_deleter
from .errors import (
    CheckpointError,
    DstlError,
    FormatError,
    HandleError,
    KeyGroupError,
    RestoreError,
    StateError,
    StorageError,
)
from .keygroups import KeyGroupRange, assign_key_group
from .materialization import MAT_SUFFIX, MaterializedHandle, StatesSpec, encode_file
from .merging import UNKNOWN_USE, FileMergingOptions, SubtaskFileManager
from .registry import SharedStateRegistry
from .snapshot import (
    ChangelogComponent,
    Component,
    KeyedStateSnapshot,
    component_changes,
    component_files,
    file_name,
    restricted,
)
from .state import (
    ListStateDescriptor,
    MapStateDescriptor,
    Op,
    Serializer,
    StateDescriptor,
    StateKind,
    TaggedSerializer,
    ValueStateDescriptor,
    apply_records,
    encode,
    join_items,
)
from .storage import get_storage, join

log = logging.getLogger(__name__)
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="dstl-mat")


@dataclass(frozen=True)
class RestoreSource:
    """A snapshot to restore from, with where its files live and its name for errors."""

    snapshot: KeyedStateSnapshot
    base_path: str
    own_dir: str
    checkpoint: str  # e.g. the metadata URL
    checkpoint_id: int = -1  # its id (-1: unknown), for taking merged files over


class _State:
    def __init__(self, backend: ChangelogKeyedStateBackend, sid: int) -> None:
        self._b, self._sid = backend, sid
        self._t = backend._tables[sid]

    def _kg(self, key: Any) -> tuple[int, bytes]:
        b = self._b
        kg = assign_key_group(key, b.max_parallelism)
        if kg not in b.key_group_range:
            raise KeyGroupError(f"key {key!r} is in key group {kg}, outside this backend's "
                                f"range {b.key_group_range.start}..{b.key_group_range.end}")
        return kg, b._ser.serialize(key)

    def _log(self, kg: int, rec: bytes) -> None:
        self._b._writer.append(kg, rec)

    def clear(self, key: Any) -> None:
        kg, k = self._kg(key)
        op = {StateKind.VALUE: Op.VALUE_CLEAR, StateKind.LIST: Op.LIST_CLEAR,
              StateKind.MAP: Op.MAP_CLEAR}[self._b._kinds[self._sid]]
        with self._b._lock:
            self._log(kg, encode(op, self._sid, k))
            self._t.get(kg, {}).pop(k, None)

    def keys(self) -> Iterator[Any]:
        """Every key with a value in this state (all key groups of the backend)."""
        de = self._b._ser.deserialize
        for d in list(self._t.values()):
            for k in list(d):
                yield de(k)


class ValueState(_State):
    def value(self, key: Any, default: Any = None) -> Any:
        kg, k = self._kg(key)
        v = self._t.get(kg, {}).get(k)
        return default if v is None else self._b._ser.deserialize(v)

    def update(self, key: Any, value: Any) -> None:
        if value is None:
            self.clear(key)
            return
        kg, k = self._kg(key)
        v = self._b._ser.serialize(value)
        with self._b._lock:
            self._log(kg, encode(Op.VALUE_SET, self._sid, k, v))
            d = self._t.get(kg)
            if d is None:
                d = self._t[kg] = {}
            d[k] = v


class ListState(_State):
    def get(self, key: Any) -> list[Any]:
        kg, k = self._kg(key)
        de = self._b._ser.deserialize
        return [de(v) for v in self._t.get(kg, {}).get(k, ())]

    def add(self, key: Any, value: Any) -> None:
        kg, k = self._kg(key)
        v = self._b._ser.serialize(value)
        with self._b._lock:
            self._log(kg, encode(Op.LIST_ADD, self._sid, k, v))
            self._t.setdefault(kg, {}).setdefault(k, []).append(v)

    def update(self, key: Any, values: Sequence[Any]) -> None:
        kg, k = self._kg(key)
        items = [self._b._ser.serialize(v) for v in values]
        with self._b._lock:
            self._log(kg, encode(Op.LIST_SET, self._sid, k, join_items(items)))
            d = self._t.setdefault(kg, {})
            if items:
                d[k] = items
            else:
                d.pop(k, None)


class MapState(_State):
    def get(self, key: Any, user_key: Any, default: Any = None) -> Any:
        kg, k = self._kg(key)
        v = self._t.get(kg, {}).get(k, {}).get(self._b._ser.serialize(user_key))
        return default if v is None else self._b._ser.deserialize(v)

    def items(self, key: Any) -> dict[Any, Any]:
        kg, k = self._kg(key)
        de = self._b._ser.deserialize
        return {de(uk): de(v) for uk, v in self._t.get(kg, {}).get(k, {}).items()}

    def put(self, key: Any, user_key: Any, value: Any) -> None:
        kg, k = self._kg(key)
        uk, v = self._b._ser.serialize(user_key), self._b._ser.serialize(value)
        with self._b._lock:
            self._log(kg, encode(Op.MAP_PUT, self._sid, k, v, uk))
            self._t.setdefault(kg, {}).setdefault(k, {})[uk] = v

    def remove(self, key: Any, user_key: Any) -> None:
        kg, k = self._kg(key)
        uk = self._b._ser.serialize(user_key)
        with self._b._lock:
            self._log(kg, encode(Op.MAP_REMOVE, self._sid, k, b"", uk))
            d = self._t.get(kg, {})
            m = d.get(k)
            if m is not None:
                m.pop(uk, None)
                if not m:
                    del d[k]


_STATE_CLASSES = {StateKind.VALUE: ValueState, StateKind.LIST: ListState,
                  StateKind.MAP: MapState}


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
                 incarnation: str = "") -> None:
        if not key_group_range.end < max_parallelism:
            raise KeyGroupError(f"range {key_group_range} exceeds max_parallelism "
                                f"{max_parallelism}")
        self.operator_id = operator_id
        self.key_group_range = key_group_range
        self.max_parallelism = max_parallelism
        self.job_id: str = client.job_id
        self.job_path: str = client.job_path
        self.materialization_interval = materialization_interval
        self._clock = clock
        self._ser: Serializer = serializer or TaggedSerializer()
        self._pool = executor or _POOL
        self._storage = get_storage(self.job_path)
        # deletes decided under our lock or on a delivery thread run here (deleter.py)
        self._deleter = background_deleter()
        merging = file_merging or FileMergingOptions.from_config(getattr(client, "config", None))
        # FLIP-306: materializations go into segment files of this subtask's own directory
        self._merging = (SubtaskFileManager(self._storage, self.job_path, operator_id,
                                            key_group_range, merging)
                         if merging.enabled else None)
        self._compacting = False
        self._lock = threading.RLock()
        self._names: dict[str, int] = {}
        self._kinds: list[StateKind] = []
        self._tables: list[dict[int, dict[bytes, Any]]] = []
        self._base: tuple[Component, ...] = ()  # materialized state or restored components
        self._base_files: dict[str, str] = {}
        self._materialized_sqn = 0
        self._mat_future: concurrent.futures.Future | None = None
        self._last_mat_start = clock()
        self._segment_files: dict[str, tuple[str, int]] = {}  # name -> (url, max sqn)
        self._registry: SharedStateRegistry | None = None
        self._owner = uuid.uuid4().hex
        self._closed = False
        self.materializations = 0
        self.materialization_failures = 0
        foreign = self._restore(restore)
        self._writer = client.create_writer(operator_id, key_group_range)
        self._writer.incarnation = incarnation
        # restored changelog in nodes' merged files: our snapshots name it until our first
        # materialization, so its nodes must keep it for us too (FLIP-306 take-over)
        self._restored_named = -1  # newest checkpoint whose snapshot named it
        self._writer.adopt([seg for c in self._base if isinstance(c, ChangelogComponent)
                            for seg in c.handle.segments])
        if foreign:
            # FLIP-306 4.2: after a rescale our state sits in other subtasks' files; write
            # our own copy at once (the old directories then go by reference count)
            self.materialize(force=True)
        self._stop = threading.Event()
        if materialize_in_background and materialization_interval is not None:
            # FLIP-158 "Materializing state changes" runs on its own schedule, not only when
            # a checkpoint asks: a timer thread starts one whenever the interval has passed
            threading.Thread(target=self._materialization_timer, daemon=True,
                             name=f"dstl-mat-timer-{operator_id}").start()

    # ------------------------------------------------------------------ states

    def _register_state(self, name: str, kind: StateKind) -> int:
        sid = self._names.get(name)
        if sid is None:
            if len(self._kinds) >= 65535:
                raise StateError("too many states")
            sid = self._names[name] = len(self._kinds)
            self._kinds.append(kind)
            self._tables.append({})
        elif self._kinds[sid] is not kind:
            raise StateError(f"state {name!r} is a {self._kinds[sid].value} state, not "
                             f"{kind.value}")
        return sid

    def get_state(self, descriptor: StateDescriptor) -> _State:
        with self._lock:
            sid = self._register_state(descriptor.name, descriptor.kind)
        return _STATE_CLASSES[descriptor.kind](self, sid)

    def value_state(self, name: str) -> ValueState:
        return self.get_state(ValueStateDescriptor(name))  # type: ignore[return-value]

    def list_state(self, name: str) -> ListState:
        return self.get_state(ListStateDescriptor(name))  # type: ignore[return-value]

    def map_state(self, name: str) -> MapState:
        return self.get_state(MapStateDescriptor(name))  # type: ignore[return-value]

    def _states_spec(self) -> StatesSpec:
        by_sid = sorted(self._names.items(), key=lambda kv: kv[1])
        return tuple((n, self._kinds[sid].value) for n, sid in by_sid)

    @property
    def writer(self) -> Any:
        return self._writer

    @property
    def materialized_sqn(self) -> int:
        return self._materialized_sqn

    # ------------------------------------------------------------------ restore

    def _restore(self, sources: Sequence[RestoreSource]) -> bool:
        """FLIP-158 "Recovery and rescaling": materialized state first, then the changelog,
        each filtered to this backend's key groups (the handle filters by sqn). With file
        merging, segments of our own directory are taken over (FLIP-306 4.5); returns True
        if materialized state came from elsewhere (a rescale: we should write our copy)."""
        base: list[Component] = []
        foreign = False
        for src in sources:
            # a restored component may cover more key groups than the snapshot holding it
            # (a backend restored after rescaling): only the snapshot's own range counts
            want = src.snapshot.key_group_range.intersect(self.key_group_range)
            if want is None:
                continue
            for comp in src.snapshot.components:
                mine = comp.key_group_range.intersect(want)
                if mine is None:
                    continue
                files = component_files(comp, src.base_path, src.own_dir)
                try:
                    sid_map = [self._register_state(n, StateKind(k)) for n, k in comp.states]
                    # each file through its own URL's storage: the checkpoint may live on
                    # another file system than this job (a savepoint restored elsewhere)
                    for kg, recs in component_changes(comp, src.base_path, src.own_dir, mine):
                        apply_records(recs, self._tables, self._kinds, kg, sid_map)
                except (FormatError, StorageError, HandleError, StateError) as e:
                    path = getattr(e, "path", None) or next(
                        (u for u in files.values() if u in str(e)), ", ".join(files.values()))
                    raise RestoreError(f"cannot restore checkpoint {src.checkpoint}: file "
                                       f"{path}: {e}", checkpoint=src.checkpoint,
                                       path=path) from e
                base.append(restricted(comp, mine))
                self._base_files.update(files)
                if self._merging is not None and isinstance(comp, MaterializedHandle):
                    if comp.job == self.job_id and self._merging.owns(comp.path):
                        self._merging.adopt(comp.path, comp.offset, comp.size,
                                            src.checkpoint_id)
                    else:
                        foreign = True
        self._base = tuple(base)
        return foreign

    def set_incarnation(self, incarnation: str) -> None:
        """The run of the job this backend writes for (:mod:`dstl_ray.lease`): its requests
        carry it, so node actors keep the job's state per incarnation."""
        self._writer.incarnation = incarnation

    # ------------------------------------------------------------------ registry pins

    def attach_registry(self, registry: SharedStateRegistry) -> None:
        """Let ``registry`` know which files this backend may still put in a snapshot."""
        with self._lock:
            self._registry = registry
            self._repin()

    def _repin(self) -> None:
        # changelog files wholly before the materialized sqn can never be named again: drop
        # them, with or without a registry (a backend in a Spark task or another process
        # has none, and a long run would otherwise track every file it ever wrote)
        self._segment_files = {n: v for n, v in self._segment_files.items()
                               if v[1] > self._materialized_sqn}
        if self._registry is None:
            return
        pins = dict(self._base_files)
        for name, (url, _max_sqn) in self._segment_files.items():
            pins[name] = url
        self._registry.set_pins(self._owner, pins)

    def _track(self, handle: Any) -> None:
        with self._lock:
            if self._closed:
                return
            for seg in handle.segments:
                url = join(handle.job_path, seg.path)
                name = file_name(url)
                old = self._segment_files.get(name)
                self._segment_files[name] = (url, max(seg.sqn_max, old[1] if old else 0))
            self._repin()

    # ------------------------------------------------------------------ snapshots

    def snapshot(self, checkpoint_id: int = -1
                 ) -> concurrent.futures.Future[KeyedStateSnapshot]:
        """Checkpoint snapshot: the base (materialized) components + the changelog after
        the last materialized sqn (FLIP-158 "Performing a checkpoint"). ``checkpoint_id``
        (optional) goes with the persist request, so nodes batch one checkpoint together."""
        self.maybe_materialize()
        with self._lock:
            if self._closed:
                raise CheckpointError(f"backend of {self.operator_id} is closed")
            base, states, after = self._base, self._states_spec(), self._materialized_sqn
            if self._merging is not None:
                for c in base:
                    if isinstance(c, MaterializedHandle) and self._merging.owns(c.path):
                        self._merging.used(c.path, c.offset, checkpoint_id)
            if any(isinstance(c, ChangelogComponent) for c in base):
                self._restored_named = max(self._restored_named, checkpoint_id
                                           if checkpoint_id >= 0 else UNKNOWN_USE)
            pf = self._writer.persist_durably(after=after, checkpoint_id=checkpoint_id)
        owned = self.owned_dir
        out: concurrent.futures.Future[KeyedStateSnapshot] = concurrent.futures.Future()

        def done(f: concurrent.futures.Future) -> None:
            try:
                if f.exception() is not None:
                    out.set_exception(f.exception())
                    return
                h = f.result()
                self._track(h)
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

    def _copy_tables(self) -> list[dict[int, dict[bytes, Any]]]:
        out = []
        for sid, per_kg in enumerate(self._tables):
            kind = self._kinds[sid]
            if kind is StateKind.VALUE:
                out.append({kg: d.copy() for kg, d in per_kg.items() if d})
            elif kind is StateKind.LIST:
                out.append({kg: {k: list(v) for k, v in d.items()} for kg, d in per_kg.items()
                            if d})
            else:
                out.append({kg: {k: dict(v) for k, v in d.items()} for kg, d in per_kg.items()
                            if d})
        return out

    def _write_full(self, tables: list, states: StatesSpec, root: str, rel: str, job: str | None,
                    sqn: int) -> MaterializedHandle:
        data, sections = encode_file(tables, states, self.key_group_range)
        self._storage.write_file(join(root, rel), data)
        return MaterializedHandle(job, rel, self.key_group_range, states, sections, len(data),
                                  sqn)

    def savepoint(self, target_dir: str) -> concurrent.futures.Future[KeyedStateSnapshot]:
        """A full, self-contained snapshot written under ``target_dir`` (FLINK-5053); it does
        not occupy the materialization slot."""
        with self._lock:
            tables, states = self._copy_tables(), self._states_spec()
        rel = f"{uuid.uuid4().hex}{MAT_SUFFIX}"

        def run() -> KeyedStateSnapshot:
            h = self._write_full(tables, states, target_dir, rel, None, 0)
            return KeyedStateSnapshot(self.operator_id, self.key_group_range, (h,))

        return self._pool.submit(run)

    # ------------------------------------------------------------------ materialization

    def materialization_due(self) -> bool:
        return (self.materialization_interval is not None
                and self._clock() - self._last_mat_start >= self.materialization_interval)

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
            self._last_mat_start = self._clock()
            sqn = self._writer.last_appended_sqn()  # step 1
            if sqn == self._materialized_sqn and not force and (
                    not self._base or isinstance(self._base[0], MaterializedHandle)
                    and len(self._base) == 1):
                return None
            tables, states = self._copy_tables(), self._states_spec()  # step 2
            result: concurrent.futures.Future = concurrent.futures.Future()
            self._mat_future = result  # done only after step 4
            if self._merging is not None:  # step 3: a segment of our physical file
                fut = self._pool.submit(self._write_segment, tables, states, sqn)
            else:
                rel = f"mat/{uuid.uuid4().hex}{MAT_SUFFIX}"
                fut = self._pool.submit(self._write_full, tables, states, self.job_path, rel,
                                        self.job_id, sqn)  # step 3

        def done(f: concurrent.futures.Future) -> None:  # step 4
            try:
                self._materialized(f, sqn)
            except BaseException as e:  # noqa: BLE001 - report through the future
                result.set_exception(e)
            else:
                result.set_result(f.result())

        fut.add_done_callback(done)
        return result

    def _write_segment(self, tables: list, states: StatesSpec, sqn: int) -> MaterializedHandle:
        assert self._merging is not None
        data, sections = encode_file(tables, states, self.key_group_range)
        rel, offset = self._merging.write(data)
        return MaterializedHandle(self.job_id, rel, self.key_group_range, states, sections,
                                  len(data), sqn, offset)

    def _materialized(self, f: concurrent.futures.Future, sqn: int) -> None:
        self._materialized_locked(f, sqn)
        # the restored changelog is no longer named by our snapshots (outside the lock: it
        # calls the nodes)
        self._writer.release_adopted(self._restored_named)

    def _materialized_locked(self, f: concurrent.futures.Future, sqn: int) -> None:
        err = f.exception()
        with self._lock:
            if err is not None:
                self.materialization_failures += 1
                log.warning("materialization of %s failed: %s", self.operator_id, err)
                raise err
            h: MaterializedHandle = f.result()
            url = join(self.job_path, h.path)
            if self._closed:  # never part of any checkpoint
                if self._merging is not None:
                    self._merging.discard(h.path, h.offset)
                else:  # not under our lock: a slow delete would hold up state access
                    self._deleter.delete(self._storage, url)
                raise CheckpointError("backend closed during materialization")
            self._set_state_file(h)
            self._materialized_sqn = max(self._materialized_sqn, sqn)
            self._writer.truncate(before=sqn)
            self.materializations += 1
            self._repin()

    def _set_state_file(self, h: MaterializedHandle) -> None:
        """The materialized state is now ``h`` alone (caller holds the lock)."""
        url = join(self.job_path, h.path)
        self._base = (h,)
        self._base_files = {file_name(url): url}
        if self._merging is not None:
            self._merging.set_base(h.path, h.offset)

    def _materialization_timer(self) -> None:
        assert self.materialization_interval is not None
        tick = max(0.01, min(1.0, self.materialization_interval / 4))
        while not self._stop.wait(tick):
            try:
                self.maybe_materialize()
            except DstlError as e:  # a failed start is retried at the next tick
                log.warning("periodic materialization of %s: %s", self.operator_id, e)

    def wait_materialization(self, timeout: float | None = None) -> None:
        f = self._mat_future
        if f is not None:
            concurrent.futures.wait([f], timeout=timeout)

    # ------------------------------------------------------------------ file merging

    @property
    def owned_dir(self) -> str | None:
        """This subtask's directory of merged files, relative to the job directory (FLIP-306
        "DirectoryStateHandle"); None without file merging."""
        return self._merging.dir if self._merging is not None else None

    def take_over(self, checkpoints: Sequence[Any]) -> None:
        """Adopt the segments of our directory that other retained checkpoints (of
        :class:`~dstl_ray.recovery.CompletedCheckpoint`) name, so their files are freed
        once those are subsumed."""
        if self._merging is None:
            return
        for cc in checkpoints:
            for snap in cc.metadata.snapshots:
                if snap.owned_dir != self._merging.dir:
                    continue
                for c in snap.components:
                    if (isinstance(c, MaterializedHandle) and c.job == self.job_id
                            and self._merging.owns(c.path)):
                        self._merging.adopt(c.path, c.offset, c.size, cc.checkpoint_id,
                                            base=False)

    def notify_checkpoint_subsumed(self, watermark: int) -> None:
        """Every checkpoint up to ``watermark`` is subsumed or declined (FLIP-306 4.4: a
        watermark, so a lost notification is made good by the next). Frees dead segment
        files and starts a compaction when space amplification calls for one (4.7)."""
        self._writer.subsumed(watermark)  # nodes merging changelog files learn it too
        if self._merging is None:
            return
        self._merging.subsumed(watermark)
        cand = self._merging.compaction_candidate()
        with self._lock:
            # while state changes, the next materialization rewrites it anyway (and frees
            # the old file): compact only state that stays put
            quiet = (self._writer.last_appended_sqn() == self._materialized_sqn
                     and len(self._base) == 1)
            if cand is None or not quiet or self._compacting or self._closed:
                return
            self._compacting = True
        self._pool.submit(self._compact, *cand)

    def _compact(self, rel: str, offset: int, length: int) -> None:
        """Rewrite the current state's segment into a fresh file; the next snapshot names
        the copy, the old file goes once the checkpoints using it are subsumed."""
        assert self._merging is not None
        try:
            data = self._storage.read_range(join(self.job_path, rel), offset, length)
            if len(data) != length:
                raise FormatError(f"segment has {len(data)} of {length} bytes",
                                  path=join(self.job_path, rel), offset=offset)
            new_rel, new_off = self._merging.write(data)
            with self._lock:
                h = self._base[0] if len(self._base) == 1 else None
                if (self._closed or not isinstance(h, MaterializedHandle)
                        or (h.path, h.offset) != (rel, offset)):
                    self._merging.discard(new_rel, new_off)  # the state moved on meanwhile
                    return
                self._set_state_file(dataclasses.replace(h, path=new_rel, offset=new_off))
                self._merging.compacted(length)
                self._repin()
        except DstlError as e:
            log.warning("compaction of %s in %s failed: %s", rel, self.operator_id, e)
        finally:
            with self._lock:
                self._compacting = False

    def file_merging_stats(self) -> dict[str, Any]:
        if self._merging is None:
            return {}
        return {**dataclasses.asdict(self._merging.stats), **self._merging.space()}

    # ------------------------------------------------------------------ introspection

    def dump(self) -> dict[str, dict[Any, Any]]:
        """Every state as plain Python objects: {state name: {key: value}} (tests, tools)."""
        de = self._ser.deserialize
        out: dict[str, dict[Any, Any]] = {}
        with self._lock:
            for name, sid in self._names.items():
                kind, d = self._kinds[sid], {}
                for per_key in self._tables[sid].values():
                    for k, v in per_key.items():
                        if kind is StateKind.VALUE:
                            d[de(k)] = de(v)
                        elif kind is StateKind.LIST:
                            d[de(k)] = [de(x) for x in v]
                        else:
                            d[de(k)] = {de(uk): de(x) for uk, x in v.items()}
                out[name] = d
        return out

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
        try:
            self._writer.release_adopted(self._restored_named)
            self._writer.wait_uploads(timeout=60)
            self._writer.close()
        except DstlError as e:
            log.warning("closing writer of %s: %s", self.operator_id, e)
        if self._registry is not None:
            self._registry.unpin_all(self._owner)
        if self._merging is not None:
            self._merging.close()
        # what closing freed (unused uploads, unpinned and unused files) is gone on return
        if not self._deleter.flush(timeout=60):
            log.warning("closing %s: deletes still pending after 60 s; orphan cleanup after "
                        "recovery removes what is left", self.operator_id)
