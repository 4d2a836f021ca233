"""The per-key views of state handed to the operator's update functions: ``state.value(name)``,
``state.list(name)`` and ``state.map(name)`` of one key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dstl_ray.errors import ConfigError
from dstl_ray.state.backend import ChangelogKeyedStateBackend
from dstl_ray.state.ttl import StateTtlConfig

from .timers import TIMERS_STATE, KeyTimers, TimerContext


class ValueView:
    """ValueState of the current key."""

    def __init__(self, state: Any, key: Any) -> None:
        self._s, self._k = state, key

    def get(self, default: Any = None) -> Any:
        return self._s.value(self._k, default)

    def set(self, value: Any) -> None:
        self._s.update(self._k, value)

    def clear(self) -> None:
        self._s.clear(self._k)


class ListView:
    """ListState of the current key."""

    def __init__(self, state: Any, key: Any) -> None:
        self._s, self._k = state, key

    def get(self) -> list[Any]:
        return self._s.get(self._k)

    def add(self, value: Any) -> None:
        self._s.add(self._k, value)

    def update(self, values: list[Any]) -> None:
        self._s.update(self._k, values)

    def clear(self) -> None:
        self._s.clear(self._k)


class MapView:
    """MapState of the current key."""

    def __init__(self, state: Any, key: Any) -> None:
        self._s, self._k = state, key

    def get(self, user_key: Any, default: Any = None) -> Any:
        return self._s.get(self._k, user_key, default)

    def put(self, user_key: Any, value: Any) -> None:
        self._s.put(self._k, user_key, value)

    def remove(self, user_key: Any) -> None:
        self._s.remove(self._k, user_key)

    def items(self) -> dict[Any, Any]:
        return self._s.items(self._k)

    def clear(self) -> None:
        self._s.clear(self._k)


def check_state_name(name: str) -> None:
    """Refuse the state name the operator keeps its timers under."""
    if name == TIMERS_STATE:
        raise ConfigError(f"state name {TIMERS_STATE!r} is the operator's timers; use "
                          f"state.timers")


class KeyedState:
    """The states of one key, handed to the user's update function. A state named in
    ``ttl`` (the operator's ``state_ttl``) expires as :mod:`dstl_ray.state.ttl` says:
    writes refresh it, reads do not, and an expired entry reads as absent. ``timers`` is
    the key's :class:`~spark_glue.timers.KeyTimers` when the operator has an ``on_timer``."""

    def __init__(self, backend: ChangelogKeyedStateBackend, key: Any,
                 ttl: Mapping[str, StateTtlConfig] | None = None,
                 timers: TimerContext | None = None,
                 handles: dict[tuple[type, str], Any] | None = None) -> None:
        self.key = key
        self._b = backend
        self._ttl = ttl or {}
        self._timers = timers
        # the backend's state handles by (view, name), shared by the keys of one batch: a
        # handle is the same for every key, and taking one registers the state each time
        self._handles = {} if handles is None else handles

    def value(self, name: str) -> ValueView:
        return self._named(name, ValueView, self._b.value_state)

    def list(self, name: str) -> ListView:
        return self._named(name, ListView, self._b.list_state)

    def map(self, name: str) -> MapView:
        return self._named(name, MapView, self._b.map_state)

    def _named(self, name: str, view: Any, get: Any) -> Any:
        handle = self._handles.get((view, name))
        if handle is None:
            check_state_name(name)
            handle = self._handles[view, name] = get(name, self._ttl.get(name))
        return view(handle, self.key)

    @property
    def timers(self) -> KeyTimers:
        if self._timers is None:
            raise ConfigError("timers need the operator's on_timer= (the function a timer "
                              "calls when it fires)")
        return KeyTimers(self._timers, self.key)
