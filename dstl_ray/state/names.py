"""The states registered with one keyed state backend: name to state id, and per id its kind,
TTL and declared schema (FLIP-158 "StateBackend": the backend serializes changes, naming states by id).

Ids count up from 0 in registration order; a restore registers the states of the snapshots
it reads first, so restored and later states share ids. The spec of the registered states
(:data:`~dstl_ray.format.materialized.StatesSpec`, ordered by id) travels in every snapshot
component, so a reader can map the ids of the log that wrote a record back to names.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import StateError
from ..format.materialized import DROPPED, StateSpec, StatesSpec
from .records import Serializer, StateKind
from .ttl import check_ttl_change

MAX_STATES = 65535  # state ids are u16 in records


class StateNames:
    """Name -> id, and per id the kind, the TTL in ms (None: none) and the declared schema
    (canonical DDL; None: untyped, :data:`DROPPED`: a dropped state's place). ``on_new`` is
    told of every new state's kind (the state table adds it)."""

    def __init__(self, on_new: Callable[[StateKind], None]) -> None:
        self._on_new = on_new
        self.names: dict[str, int] = {}
        self.kinds: list[StateKind] = []
        self.ttls: list[int | None] = []
        self.schemas: list[str | None] = []
        self._by_sid: list[str] = []
        self._tombstones: dict[str, int] = {}  # a dropped name -> the id it left
        self._serializers: dict[int, Serializer] = {}
        # ids whose TTL this run's get_state gave (a restored spec's may be outdated)
        self.confirmed: set[int] = set()

    def _add(self, name: str, kind: StateKind, ttl_ms: int | None, schema: str | None) -> int:
        if len(self.kinds) >= MAX_STATES:
            raise StateError(f"too many states (at most {MAX_STATES})")
        self._on_new(kind)
        sid = len(self.kinds)
        self.kinds.append(kind)
        self.ttls.append(ttl_ms)
        self.schemas.append(schema)
        self._by_sid.append(name)
        return sid

    def register(self, name: str, kind: StateKind, ttl_ms: int | None = None,
                 schema: str | None = None) -> int:
        """The id of state ``name``, registering it if new (with ``schema``; a restore
        registers each snapshot's states so). Whether its values carry TTL timestamps
        cannot change (Flink refuses to restore a state with TTL enabled or disabled the
        other way); a new TTL duration applies from now on. ``schema`` :data:`DROPPED`
        registers a dropped state's place (one per name)."""
        if schema == DROPPED:
            sid = self._tombstones.get(name)
            if sid is None:
                sid = self._tombstones[name] = self._add(name, kind, None, DROPPED)
            return sid
        sid = self.names.get(name)
        if sid is None:
            sid = self.names[name] = self._add(name, kind, ttl_ms, schema)
        elif self.kinds[sid] is not kind:
            raise StateError(f"state {name!r} is a {self.kinds[sid].value} state, not "
                             f"{kind.value}")
        else:
            self.ttls[sid] = check_ttl_change(name, self.ttls[sid], ttl_ms)
        return sid

    def register_restored(self, name: str, kind: StateKind, ttl_ms: int | None,
                          schema: str | None) -> int:
        """:meth:`register` for a state of a restored snapshot: snapshots that disagree on
        its schema cannot be restored together."""
        known = name in self.names and schema != DROPPED
        sid = self.register(name, kind, ttl_ms, schema)
        if known and self.schemas[sid] != schema:
            raise StateError(f"state {name!r} has the schema {self.schemas[sid] or 'untyped'} "
                             f"in one restored snapshot and {schema or 'untyped'} in another")
        return sid

    def confirm(self, name: str, kind: StateKind, ttl_ms: int | None,
                schema: str | None = None) -> int:
        """:meth:`register` for a state this run asks for: its TTL is now the one that
        counts (entries it expires may be purged). A new state takes ``schema``; a known
        one keeps its own (the backend migrates it, :meth:`retype`)."""
        sid = self.register(name, kind, ttl_ms, schema)
        self.confirmed.add(sid)
        return sid

    def retype(self, sid: int, schema: str | None) -> None:
        """State ``sid``'s values are now encoded by ``schema`` (None: untyped)."""
        self.schemas[sid] = schema
        self._serializers.pop(sid, None)

    def drop(self, name: str) -> int | None:
        """Forget state ``name``: its id stays taken, as a dropped state's place, and a
        name no state has gets such a place too (the drop is recorded either way). Returns
        the id of the state dropped, or None if there was none."""
        sid = self.names.pop(name, None)
        if sid is None:
            if name not in self._tombstones:
                self._tombstones[name] = self._add(name, StateKind.VALUE, None, DROPPED)
            return None
        self.schemas[sid] = DROPPED
        self.ttls[sid] = None
        self._serializers.pop(sid, None)
        self._tombstones[name] = sid
        self.confirmed.discard(sid)
        return sid

    def serializer(self, sid: int, untyped: Serializer) -> Serializer:
        """How state ``sid``'s values are encoded: by its schema, else ``untyped``. A
        dropped state has none (a handle taken before the drop fails)."""
        ser = self._serializers.get(sid)
        if ser is None:
            schema = self.schemas[sid]
            if schema == DROPPED:
                raise StateError(f"state {self._by_sid[sid]!r} was dropped (ask for the "
                                 f"state again for a new, empty one)")
            if schema is None:
                ser = untyped
            else:
                from .typed import serializer_for  # (pyarrow: only where types are declared)

                ser = serializer_for(schema)
            self._serializers[sid] = ser
        return ser

    def dropped(self, name: str) -> bool:
        """Whether ``name`` has a dropped state's place (a drop this lineage made)."""
        return name in self._tombstones

    def spec(self) -> StatesSpec:
        """``(name, kind)``, ``(name, kind, ttl ms)`` or ``(name, kind, ttl ms or None,
        schema)`` per id, in id order."""
        out: list[StateSpec] = []
        for sid, name in enumerate(self._by_sid):
            kind, ttl, schema = self.kinds[sid].value, self.ttls[sid], self.schemas[sid]
            if schema is not None:
                out.append((name, kind, ttl, schema))
            elif ttl is not None:
                out.append((name, kind, ttl))
            else:
                out.append((name, kind))
        return tuple(out)

    def confirmed_ttls(self) -> list[int | None]:
        """Per id the TTL to purge by: None for states without one or not yet confirmed."""
        return [t if sid in self.confirmed else None for sid, t in enumerate(self.ttls)]
