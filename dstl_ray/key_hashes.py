"""Key hashes: how a job's keys become key groups (FLIP-158 leaves that to the keyed backend;
Flink's is ``murmur(key.hashCode()) % max_parallelism``).

Two hashes, each a :class:`KeyHash` named in the job's checkpoint metadata:

- ``blake2b`` (:data:`BLAKE2B`, the default): :func:`dstl_ray.keygroups.stable_hash`, blake2b
  of a key's tagged encoding, for keys of any Python type.
- ``spark-xxhash64:<type>`` (:class:`SparkXxHash64`): Spark SQL's ``xxhash64(key)`` (XXH64,
  seed 42, a signed 64-bit result) of a key column of Spark type ``string``, ``int``,
  ``bigint`` or ``binary``, ``pmod`` max parallelism. Spark's JVM computes it for a row as
  cheaply as Python does for a key, so the Spark operator can route rows in the aggregation's
  own shuffle instead of in a Python pass over every row (``spark_glue.jvm_route``).

A key's group must never change while its state lives: a checkpoint's metadata names its hash
(none named: ``blake2b``, what every version before this one wrote), and a job restores only a
checkpoint of its own hash (under another, a key would be looked up in another key group and
its state would seem gone).
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .errors import ConfigError, KeyGroupError
from .keygroups import (
    KeyGroupCache,
    assign_key_group,
    assign_key_groups,
    hash_input,
    key_group_and_input,
)

SPARK_PREFIX = "spark-xxhash64:"
SPARK_SEED = 42  # Spark's hash expressions' seed
SPARK_KEY_TYPES = ("string", "int", "bigint", "binary")


class KeyHash(Protocol):
    """A key's key group under one hash (``name`` is what checkpoint metadata records)."""

    name: str

    def key_group(self, key: object, max_parallelism: int) -> int:
        """The key group of ``key``, in ``0..max_parallelism - 1``."""
        ...

    def key_groups(self, keys: Sequence[object], max_parallelism: int) -> list[int]:
        """:meth:`key_group` of every key, in order."""
        ...

    def group_and_input(self, key: object, max_parallelism: int) -> tuple[int, bytes]:
        """:meth:`groups_and_inputs` of one key (every per-key state access asks)."""
        ...

    def groups_and_inputs(self, keys: Iterable[object], max_parallelism: int
                          ) -> list[tuple[int, bytes]]:
        """``(key group, tagged encoding)`` of every key (the encoding is
        :func:`~dstl_ray.keygroups.hash_input`, which for ``int`` and ``str`` keys is also
        the state table's key encoding)."""
        ...


@dataclass(frozen=True)
class Blake2bKeyHash:
    """``stable_hash(key) % max_parallelism`` (:mod:`dstl_ray.keygroups`)."""

    name: str = "blake2b"

    def key_group(self, key: object, max_parallelism: int) -> int:
        return assign_key_group(key, max_parallelism)

    def key_groups(self, keys: Sequence[object], max_parallelism: int) -> list[int]:
        return KeyGroupCache.of(max_parallelism).key_groups(keys)

    def group_and_input(self, key: object, max_parallelism: int) -> tuple[int, bytes]:
        return key_group_and_input(key, max_parallelism)

    def groups_and_inputs(self, keys: Iterable[object], max_parallelism: int
                          ) -> list[tuple[int, bytes]]:
        return assign_key_groups(keys, max_parallelism)


BLAKE2B = Blake2bKeyHash()


