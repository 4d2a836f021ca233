"""State that changes shape between versions of a job: a declared type changed, a state
dropped (Flink's state schema evolution and migration; Spark's schema checks of its state
store).

A backend restored from a checkpoint holds each state's values in the encoding the
checkpoint's spec names. When this run declares another type for a state, every stored
value is rewritten in the table (decoded by the old type, resolved to the new shape,
encoded by the new one, TTL stamps kept); when it drops a state, every entry goes. Neither
is logged: the backend's next snapshot starts from a materialization taken after the change
(:class:`Reshapes`), so no checkpoint mixes the old encoding with the new spec.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import CheckpointError, DstlError, SchemaError
from .names import StateNames
from .records import Serializer, StateKind
from .table import StateTable
from .ttl import STAMP_SIZE, alive

# (dstl_ray.state.schema and .typed import pyarrow: loaded only where types are declared)


def _converter(name: str, old: Serializer, new: Serializer, resolve: Callable[[Any], Any],
               ttl: tuple[int, int] | None, old_ddl: str, new_ddl: str
               ) -> Callable[[bytes], bytes]:
    """Re-encodes one stored value; ``ttl`` (ms, now ms) for a stamped state, whose expired
    entries are kept as they are (never read again, and purged by the materialization the
    change is followed by)."""
    def convert(b: bytes) -> bytes:
        if ttl is not None and not alive(b, ttl[1], ttl[0]):
            return b
        head, body = (b[:STAMP_SIZE], b[STAMP_SIZE:]) if ttl is not None else (b"", b)
        try:
            return head + new.serialize(resolve(old.deserialize(body)))
        except DstlError as e:
            raise SchemaError(f"state {name!r}: a stored value does not convert from "
                              f"{old_ddl} to {new_ddl}: {e}") from None
    return convert


def rewrite(table: StateTable, sid: int, kind: StateKind, key_groups: Sequence[int],
            convert: Callable[[bytes], bytes], write: bool = True) -> int:
    """Pass every stored value of state ``sid`` through ``convert`` (unlogged), one key
    group at a time; returns how many values there were. ``write=False`` only converts (a
    first pass: a value that does not convert fails the change before anything changed)."""
    n = 0
    for kg in key_groups:
        for _kg, k, v in list(table.items(sid, [kg])):
            if kind is StateKind.VALUE:
                new = convert(v)
                if write:
                    table.set_value(sid, kg, k, new)
                n += 1
            elif kind is StateKind.LIST:
                items = [convert(x) for x in v]
                if write:
                    table.set_list(sid, kg, k, items)
                n += len(v)
            else:
                for uk, x in list(v.items()):
                    new = convert(x)
                    if write:
                        table.put_map_value(sid, kg, k, uk, new)
                n += len(v)
    return n


def clear_all(table: StateTable, sid: int, key_groups: Sequence[int]) -> None:
    """Remove every entry of state ``sid`` (unlogged)."""
    for kg in key_groups:
        for _kg, k, _v in list(table.items(sid, [kg])):
            table.clear(sid, kg, k)


class Reshapes:
    """The declared types and dropped states of one backend (its ``schemas``): what this
    run declares, the migrations and drops they cause, and the rule that a snapshot after
    one starts from a materialization taken after it. Works under the backend's ``lock``."""

    def __init__(self, names: StateNames, table: StateTable, key_groups: Sequence[int],
                 untyped: Serializer, lock: Any, now_ms: Callable[[], int]) -> None:
        self._names, self._table, self._kgs, self._untyped = names, table, key_groups, untyped
        self._lock, self._now_ms = lock, now_ms
        # a rewrite failed half-way (a local disk error): values in both encodings, so no
        # snapshot may be taken of this backend (a restore from the checkpoint is clean)
        self.broken: str | None = None
        self.declared: dict[str, str] = {}  # state name -> canonical DDL this run gives
        self.generation = 0  # migrations and drops so far
        self.clean = 0  # the generation the last materialization started after

    def declare(self, schemas: Mapping[str, Any]) -> None:
        """Declare the types of states by name (Spark DDL or pyarrow types): restored states
        of another type are migrated now, or a :class:`SchemaError` names the state and both
        schemas; new ones take theirs when first asked for."""
        from .schema import canonical

        checked = {n: canonical(t, f"state_schema of state {n!r}") for n, t in schemas.items()}
        with self._lock:
            for name, schema in checked.items():
                sid = self._names.names.get(name)
                if sid is not None:
                    self._retype(sid, name, schema)
                self.declared[name] = schema  # (a refused one is not declared)

    def confirm(self, descriptor: Any) -> int:
        """The id of the state a :class:`~dstl_ray.state.records.StateDescriptor` names
        (:meth:`StateNames.confirm`), migrated to its schema (the descriptor's, else the
        declared one) if it holds values of another type. The caller holds the lock."""
        name = descriptor.name
        ttl = descriptor.ttl.ttl_ms if descriptor.ttl is not None else None
        schema = descriptor.schema if descriptor.schema is not None else self.declared.get(name)
        sid = self._names.confirm(name, descriptor.kind, ttl, schema)
        if schema is not None:
            self._retype(sid, name, schema)
        return sid

    def _retype(self, sid: int, name: str, schema: str) -> None:
        old = self._names.schemas[sid]
        if old == schema:  # (every state access of a typed state: first, before imports)
            return
        from .schema import check_evolution, parse_schema, resolver
        from .typed import serializer_for

        if old is not None:
            check_evolution(name, old, schema)
        old_ser = self._names.serializer(sid, self._untyped)
        new_ser = serializer_for(schema)
        resolve = resolver(parse_schema(old), new_ser.type) if old is not None \
            else (lambda v: v)
        ttl = self._names.ttls[sid]
        convert = _converter(name, old_ser, new_ser, resolve,
                             None if ttl is None else (ttl, self._now_ms()),
                             old or "untyped", schema)
        kind = self._names.kinds[sid]
        rewrite(self._table, sid, kind, self._kgs, convert, write=False)  # all convert?
        self._names.retype(sid, schema)
        self.generation += 1  # (from here on the table is no longer what was logged)
        try:
            rewrite(self._table, sid, kind, self._kgs, convert)
        except BaseException as e:
            self.broken = f"the migration of state {name!r} failed half-way: {e}"
            raise

    def drop(self, name: str, once: bool = False) -> bool:
        """Remove state ``name`` and all its entries (False: there is none); the drop is
        recorded in the state's spec either way. ``once``: not if this backend's state
        (restored) records a drop of that name already, so a job restarted with the same
        ``drop_state`` keeps a state of that name created since."""
        with self._lock:
            if once and self._names.dropped(name):
                return False
            sid = self._names.names.get(name)
            self.generation += 1
            if sid is not None:
                clear_all(self._table, sid, self._kgs)
            self._names.drop(name)
            return sid is not None

    def settle(self, materialize: Callable[..., Any], wait: Callable[..., Any]) -> None:
        """Before a snapshot: after a migration or drop (unlogged), materialize until one
        that started after it is done (the changelog before holds the old encoding)."""
        if self.broken:
            raise CheckpointError(f"no snapshot: {self.broken}")
        try:
            for _ in range(10):
                if self.clean >= self.generation:
                    return
                f = materialize(force=True)
                if f is None:
                    wait(timeout=300)  # one started before the change: wait, then again
                else:
                    f.result(timeout=300)
        except concurrent.futures.TimeoutError:
            raise CheckpointError("the materialization after a state's schema changed took "
                                  "over 300 s") from None
        if self.clean < self.generation:
            raise CheckpointError("no materialization completed after a state's schema "
                                  "changed (is the backend closed?)")
