"""The index of a subtask's pending timers, by time: which timer is due next (Flink's
``InternalPriorityQueue``: a heap per subtask, or RocksDB's time-ordered timer column).

The timers themselves are keyed state (:data:`spark_glue.timers.TIMERS_STATE`): logged,
checkpointed, restored and rescaled with their key groups. The index is derived from them:
built by one scan of that state when the subtask's backend is opened, kept in step with
every registration, deletion and firing, and never checkpointed. Two kinds:

* :class:`HeapTimerIndex` (``state_backend="heap"``): a heap per domain in Python, plus a
  set of the live timers: a few hundred bytes of memory per pending timer
  (``experiments/timers_scale.py`` measures it).
* :class:`RocksDBTimerIndex` (``state_backend="rocksdb"``): the timers in a local RocksDB,
  keyed ``key group | domain | time | key`` (key-group-prefixed, time-ordered, as Flink's
  RocksDB timers are), so pending timers cost disk, not memory; in memory only the
  earliest time of each key group, over the subtask's key groups (Flink's
  ``KeyGroupPartitionedPriorityQueue`` keeps the same heap of heads).

A timer is ``(domain, time, ref, key)``: ``ref`` is the key's (key group, serialized key)
as the state files it (:meth:`dstl_ray.state.access.MapState.ref`), ``key`` the key itself.
"""

from __future__ import annotations

import heapq
import shutil
import struct
from collections.abc import Callable
from typing import Any, Protocol

from rocksdict import BlockBasedOptions, Cache, Options, Rdict, WriteBatch, WriteOptions

from dstl_ray.errors import LocalStateError
from dstl_ray.state.rocksdb_local import Closed, Io, new_workdir

EVENT, PROCESSING = "event", "processing"
Ref = tuple[int, bytes]  # (key group, serialized key)
Head = tuple[int, Ref, Any]  # (time ms, ref, key) of the earliest timer of a domain


class TimerIndex(Protocol):
    """The pending timers of one subtask, ordered by time per domain."""

    def add(self, domain: str, t: int, ref: Ref, key: Any) -> bool:
        """Index the timer; False if it already was."""

    def add_all(self, timers: list[tuple[str, int, Ref]]) -> None:
        """Index timers that are not indexed yet (the scan that builds the index)."""

    def discard(self, domain: str, t: int, ref: Ref, key: Any) -> bool:
        """Drop the timer from the index; False if it was not in it."""

    def first(self, domain: str) -> Head | None:
        """The earliest timer of ``domain`` (ties: any one of them), None if none is."""

    def __len__(self) -> int:
        """Pending timers."""

    def entries(self) -> int:
        """What the index holds for them (heap entries, deleted ones included, until it
        is compacted; RocksDB keys): for tests of its bounds."""

    def close(self) -> None:
        """Free what the index holds (a RocksDB index deletes its directory)."""


class HeapTimerIndex:
    """Timers in a heap per domain. A deleted timer's heap entry stays until it comes to
    the top or the heaps are compacted (when deleted entries outnumber live ones: a timer
    pushed ahead on every event deletes one and registers one); ``live`` answers
    membership."""

    def __init__(self, key_of: Callable[[bytes], Any]) -> None:
        self._key_of = key_of
        self._heaps: dict[str, list[tuple[int, int, Ref, Any]]] = {EVENT: [], PROCESSING: []}
        self._live: set[tuple[str, int, Ref]] = set()
        self._in_heap: set[tuple[str, int, Ref]] = set()  # one heap entry per timer at most
        self._seq = 0  # heap tiebreak: keys need not be comparable

    def add(self, domain: str, t: int, ref: Ref, key: Any) -> bool:
        timer = (domain, t, ref)
        if timer in self._live:
            return False
        self._live.add(timer)
        if timer not in self._in_heap:  # deleted and added again: its old entry serves
            self._in_heap.add(timer)
            self._seq += 1
            heapq.heappush(self._heaps[domain], (t, self._seq, ref, key))
        return True

    def add_all(self, timers: list[tuple[str, int, Ref]]) -> None:
        key_of, key, last = self._key_of, None, None
        for domain, t, ref in timers:
            if ref is not last:  # a key's timers come together
                key, last = key_of(ref[1]), ref
            self.add(domain, t, ref, key)

    def discard(self, domain: str, t: int, ref: Ref, key: Any) -> bool:
        if (domain, t, ref) not in self._live:
            return False
        self._live.discard((domain, t, ref))
        if self.entries() > 2 * len(self._live) + 1024:
            for d, heap in self._heaps.items():
                heap[:] = [e for e in heap if (d, e[0], e[2]) in self._live]
                heapq.heapify(heap)
            self._in_heap = set(self._live)
        return True

    def first(self, domain: str) -> Head | None:
        heap = self._heaps[domain]
        while heap:
            t, _seq, ref, key = heap[0]
            if (domain, t, ref) in self._live:
                return t, ref, key
            heapq.heappop(heap)  # deleted
            self._in_heap.discard((domain, t, ref))
        return None

    def __len__(self) -> int:
        return len(self._live)

    def entries(self) -> int:
        return sum(len(h) for h in self._heaps.values())

    def close(self) -> None:
        self._heaps = {EVENT: [], PROCESSING: []}
        self._live, self._in_heap = set(), set()


_KG = struct.Struct(">HB")  # key group, domain
_TIME = struct.Struct(">Q")  # time + 2**63: negative times sort first
_DOMAINS = {EVENT: 0, PROCESSING: 1}
_OFFSET = 1 << 63
WRITE_BUFFER = 16 << 20  # the index's memtable (two at most)
BLOCK_CACHE = 8 << 20  # the index's block cache


