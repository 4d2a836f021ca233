"""Key groups: the unit of state redistribution (Flink's KeyGroupRangeAssignment).

A key belongs to key group ``stable_hash(key) % max_parallelism``; a subtask owns a contiguous
:class:`KeyGroupRange`. The hash must be stable across processes and runs, so Python's salted
``hash()`` is never used.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .errors import KeyGroupError

MAX_KEY_GROUPS = 1 << 15  # Flink's upper bound for max parallelism


@dataclass(frozen=True, order=True)
class KeyGroupRange:
    """Inclusive range ``[start, end]`` of key groups, as in Flink."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not isinstance(self.start, int) or not isinstance(self.end, int):
            raise KeyGroupError(f"KeyGroupRange bounds must be int, got {self.start!r}..{self.end!r}")
        if self.start < 0 or self.end < self.start or self.end >= MAX_KEY_GROUPS:
            raise KeyGroupError(
                f"KeyGroupRange({self.start}, {self.end}) is invalid: need "
                f"0 <= start <= end < {MAX_KEY_GROUPS}"
            )

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    def __len__(self) -> int:
        return self.end - self.start + 1

    def intersect(self, other: KeyGroupRange) -> KeyGroupRange | None:
        lo, hi = max(self.start, other.start), min(self.end, other.end)
        return KeyGroupRange(lo, hi) if lo <= hi else None

    def to_json(self) -> list[int]:
        return [self.start, self.end]

    @classmethod
    def from_json(cls, value: object) -> KeyGroupRange:
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            raise KeyGroupError(f"a key group range must be [start, end], got {value!r}")
        return cls(value[0], value[1])


def hash_input(key: object) -> bytes:
    """The bytes :func:`stable_hash` hashes: ``bytes`` as-is, ``str`` as ``s`` + UTF-8,
    ``int`` as ``i`` + its decimal text, ``bool`` as ``b0``/``b1``, anything else as ``r`` +
    ``repr`` (so tuples of those work too). For ``int`` and ``str`` these are also their
    :class:`~dstl_ray.state.records.TaggedSerializer` encodings, which lets a columnar caller
    encode such a key once (:func:`assign_key_groups`). Exact ``int`` and ``str``, the
    common keys, are looked at first: every state access of the per-key API hashes one."""
    t = type(key)
    if t is int:
        return b"i" + str(key).encode("ascii")
    if t is str:
        return b"s" + key.encode("utf-8")  # type: ignore[attr-defined]
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return b"s" + key.encode("utf-8")
    if isinstance(key, bool):
        return b"b" + (b"1" if key else b"0")
    if isinstance(key, int):
        return b"i" + str(key).encode("ascii")
    return b"r" + repr(key).encode("utf-8")


