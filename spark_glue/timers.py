"""Timers per key for the stateful operator: processing time and event time (Flink's
TimerService; Spark's transformWithState timers and GroupState timeouts are the models).

A timer is a (key, domain, time) triple, time in milliseconds since the epoch. Timers ARE
keyed state: they live in the map state :data:`TIMERS_STATE` of their key (user key
``[domain, time]``), so every change to them is in the changelog, every checkpoint holds
them, and restore and rescaling move them with their key group like any other state. The
subtask's :class:`TimerService` keeps an index over them by time: built by one scan when the subtask's backend is restored and kept in step with every change
(:mod:`spark_glue.timer_index`: a heap, or with ``state_backend="rocksdb"`` a local RocksDB
ordered by key group and time, so 10M pending timers do not live on the Python heap).

When they fire: in each micro-batch, after the update function has seen the batch's rows,
every timer due fires, in time order, with its key's state: an event-time timer when the
watermark has reached its time, a processing-time timer when the wall clock has. The
watermark is the largest event time seen so far (by the operator up to the previous batch,
and by this subtask in this batch) minus ``allowed_delay``; the largest event time is part
of every checkpoint, so the watermark never goes back after a restart. A timer registered
while timers fire fires in the same batch if it is due too. Firing removes it.
"""

from __future__ import annotations

import datetime as dt
import math
import numbers
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dstl_ray.errors import StateError

from .timer_index import (
    EVENT,
    PROCESSING,
    HeapTimerIndex,
    RocksDBTimerIndex,
    TimerIndex,
)

TIMERS_STATE = "_timers"


@dataclass(frozen=True, order=True)
class Timer:
    """A timer that fired: its time (ms since the epoch), its domain, its key."""

    time_ms: int
    domain: str
    key: Any


def _ms(value: Any) -> int:
    """A timer or event time in ms since the epoch: a number (ms; numpy's too), or a datetime
    (a naive one is UTC, as Spark's TimestampNTZ values are read for the watermark); within
    64 bits."""
    t: int | None = None
    if isinstance(value, bool):
        pass
    elif isinstance(value, numbers.Integral):
        t = int(value)
    elif isinstance(value, numbers.Real) and math.isfinite(value):
        t = int(round(float(value)))
    elif isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        t = int(round(value.timestamp() * 1000))
    if t is None or not -(1 << 63) <= t < (1 << 63):
        raise StateError(f"a time must be ms since the epoch or a datetime (within 64 "
                         f"bits), got {value!r}")
    return t


def _entry(domain: str, t: int) -> str:
    """A timer's user key in :data:`TIMERS_STATE`: ``"event:<ms>"`` or ``"processing:<ms>"``."""
    return f"{domain}:{t}"


def _parse(entry: Any) -> tuple[str, int]:
    domain, _, t = str(entry).partition(":")
    if domain not in (EVENT, PROCESSING) or not t.lstrip("-").isdigit():
        raise StateError(f"malformed timer entry {entry!r} in state {TIMERS_STATE!r}")
    return domain, int(t)


