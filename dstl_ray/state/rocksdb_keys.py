"""The key layout of the ``rocksdb`` state table (:mod:`dstl_ray.state.rocksdb`), all
integers big-endian::

    u16 key group | u16 state id | u32 key length | key [| user key]   (user key: MapState)

so every key group is one contiguous range of the database, and so is a key-group range
(restore and rescale read and drop key groups by range). Values: ValueState the value;
ListState the items joined as u32-length-prefixed runs (``records.join_items``); MapState
one entry per user key, under the key's prefix.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

from ..keygroups import KeyGroupRange
from .records import StateKind, split_items

_PREFIX = struct.Struct(">HH")
_KLEN = struct.Struct(">I")
MAX_KEY_GROUPS = 1 << 16


def kg_prefix(kg: int, sid: int) -> bytes:
    """The first bytes of every entry of state ``sid`` in key group ``kg``."""
    return _PREFIX.pack(kg, sid)


def entry_key(kg: int, sid: int, key: bytes) -> bytes:
    """The database key of ``key`` (of a value or list; a map's entries extend it)."""
    return _PREFIX.pack(kg, sid) + _KLEN.pack(len(key)) + key


def key_group_bounds(key_groups: KeyGroupRange) -> tuple[bytes, bytes]:
    """``[lower, upper)`` of the database keys of a key-group range (every state)."""
    return _PREFIX.pack(key_groups.start, 0), (key_groups.end + 1).to_bytes(2, "big")


def scan(source: Any, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Entries of ``source`` (database or snapshot) whose key starts with ``prefix``."""
    it = source.iter()
    it.seek(prefix)
    n = len(prefix)
    while it.valid():
        k = it.key()
        if k[:n] != prefix:
            return
        yield k, it.value()
        it.next()


def entries(source: Any, kg: int, sid: int, kind: StateKind
            ) -> Iterator[tuple[bytes, Any]]:
    """``(key, value)`` of state ``sid`` in key group ``kg``, values decoded by kind."""
    cur: bytes | None = None
    m: dict[bytes, bytes] = {}
    for k, v in scan(source, kg_prefix(kg, sid)):
        (klen,) = _KLEN.unpack_from(k, 4)
        key = k[8:8 + klen]
        if kind is StateKind.VALUE:
            yield key, v
        elif kind is StateKind.LIST:
            yield key, split_items(v)
        else:
            if key != cur:
                if cur is not None:
                    yield cur, m
                cur, m = key, {}
            m[k[8 + klen:]] = v
    if cur is not None:
        yield cur, m
