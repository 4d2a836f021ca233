"""The per-key views of state handed to the operator's update functions: ``state.value(name)``,
``state.list(name)`` and ``state.map(name)`` of one key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dstl_ray.state.backend import ChangelogKeyedStateBackend
from dstl_ray.state.ttl import StateTtlConfig


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


class KeyedState:
    """The states of one key, handed to the user's update function. A state named in
    ``ttl`` (the operator's ``state_ttl``) expires as :mod:`dstl_ray.state.ttl` says:
    writes refresh it, reads do not, and an expired entry reads as absent."""

    def __init__(self, backend: ChangelogKeyedStateBackend, key: Any,
                 ttl: Mapping[str, StateTtlConfig] | None = None) -> None:
        self.key = key
        self._b = backend
        self._ttl = ttl or {}

    def value(self, name: str) -> ValueView:
        return ValueView(self._b.value_state(name, self._ttl.get(name)), self.key)

    def list(self, name: str) -> ListView:
        return ListView(self._b.list_state(name, self._ttl.get(name)), self.key)

    def map(self, name: str) -> MapView:
        return MapView(self._b.map_state(name, self._ttl.get(name)), self.key)