class TimerService:
    """The timers of one subtask (one backend): registration, deletion, and firing.

    The timers are the state :data:`TIMERS_STATE`; which is due next, the subtask's
    :mod:`~spark_glue.timer_index` tells (a heap in memory, or with
    ``state_backend="rocksdb"`` a RocksDB of its own under ``local_dir``, so pending timers
    cost disk, not memory). The index is built by one scan of the state, key group by key
    group, when the service is made. :meth:`close` frees it (before the backend closes)."""

    # timers registered due while timers fire (one pass) beyond which on_timer is taken for
    # an endless loop (re-arming at or before the time that fired it)
    MAX_FIRINGS_PER_PASS = 1_000_000
    BUILD_BATCH = 50_000  # timers indexed per write while the index is built

    def __init__(self, backend: Any, state_backend: str = "heap",
                 local_dir: str | None = None) -> None:
        self._state = backend.map_state(TIMERS_STATE)
        key_of = self._state.key_of
        self._index: TimerIndex = (RocksDBTimerIndex(key_of, local_dir)
                                   if state_backend == "rocksdb" else HeapTimerIndex(key_of))
        self.registered = self.fired = 0  # by this service, ever (metrics)
        self._pass: dict[str, int] = {}  # while timers fire: each domain's limit
        self._rearmed = 0  # timers registered due during the pass
        try:
            self._build()
        except BaseException:
            self._index.close()
            raise

    def _build(self) -> None:
        batch: list[tuple[str, int, tuple[int, bytes]]] = []
        for ref, entries in self._state.scan():  # the index, rebuilt from state
            batch.extend((*_parse(e), ref) for e in entries)
            if len(batch) >= self.BUILD_BATCH:
                self._index.add_all(batch)
                batch = []
        if batch:
            self._index.add_all(batch)

    def register(self, key: Any, domain: str, time: Any) -> None:
        t = _ms(time)
        ref = self._state.ref(key)
        if self._index.add(domain, t, ref, key):
            try:
                self._state.put(key, _entry(domain, t), 1)
            except BaseException:
                self._index.discard(domain, t, ref, key)  # the index follows the state
                raise
            self.registered += 1
            limit = self._pass.get(domain)
            if limit is not None and t <= limit:  # due in the pass firing timers now
                self._rearmed += 1
                if self._rearmed > self.MAX_FIRINGS_PER_PASS:
                    raise StateError(
                        f"more than {self.MAX_FIRINGS_PER_PASS} timers registered due in one "
                        f"micro-batch while timers fire (key {key!r} at {t}): does on_timer "
                        f"register a timer at or before the time that fired it?")

    def delete(self, key: Any, domain: str, time: Any) -> None:
        t = _ms(time)
        ref = self._state.ref(key)
        if self._index.discard(domain, t, ref, key):
            try:
                self._state.remove(key, _entry(domain, t))
            except BaseException:
                self._index.add(domain, t, ref, key)  # the index follows the state
                raise

    def of(self, key: Any) -> list[tuple[str, int]]:
        """The key's timers, (domain, time) in time order."""
        return sorted((_parse(e) for e in self._state.items(key)), key=lambda x: (x[1], x[0]))

    def pending(self) -> int:
        """What the index holds for the pending timers (a heap's deleted entries too, until
        it is compacted)."""
        return self._index.entries()

    def live(self) -> int:
        return len(self._index)

    def due(self, watermark_ms: int | None, now_ms: int) -> Iterator[Timer]:
        """Every timer due at ``watermark_ms`` (event time; None: none is) and ``now_ms``
        (processing time), earliest first, each removed from state as it is yielded (timers
        registered meanwhile are included when due)."""
        limits = [(d, lim) for d, lim in ((EVENT, watermark_ms), (PROCESSING, now_ms))
                  if lim is not None]
        # a backlog of due timers is work; timers registered due while they fire are
        # counted (register), and past MAX_FIRINGS_PER_PASS taken for a loop
        self._pass, self._rearmed = dict(limits), 0
        try:
            while True:
                best: tuple[int, str, Any, Any] | None = None
                for domain, limit in limits:
                    head = self._index.first(domain)
                    if head is not None and head[0] <= limit and (
                            best is None or (head[0], domain) < (best[0], best[1])):
                        best = (head[0], domain, head[1], head[2])
                if best is None:
                    return
                t, domain, ref, key = best
                self._state.remove_at(ref, _entry(domain, t))  # (by ref: the key as filed)
                self._index.discard(domain, t, ref, key)
                self.fired += 1
                yield Timer(t, domain, key)
        finally:
            self._pass = {}

    def close(self) -> None:
        """Free the index (a RocksDB index deletes its directory); the timers stay in state."""
        self._index.close()


@dataclass(frozen=True)
class TimerContext:
    """What a key's timer view needs: the subtask's service and this batch's times."""

    service: TimerService
    watermark_ms: int | None
    now_ms: int


class BatchTimes:
    """This batch's times, as a timer view shows them."""

    def __init__(self, ctx: TimerContext) -> None:
        self._ctx = ctx

    @property
    def watermark(self) -> int | None:
        """The event-time watermark of this batch in ms (None: no event time yet)."""
        return self._ctx.watermark_ms

    @property
    def now(self) -> int:
        """The processing time of this batch, in ms since the epoch."""
        return self._ctx.now_ms


class KeyTimers(BatchTimes):
    """The timers of the current key (``state.timers`` in an update or on_timer function)."""

    def __init__(self, ctx: TimerContext, key: Any) -> None:
        super().__init__(ctx)
        self._key = key

    def register_event_time(self, time: Any) -> None:
        self._ctx.service.register(self._key, EVENT, time)

    def register_processing_time(self, time: Any) -> None:
        self._ctx.service.register(self._key, PROCESSING, time)

    def delete_event_time(self, time: Any) -> None:
        self._ctx.service.delete(self._key, EVENT, time)

    def delete_processing_time(self, time: Any) -> None:
        self._ctx.service.delete(self._key, PROCESSING, time)

    def list(self) -> list[tuple[str, int]]:
        """This key's pending timers, (domain, time ms), earliest first."""
        return self._ctx.service.of(self._key)


def max_event_time_ms(table: Any, column: str) -> int | None:
    """The largest event time in ``table``'s ``column`` in ms since the epoch (None: no rows
    or only nulls): a timestamp column, or integers taken as ms since the epoch."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if table is None or table.num_rows == 0:
        return None
    if column not in table.column_names:
        raise StateError(f"event_time column {column!r} is not in the micro-batch's columns "
                         f"{table.column_names}")
    col = table.column(column)
    m = pc.max(col)
    if not m.is_valid:
        return None
    if pa.types.is_timestamp(col.type):
        if col.type.unit == "s":
            return m.value * 1000
        return m.value // {"ms": 1, "us": 1000, "ns": 1_000_000}[col.type.unit]
    if pa.types.is_integer(col.type):
        return int(m.as_py())
    raise StateError(f"event_time column {column!r} must be a timestamp or integer ms, got "
                     f"{col.type}")
