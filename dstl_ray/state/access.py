"""Access to one keyed state of a :class:`~dstl_ray.state.backend.ChangelogKeyedStateBackend`:
ValueState, ListState and MapState (FLIP-158 "StateBackend / Tracking the changes").

Every change is applied to the backend's state table (:mod:`dstl_ray.state.table`: heap or
rocksdb) AND appended to its changelog writer as one record (:mod:`dstl_ray.state.records`). States with a TTL stamp what they write and never
return an expired entry (:mod:`dstl_ray.state.ttl`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import KeyGroupError, StateError
from .records import (
    Op,
    StateKind,
    TaggedSerializer,
    encode,
    encode_value_changes,
    encode_value_set,
    join_items,
)
from .table import StateTable
from .ttl import STAMP_SIZE, alive, now_ms, stamp

UPDATE_CHUNK = 4096  # keys of a columnar update logged together (bounded unsent memory)
# keys whose (key group, serialized key) a backend remembers (``_refs``): a per-key update
# reads, then writes, the states of one key, and hot keys come back batch after batch
REF_MEMO = 1 << 14  # (ChangelogKeyedStateBackend._refs: key -> (key group, key bytes))
MEMO_STR, MEMO_INT = 64, 1 << 63  # longer str keys, larger int keys: not remembered


class _State:
    def __init__(self, backend: Any, sid: int) -> None:
        self._b, self._sid = backend, sid
        self._t: StateTable = backend._table

    def _kg(self, key: Any) -> tuple[int, bytes]:
        b = self._b
        t = type(key)
        # exact int and str keys, short ones (True and 1.0 are not 1; a str and a bytes of
        # one hash compare, which python -bb refuses: bytes keys are not remembered)
        memo = (t is str and len(key) <= MEMO_STR) or (t is int and -MEMO_INT < key < MEMO_INT)
        if memo:
            ref = b._refs.get(key)
            if ref is not None:
                return ref
        if (t is int or t is str) and type(b._ser) is TaggedSerializer:
            ref = b.key_hash.group_and_input(key, b.max_parallelism)  # input: its encoding
        else:
            ref = b.key_hash.key_group(key, b.max_parallelism), b._ser.serialize(key)
        kg, r = ref[0], b.key_group_range
        if not r.start <= kg <= r.end:
            raise KeyGroupError(f"key {key!r} is in key group {kg}, outside this backend's "
                                f"range {r.start}..{r.end}")
        if memo:
            refs = b._refs
            if len(refs) >= REF_MEMO:
                refs.clear()  # (bounded: a key space larger than the memo starts it over)
            refs[key] = ref
        return ref

    @property
    def _vs(self) -> Any:
        """How values are encoded: by the state's declared type if it has one (keys and map
        keys: untyped), looked up at each use (a state retyped or dropped since this handle
        was taken is encoded as it is now, or refused)."""
        return self._b._states.serializer(self._sid, self._b._ser)

    def ref(self, key: Any) -> tuple[int, bytes]:
        """``key``'s key group and serialized form: how the table files it (an index kept
        beside the state, such as a timer index, files keys the same way)."""
        return self._kg(key)

    def key_of(self, raw: bytes) -> Any:
        """The key whose serialized form is ``raw`` (:meth:`ref`'s second part)."""
        return self._b._ser.deserialize(raw)

    def _log(self, kg: int, rec: bytes) -> None:
        self._b._writer.append(kg, rec)

    def _ttl(self) -> tuple[int | None, int]:
        """This state's TTL in ms (None: none) and the processing time now (ms)."""
        ttl = self._b._ttls[self._sid]
        return ttl, (now_ms(self._b._ttl_clock()) if ttl is not None else 0)

    def _stamped(self, v: bytes) -> bytes:
        """``v`` as this state stores it (update-on-write: a write stamps it with now)."""
        ttl = self._b._ttls[self._sid]
        return v if ttl is None else stamp(v, now_ms(self._b._ttl_clock()))

    def clear(self, key: Any) -> None:
        kg, k = self._kg(key)
        op = {StateKind.VALUE: Op.VALUE_CLEAR, StateKind.LIST: Op.LIST_CLEAR,
              StateKind.MAP: Op.MAP_CLEAR}[self._b._kinds[self._sid]]
        with self._b._lock:
            self._log(kg, encode(op, self._sid, k))
            self._t.clear(self._sid, kg, k)

    def keys(self) -> Iterator[Any]:
        """Every key with a value in this state (all key groups of the backend); with a TTL,
        only keys with a live value (list element, map entry)."""
        de = self._b._ser.deserialize
        ttl, now = self._ttl()
        if ttl is None:
            for k in self._t.keys(self._sid):
                yield de(k)
            return
        value = self._b._kinds[self._sid] is StateKind.VALUE
        for _kg, k, v in self._t.items(self._sid, self._b.key_group_range):
            if alive(v, now, ttl) if value else any(
                    alive(x, now, ttl) for x in (v.values() if isinstance(v, dict) else v)):
                yield de(k)


class ValueState(_State):
    def value(self, key: Any, default: Any = None) -> Any:
        kg, k = self._kg(key)
        b, sid = self._b, self._sid
        v = self._t.get_value(sid, kg, k)
        if v is None:
            return default
        de = b._states.serializer(sid, b._ser).deserialize  # (:attr:`_vs`, the hot path)
        if b._ttls[sid] is None:
            return de(v)
        return self._read(v, default, *self._ttl(), de)

    @staticmethod
    def _read(v: bytes | None, default: Any, ttl: int | None, now: int,
              de: Callable[[bytes], Any]) -> Any:
        """A stored value as the user sees it: ``default`` if absent or expired
        (NeverReturnExpired), else decoded by ``de`` without its TTL stamp."""
        if v is None or (ttl is not None and not alive(v, now, ttl)):
            return default
        return de(v if ttl is None else v[STAMP_SIZE:])

    def update(self, key: Any, value: Any) -> None:
        if value is None:
            self.clear(key)
            return
        kg, k = self._kg(key)
        b, sid = self._b, self._sid
        # :attr:`_vs`, :meth:`_stamped` and :meth:`_log` inline: the per-key API's hot path
        v = b._states.serializer(sid, b._ser).serialize(value)
        if b._ttls[sid] is not None:
            v = stamp(v, now_ms(b._ttl_clock()))
        rec = encode_value_set(sid, k, v)
        with b._lock:
            b._writer.append(kg, rec)
            self._t.set_value(sid, kg, k, v)

    # columnar access (spark_glue's vectorized API): the same semantics as value() and
    # update() per key, with the key groups and serialized keys computed once per chunk

    def refs(self, keys: Sequence[Any]) -> list[tuple[int, bytes]]:
        """:meth:`ref` of every key, for :meth:`values_at`/:meth:`update_at`. With the
        default serializer an ``int`` or ``str`` key's encoding is its hash input
        (:func:`~dstl_ray.keygroups.hash_input`), so such a key is encoded once."""
        b = self._b
        if type(b._ser) is not TaggedSerializer:
            return [self._kg(k) for k in keys]
        pairs = b.key_hash.groups_and_inputs(keys, b.max_parallelism)
        lo, hi, ser = b.key_group_range.start, b.key_group_range.end, b._ser.serialize
        out: list[tuple[int, bytes]] = []
        for key, pair in zip(keys, pairs, strict=True):
            if not lo <= pair[0] <= hi:
                self._kg(key)  # raises, naming the key and the range
            t = type(key)
            out.append(pair if t is int or t is str else (pair[0], ser(key)))
        return out

    def values_at(self, refs: Sequence[tuple[int, bytes]], default: Any = None) -> list[Any]:
        """:meth:`value` of every key of ``refs``, in order."""
        get, read, sid, de = self._t.get_value, self._read, self._sid, self._vs.deserialize
        ttl, now = self._ttl()
        return [read(get(sid, kg, k), default, ttl, now, de) for kg, k in refs]

    def update_at(self, refs: Sequence[tuple[int, bytes]], values: Sequence[Any]) -> None:
        """:meth:`update` of every key of ``refs`` with the value at the same position (None
        clears the key's value), under one hold of the backend's lock."""
        if len(refs) != len(values):
            raise StateError(f"{len(values)} values for {len(refs)} keys")
        ser = self._vs.serialize
        ttl, now = self._ttl()
        sid, t, step = self._sid, self._t, UPDATE_CHUNK
        with self._b._lock:
            for lo in range(0, len(refs), step):  # the changelog takes a chunk at a time
                ops: list[tuple[int, bytes, bytes | None]] = []  # (kg, key, value; None: clear)
                try:
                    for (kg, k), value in zip(refs[lo:lo + step], values[lo:lo + step],
                                              strict=True):
                        if value is None:
                            ops.append((kg, k, None))
                        elif ttl is None:
                            ops.append((kg, k, ser(value)))
                        else:
                            ops.append((kg, k, stamp(ser(value), now)))
                finally:  # logged, then applied, as per key: also the part before a bad
                    if ops:  # value; a change the log refuses never reaches the table
                        self._b._writer.append_all(encode_value_changes(sid, ops))
                        t.set_values(sid, ops)


class ListState(_State):
    def get(self, key: Any) -> list[Any]:
        kg, k = self._kg(key)
        de = self._vs.deserialize
        items = self._t.get_list(self._sid, kg, k)
        ttl, now = self._ttl()
        if ttl is None:
            return [de(v) for v in items]
        return [de(v[STAMP_SIZE:]) for v in items if alive(v, now, ttl)]  # per element

    def add(self, key: Any, value: Any) -> None:
        kg, k = self._kg(key)
        v = self._stamped(self._vs.serialize(value))
        with self._b._lock:
            self._log(kg, encode(Op.LIST_ADD, self._sid, k, v))
            self._t.add_to_list(self._sid, kg, k, v)

    def update(self, key: Any, values: Sequence[Any]) -> None:
        kg, k = self._kg(key)
        items = [self._stamped(self._vs.serialize(v)) for v in values]
        with self._b._lock:
            self._log(kg, encode(Op.LIST_SET, self._sid, k, join_items(items)))
            self._t.set_list(self._sid, kg, k, items)


class MapState(_State):
    def get(self, key: Any, user_key: Any, default: Any = None) -> Any:
        kg, k = self._kg(key)
        v = self._t.get_map_value(self._sid, kg, k, self._b._ser.serialize(user_key))
        if v is None:
            return default
        ttl, now = self._ttl()
        if ttl is not None:
            if not alive(v, now, ttl):
                return default  # NeverReturnExpired, per entry
            v = v[STAMP_SIZE:]
        return self._vs.deserialize(v)

    def items(self, key: Any) -> dict[Any, Any]:
        kg, k = self._kg(key)
        de, dv = self._b._ser.deserialize, self._vs.deserialize
        m = self._t.get_map(self._sid, kg, k)
        ttl, now = self._ttl()
        if ttl is None:
            return {de(uk): dv(v) for uk, v in m.items()}
        return {de(uk): dv(v[STAMP_SIZE:]) for uk, v in m.items() if alive(v, now, ttl)}

    def scan(self) -> Iterator[tuple[tuple[int, bytes], dict[Any, Any]]]:
        """Every key's map, key group by key group: ``(ref, {user key: value})``, ``ref``
        as :meth:`ref` gives it (live entries only, with a TTL). The table is read one key
        group at a time, so a scan of a large state holds one key group's entries."""
        de, dv = self._b._ser.deserialize, self._vs.deserialize
        ttl, now = self._ttl()
        for kg, k, m in self._t.items(self._sid, self._b.key_group_range):
            if ttl is None:
                yield (kg, k), {de(uk): dv(v) for uk, v in m.items()}
                continue
            live = {de(uk): dv(v[STAMP_SIZE:]) for uk, v in m.items() if alive(v, now, ttl)}
            if live:
                yield (kg, k), live

    def put(self, key: Any, user_key: Any, value: Any) -> None:
        kg, k = self._kg(key)
        uk = self._b._ser.serialize(user_key)
        v = self._stamped(self._vs.serialize(value))
        with self._b._lock:
            self._log(kg, encode(Op.MAP_PUT, self._sid, k, v, uk))
            self._t.put_map_value(self._sid, kg, k, uk, v)

    def remove(self, key: Any, user_key: Any) -> None:
        self.remove_at(self._kg(key), user_key)

    def remove_at(self, ref: tuple[int, bytes], user_key: Any) -> None:
        """:meth:`remove` of the key :meth:`ref` gave ``ref`` (an index kept beside the
        state removes by the key as it was filed)."""
        kg, k = ref
        uk = self._b._ser.serialize(user_key)
        with self._b._lock:
            self._log(kg, encode(Op.MAP_REMOVE, self._sid, k, b"", uk))
            self._t.remove_map_value(self._sid, kg, k, uk)


_STATE_CLASSES = {StateKind.VALUE: ValueState, StateKind.LIST: ListState,
                  StateKind.MAP: MapState}