@dataclass(frozen=True)
class SparkXxHash64:
    """``pmod(xxhash64(key), max_parallelism)`` as Spark SQL computes it for a key column of
    Spark type ``key_type``: the hashed bytes are a string's UTF-8, an ``int``'s 4 and a
    ``bigint``'s 8 little-endian bytes, a ``binary``'s own; a null key (None) hashes to the
    seed, as in Spark. A key of another Python type
    than the column's (a ``str`` under ``int``, a ``bool`` anywhere) is a
    :class:`~dstl_ray.errors.KeyGroupError`: it could not have come from the column."""

    key_type: str

    def __post_init__(self) -> None:
        if self.key_type not in SPARK_KEY_TYPES:
            raise KeyGroupError(f"a Spark key hash takes a key column of type "
                                f"{' / '.join(SPARK_KEY_TYPES)}, got {self.key_type!r}")
        try:
            import xxhash
        except ImportError as e:  # a dependency of the package: a broken install
            from .errors import MissingDependencyError

            raise MissingDependencyError(f"the key hash {self.name} needs the xxhash package "
                                         f"(pip install xxhash)") from e
        object.__setattr__(self, "_digest", xxhash.xxh64_intdigest)

    @property
    def name(self) -> str:  # type: ignore[override]
        return SPARK_PREFIX + self.key_type

    def hashed_bytes(self, key: object) -> bytes:
        """The bytes Spark's ``xxhash64`` reads for ``key`` in a column of :attr:`key_type`."""
        t = self.key_type
        try:
            if t == "string" and isinstance(key, str):
                return key.encode("utf-8")
            if t in ("int", "bigint") and not isinstance(key, bool | str | bytes):
                return struct.pack("<i" if t == "int" else "<q", operator.index(key))
            if t == "binary" and isinstance(key, bytes | bytearray):
                return bytes(key)
        except (TypeError, struct.error):
            pass
        raise KeyGroupError(f"key {key!r} ({type(key).__name__}) cannot be a value of a "
                            f"Spark {t} key column, which the key hash {self.name} hashes")

    def key_group(self, key: object, max_parallelism: int) -> int:
        if key is None:  # Spark's hash of a null is its seed, in every column type
            return SPARK_SEED % max_parallelism
        h = self._digest(self.hashed_bytes(key), SPARK_SEED)  # type: ignore[attr-defined]
        # Spark's pmod of the signed 64-bit hash; Python's % of a positive modulus is that
        return (h - (1 << 64) if h >= 1 << 63 else h) % max_parallelism

    def key_groups(self, keys: Sequence[object], max_parallelism: int) -> list[int]:
        return [self.key_group(k, max_parallelism) for k in keys]

    def group_and_input(self, key: object, max_parallelism: int) -> tuple[int, bytes]:
        return self.key_group(key, max_parallelism), hash_input(key)

    def groups_and_inputs(self, keys: Iterable[object], max_parallelism: int
                          ) -> list[tuple[int, bytes]]:
        return [self.group_and_input(k, max_parallelism) for k in keys]


def key_hash_named(name: object) -> KeyHash:
    """The :class:`KeyHash` a checkpoint's metadata names (``None``: ``blake2b``, what
    metadata written before key hashes were named means)."""
    if name is None or name == BLAKE2B.name:
        return BLAKE2B
    if isinstance(name, str) and name.startswith(SPARK_PREFIX):
        return SparkXxHash64(name[len(SPARK_PREFIX):])
    raise KeyGroupError(f"unknown key hash {name!r}: expected {BLAKE2B.name!r} or "
                        f"{SPARK_PREFIX}<{'|'.join(SPARK_KEY_TYPES)}>")


def joined_key_hash(backends: Iterable[object], joining: object) -> str:
    """The name of ``joining``'s key hash (a backend's, ``key_hash``: blake2b if it has
    none), which a checkpoint of it and ``backends`` records: a
    :class:`~dstl_ray.errors.ConfigError` if one of ``backends`` files keys by another."""
    name = getattr(joining, "key_hash", BLAKE2B).name
    other = {getattr(b, "key_hash", BLAKE2B).name for b in backends} - {name}
    if other:
        raise ConfigError(f"a backend filing keys by the key hash {name} cannot join backends "
                          f"of {', '.join(sorted(other))}: their checkpoint names one hash")
    return name


def spark_key_hash(spark_type: str) -> KeyHash:
    """The key hash of a new job keyed by a column of Spark type ``spark_type`` (its
    ``simpleString``): :class:`SparkXxHash64` for the types it takes, :data:`BLAKE2B` for
    the others (a double, a date or a struct key is still routed in Python)."""
    return SparkXxHash64(spark_type) if spark_type in SPARK_KEY_TYPES else BLAKE2B
