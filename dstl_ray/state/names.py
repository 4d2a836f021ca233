"""The states registered with one keyed state backend: name to state id, and per id its kind
and TTL (FLIP-158 "StateBackend": the backend serializes changes, naming states by id).

Ids count up from 0 in registration order; a restore registers the states of the snapshots
it reads first, so restored and later states share ids. The spec of the registered states
(:data:`~dstl_ray.format.materialized.StatesSpec`, ordered by id) travels in every snapshot
component, so a reader can map the ids of the log that wrote a record back to names.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import StateError
from ..format.materialized import StatesSpec
from .records import StateKind
from .ttl import check_ttl_change

MAX_STATES = 65535  # state ids are u16 in records


class StateNames:
    """Name -> id, and per id the kind and the TTL in ms (None: none). ``on_new`` is told of
    every new state's kind (the state table adds it)."""

    def __init__(self, on_new: Callable[[StateKind], None]) -> None:
        self._on_new = on_new
        self.names: dict[str, int] = {}
        self.kinds: list[StateKind] = []
        self.ttls: list[int | None] = []
        # ids whose TTL this run's get_state gave (a restored spec's may be outdated)
        self.confirmed: set[int] = set()

    def register(self, name: str, kind: StateKind, ttl_ms: int | None = None) -> int:
        """The id of state ``name``, registering it if new. Whether its values carry TTL
        timestamps cannot change (Flink refuses to restore a state with TTL enabled or
        disabled the other way); a new TTL duration applies from now on."""
        sid = self.names.get(name)
        if sid is None:
            if len(self.kinds) >= MAX_STATES:
                raise StateError(f"too many states (at most {MAX_STATES})")
            self._on_new(kind)
            sid = self.names[name] = len(self.kinds)
            self.kinds.append(kind)
            self.ttls.append(ttl_ms)
        elif self.kinds[sid] is not kind:
            raise StateError(f"state {name!r} is a {self.kinds[sid].value} state, not "
                             f"{kind.value}")
        else:
            self.ttls[sid] = check_ttl_change(name, self.ttls[sid], ttl_ms)
        return sid

    def confirm(self, name: str, kind: StateKind, ttl_ms: int | None) -> int:
        """:meth:`register` for a state this run asks for: its TTL is now the one that
        counts (entries it expires may be purged)."""
        sid = self.register(name, kind, ttl_ms)
        self.confirmed.add(sid)
        return sid

    def spec(self) -> StatesSpec:
        """``(name, kind)`` or ``(name, kind, ttl ms)`` per id, in id order."""
        by_sid = sorted(self.names.items(), key=lambda kv: kv[1])
        return tuple((n, self.kinds[sid].value) if self.ttls[sid] is None
                     else (n, self.kinds[sid].value, self.ttls[sid])
                     for n, sid in by_sid)

    def confirmed_ttls(self) -> list[int | None]:
        """Per id the TTL to purge by: None for states without one or not yet confirmed."""
        return [t if sid in self.confirmed else None for sid, t in enumerate(self.ttls)]