class RocksDBTimerIndex:
    """Timers as keys of a local RocksDB (``u16 key group | u8 domain | u64 time | key``),
    in a working directory of its own under ``local_dir`` (deleted on close; the one of a
    killed process goes when a later table or index sweeps ``local_dir``).

    In memory, per domain, the earliest known time of each key group holding timers, and a
    heap of those heads. A head is never later than its key group's earliest timer: adding
    a timer lowers it; a deletion leaves it as it was, and :meth:`first` checks the head on
    top against the database and moves it to the key group's real earliest."""

    def __init__(self, key_of: Callable[[bytes], Any], local_dir: str | None = None) -> None:
        self.path = new_workdir(local_dir, "timers-", "the timer index's working directory")
        self._key_of = key_of
        self._heads: dict[str, dict[int, int]] = {EVENT: {}, PROCESSING: {}}
        self._heaps: dict[str, list[tuple[int, int]]] = {EVENT: [], PROCESSING: []}
        self._n = 0
        self._io = Io(self.path, "timer index")
        try:
            with self._io:
                opts = Options(raw_mode=True)
                opts.create_if_missing(True)
                opts.set_write_buffer_size(WRITE_BUFFER)
                opts.set_max_write_buffer_number(2)  # memory: two memtables at most
                table = BlockBasedOptions()
                table.set_block_cache(Cache(BLOCK_CACHE))
                table.set_bloom_filter(10, False)  # point reads of add and discard
                opts.set_block_based_table_factory(table)
                self._db: Any = Rdict(f"{self.path}/db", opts)
                wo = WriteOptions()
                wo.disable_wal = True  # the timers' state is the log; the index is rebuilt
                self._db.set_write_options(wo)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    @staticmethod
    def _db_key(domain: str, t: int, ref: Ref) -> bytes:
        return _KG.pack(ref[0], _DOMAINS[domain]) + _TIME.pack(t + _OFFSET) + ref[1]

    def _lower_head(self, domain: str, kg: int, t: int) -> None:
        heads = self._heads[domain]
        h = heads.get(kg)
        if h is None or t < h:
            heads[kg] = t
            heap = self._heaps[domain]
            heapq.heappush(heap, (t, kg))
            if len(heap) > 4 * len(heads) + 64:  # superseded heads: rebuild
                heap[:] = [(v, g) for g, v in heads.items()]
                heapq.heapify(heap)

    def add(self, domain: str, t: int, ref: Ref, key: Any) -> bool:
        k = self._db_key(domain, t, ref)
        with self._io:
            if self._db.get(k) is not None:
                return False
            self._db.put(k, b"")
        self._n += 1
        self._lower_head(domain, ref[0], t)
        return True

    def add_all(self, timers: list[tuple[str, int, Ref]]) -> None:
        """In one write batch (the timers of a scanned state are new to the index)."""
        wb = WriteBatch(raw_mode=True)
        for domain, t, ref in timers:
            wb.put(self._db_key(domain, t, ref), b"")
        with self._io:
            self._db.write(wb)
        for domain, t, ref in timers:
            self._lower_head(domain, ref[0], t)
        self._n += len(timers)

    def discard(self, domain: str, t: int, ref: Ref, key: Any) -> bool:
        k = self._db_key(domain, t, ref)
        with self._io:
            if self._db.get(k) is None:
                return False
            self._db.delete(k)
        self._n -= 1
        return True

    def _earliest(self, domain: str, kg: int, since: int) -> tuple[int, bytes] | None:
        """The earliest timer of ``kg`` in ``domain`` in the database, at ``since`` or later
        (its head: nothing is earlier), as (time, key bytes). Seeking from the head skips
        the deleted and fired timers before it, which RocksDB keeps as tombstones until a
        compaction (from the key group's start, every check would walk them all)."""
        prefix = _KG.pack(kg, _DOMAINS[domain])
        with self._io:
            it = self._db.iter()
            it.seek(prefix + _TIME.pack(since + _OFFSET))
            if not it.valid():
                return None
            k = it.key()
        if k[:3] != prefix:
            return None
        return _TIME.unpack_from(k, 3)[0] - _OFFSET, k[11:]

    def first(self, domain: str) -> Head | None:
        heads, heap = self._heads[domain], self._heaps[domain]
        while heap:
            t, kg = heap[0]
            if heads.get(kg) != t:
                heapq.heappop(heap)  # superseded by a lower head, or the key group emptied
                continue
            found = self._earliest(domain, kg, t)
            if found is None:
                heapq.heappop(heap)
                del heads[kg]
                continue
            real, raw = found
            if real != t:  # its earliest timers were deleted or fired
                heads[kg] = real
                heapq.heapreplace(heap, (real, kg))
                continue
            return t, (kg, raw), self._key_of(raw)
        return None

    def __len__(self) -> int:
        return self._n

    def entries(self) -> int:
        return self._n

    def heads(self) -> int:
        """Key groups with timers, known in memory (for tests of the memory bound)."""
        return sum(len(h) for h in self._heads.values())

    def close(self) -> None:
        db, self._db = self._db, Closed(self.path)
        try:
            if not isinstance(db, Closed):
                try:
                    db.close()
                except Exception as e:  # noqa: BLE001 - rocksdict raises plain Exception
                    raise LocalStateError(f"timer index in {self.path}: closing failed: "
                                          f"{e}") from e
        finally:
            shutil.rmtree(self.path, ignore_errors=True)
