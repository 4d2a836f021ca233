"""Key groups: the unit of state redistribution (Flink's KeyGroupRangeAssignment).

A key belongs to key group ``stable_hash(key) % max_parallelism``; a subtask owns a contiguous
:class:`KeyGroupRange`. The hash must be stable across processes and runs, so Python's salted
``hash()`` is never used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
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


def stable_hash(key: object) -> int:
    """A 64-bit hash of ``key`` that is the same in every process and run.

    ``bytes`` hash as-is, ``str`` as UTF-8, ``int`` by its decimal text, anything else by
    ``repr`` (so tuples of those work too).
    """
    if isinstance(key, bytes):
        data = key
    elif isinstance(key, str):
        data = b"s" + key.encode("utf-8")
    elif isinstance(key, bool):
        data = b"b" + (b"1" if key else b"0")
    elif isinstance(key, int):
        data = b"i" + str(key).encode("ascii")
    else:
        data = b"r" + repr(key).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def assign_key_group(key: object, max_parallelism: int) -> int:
    """The key group of ``key``: ``stable_hash(key) % max_parallelism``."""
    return stable_hash(key) % max_parallelism


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