def _hash_of(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def stable_hash(key: object) -> int:
    """A 64-bit hash of ``key`` that is the same in every process and run (blake2b of
    :func:`hash_input`)."""
    return _hash_of(hash_input(key))


def assign_key_groups(keys: Iterable[object], max_parallelism: int
                      ) -> list[tuple[int, bytes]]:
    """``(key group, hash input)`` of every key, in order: :func:`assign_key_group` for a
    column of keys, each key encoded once (a load of millions of keys spends most of its
    time here)."""
    blake, from_bytes, out = hashlib.blake2b, int.from_bytes, []
    append = out.append
    for key in keys:
        data = hash_input(key)
        append((from_bytes(blake(data, digest_size=8).digest(), "little") % max_parallelism,
                data))
    return out


class KeyGroupCache:
    """Key groups of ``str`` and ``int`` keys remembered by value, for a process that hashes
    the same keys again and again: a Spark Python worker routes each micro-batch's distinct
    keys (spark_glue.routing), and a key space of 100k keys cost ~0.2 s of blake2b per
    batch in the one map task where a lookup costs a tenth. Exact ``str`` and ``int`` keys
    only, in a dict each: ``1``, ``True`` and ``1.0`` are one dict key but hash apart.
    Bounded: a string longer than :attr:`MAX_STR` characters is hashed and not kept, and
    once ``capacity`` keys are held (131k by default: ~30 MB at most) later ones are not
    kept either (threads calling at once may each fill it to the bound: a worker runs one
    task at a time). One cache per max parallelism per process (:meth:`of`); a key's group
    never changes, so nothing is ever invalidated."""

    MAX_STR = 64
    _by_max_parallelism: dict[int, KeyGroupCache] = {}

    def __init__(self, max_parallelism: int, capacity: int = 1 << 17) -> None:
        self.max_parallelism = operator.index(max_parallelism)  # 128.0 would key 0.0s
        self.capacity = capacity
        self._str: dict[str, int] = {}
        self._int: dict[int, int] = {}

    @classmethod
    def of(cls, max_parallelism: int) -> KeyGroupCache:
        max_parallelism = operator.index(max_parallelism)
        got = cls._by_max_parallelism.get(max_parallelism)
        if got is None:
            got = cls._by_max_parallelism[max_parallelism] = cls(max_parallelism)
        return got

    def __len__(self) -> int:
        return len(self._str) + len(self._int)

    def key_groups(self, keys: Iterable[object]) -> list[int]:
        """:func:`assign_key_group` of every key, in order."""
        maxp, strs, ints = self.max_parallelism, self._str, self._int
        room, longest = self.capacity - len(self), self.MAX_STR
        out: list[int] = []
        append = out.append
        for key in keys:
            t = type(key)
            memo = (strs if len(key) <= longest else None) if t is str \
                else ints if t is int else None  # type: ignore[arg-type]
            kg = None if memo is None else memo.get(key)  # type: ignore[call-overload]
            if kg is None:
                kg = stable_hash(key) % maxp
                if memo is not None and room > 0:
                    memo[key] = kg  # type: ignore[index]
                    room -= 1
            append(kg)
        return out


def key_group_and_input(key: object, max_parallelism: int) -> tuple[int, bytes]:
    """``(key group, hash input)`` of one key (:func:`assign_key_groups` of one): for an
    ``int`` or ``str`` key the hash input is also its tagged encoding, so a per-key state
    access encodes such a key once."""
    data = hash_input(key)
    return _hash_of(data) % max_parallelism, data


# keys a memo of the last key may hold: immutable, matched by identity (the same object, so
# the same value and type: 1, True and 1.0 stay three keys)
MEMO_KEY_TYPES = (str, int, bytes)


class _LastKey:
    """The last ``str``/``int``/``bytes`` key :func:`assign_key_group` hashed, with its
    answer: a per-key update reads and writes several states of one key in a row, each
    access asking for the key's group again. Matched by identity (the same immutable
    object, so the same value and type: ``1``, ``True`` and ``1.0`` stay three keys); one
    entry per process, replaced whole (threads read a consistent one)."""

    entry: tuple[object, int, int] | None = None  # key, max parallelism, key group


def assign_key_group(key: object, max_parallelism: int) -> int:
    """The key group of ``key``: ``stable_hash(key) % max_parallelism``."""
    last = _LastKey.entry
    if last is not None and last[0] is key and last[1] == max_parallelism:
        return last[2]
    kg = stable_hash(key) % max_parallelism
    if type(key) in MEMO_KEY_TYPES:
        _LastKey.entry = (key, max_parallelism, kg)
    return kg


def key_group_range_for_subtask(max_parallelism: int, parallelism: int, index: int) -> KeyGroupRange:
    """The key group range owned by subtask ``index`` of ``parallelism`` (Flink's formula)."""
    if not 0 < parallelism <= max_parallelism:
        raise KeyGroupError(
            f"parallelism must be in 1..max_parallelism ({max_parallelism}), got {parallelism}"
        )
    if not 0 <= index < parallelism:
        raise KeyGroupError(f"subtask index must be in 0..{parallelism - 1}, got {index}")
    start = (index * max_parallelism + parallelism - 1) // parallelism
    end = ((index + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange(start, end)
