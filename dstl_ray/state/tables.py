"""Operations on a keyed state backend's state table as a whole: opening one of the kinds
(:mod:`dstl_ray.state.heap`, :mod:`dstl_ray.state.rocksdb`) and reading every state back as
plain Python objects (tools, tests)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import StateError
from ..keygroups import KeyGroupRange
from .heap import HeapStateTable
from .records import StateKind
from .rocksdb import RocksDBStateTable
from .table import STATE_BACKENDS, StateTable
from .ttl import STAMP_SIZE, alive


def open_table(state_backend: str, key_groups: KeyGroupRange,
               local_dir: str | None, operator: str = "") -> StateTable:
    """A new, empty state table: ``"heap"`` (dicts) or ``"rocksdb"`` (a RocksDB in a working
    directory of its own under ``local_dir``, default the system's temp directory; its
    local recovery copies are ``operator``'s)."""
    if state_backend == "heap":
        return HeapStateTable(local_dir)
    if state_backend == "rocksdb":
        return RocksDBStateTable(key_groups, local_dir, operator)
    raise StateError(f"state_backend must be one of {', '.join(STATE_BACKENDS)}, "
                     f"got {state_backend!r}")


def dump_table(names: Mapping[str, int], kinds: Sequence[StateKind],
               ttls: Sequence[int | None], now: int, table: StateTable,
               key_groups: Sequence[int], deserialize: Callable[[bytes], Any],
               values: Callable[[int], Callable[[bytes], Any]] | None = None
               ) -> dict[str, dict[Any, Any]]:
    """Every state of ``table`` as plain Python objects: {state name: {key: value}}; entries
    of TTL states expired at ``now`` (ms) are left out, the others lose their stamps. Keys
    and map keys are decoded by ``deserialize``, values by ``values(state id)`` (a typed
    state's own decoder; default ``deserialize``)."""
    out: dict[str, dict[Any, Any]] = {}
    for name, sid in names.items():
        dk = deserialize
        de = values(sid) if values is not None else deserialize
        kind, ttl, d = kinds[sid], ttls[sid], {}
        for _kg, k, v in table.items(sid, key_groups):
            if ttl is not None:
                if kind is StateKind.VALUE:
                    if not alive(v, now, ttl):
                        continue
                    v = v[STAMP_SIZE:]
                elif kind is StateKind.LIST:
                    v = [x[STAMP_SIZE:] for x in v if alive(x, now, ttl)]
                else:
                    v = {uk: x[STAMP_SIZE:] for uk, x in v.items() if alive(x, now, ttl)}
                if not v and kind is not StateKind.VALUE:
                    continue
            if kind is StateKind.VALUE:
                d[dk(k)] = de(v)
            elif kind is StateKind.LIST:
                d[dk(k)] = [de(x) for x in v]
            else:
                d[dk(k)] = {dk(uk): de(x) for uk, x in v.items()}
        out[name] = d
    return out
