"""State time-to-live (Flink's ``StateTtlConfig``), per state descriptor.

Semantics are Flink's with ``UpdateType.OnCreateAndWrite``,
``StateVisibility.NeverReturnExpired`` and ``TtlTimeCharacteristic.ProcessingTime``:

* Every write (a value update, a list add or update, a map put) stamps what it writes with
  the processing time of the write; reads never refresh the stamp.
* An entry is expired once ``stamp + ttl <= now`` (Flink's ``TtlUtils.expired``); a read of
  an expired entry behaves as if it were absent.
* Collections expire per entry, as in Flink: every list element and every map entry carries
  its own stamp, so adding to a list does not prolong its older elements.
* Cleanup (Flink's ``cleanupFullSnapshot``, done here on every full copy): expired entries are
  dropped when state is materialized or saved (they never reach a ``.dstm`` file, and the live
  tables lose them at the same instant, so the materialized base plus the changelog after it
  still equals the live state) and when state is restored (from a materialized file or a
  changelog). Between those, an expired entry stays in memory but is never returned.

Stored form: the serialized value of a TTL state is prefixed with the stamp, a u64
little-endian count of milliseconds since the epoch (Flink keeps ``TtlValue(value,
lastAccessTimestamp)`` the same way). Records and files keep their layout; whether a state's
values carry stamps is part of the state's spec in the snapshot handles (``[name, kind,
{"ttl_ms": n}]``), so states without TTL write exactly the bytes they wrote before.

The clock is wall-clock time (``time.time`` by default) because stamps outlive the process;
backends take it as a parameter so tests are deterministic. A restore on a machine whose clock
is far behind the writer's keeps entries the writer already considered expired, as in Flink.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError, StateError

STAMP = struct.Struct("<Q")
STAMP_SIZE = STAMP.size
_unpack = STAMP.unpack_from
_pack = STAMP.pack


class UpdateType(enum.StrEnum):
    """When an entry's stamp is refreshed (Flink's ``StateTtlConfig.UpdateType``)."""

    ON_CREATE_AND_WRITE = "OnCreateAndWrite"


class StateVisibility(enum.StrEnum):
    """Whether an expired, not yet cleaned up entry may be read (Flink's
    ``StateTtlConfig.StateVisibility``)."""

    NEVER_RETURN_EXPIRED = "NeverReturnExpired"


MAX_TTL_MS = 1 << 63  # exclusive: the metadata parser takes ttl_ms < 2**63


@dataclass(frozen=True)
class StateTtlConfig:
    """Time-to-live of the entries of one state (Flink's ``StateTtlConfig``): ``ttl`` seconds
    of processing time after the entry's last write. Only Flink's default update type and
    visibility are offered; anything else is refused with :class:`StateError`."""

    ttl: float
    update_type: UpdateType = UpdateType.ON_CREATE_AND_WRITE
    state_visibility: StateVisibility = StateVisibility.NEVER_RETURN_EXPIRED

    def __post_init__(self) -> None:
        t = self.ttl
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                or t * 1000 < 1 or round(t * 1000) >= MAX_TTL_MS:
            raise StateError(f"state TTL must be a finite number of seconds from 0.001 to "
                             f"{MAX_TTL_MS // 1000} (checkpoint metadata stores it as a "
                             f"signed 64-bit number of ms), got {t!r}")
        try:
            object.__setattr__(self, "update_type", UpdateType(self.update_type))
            object.__setattr__(self, "state_visibility",
                               StateVisibility(self.state_visibility))
        except ValueError as e:
            raise StateError(f"unsupported state TTL option: {e}; supported: update type "
                             f"OnCreateAndWrite, visibility NeverReturnExpired") from None

    @property
    def ttl_ms(self) -> int:
        return int(round(self.ttl * 1000))

    @classmethod
    def of(cls, ttl: StateTtlConfig | float | None) -> StateTtlConfig | None:
        """``ttl`` as a config: seconds become one, None stays None."""
        if ttl is None or isinstance(ttl, StateTtlConfig):
            return ttl
        return cls(ttl)


def now_ms(clock_s: float) -> int:
    return int(clock_s * 1000)


def stamp(value: bytes, now: int) -> bytes:
    """``value`` as a TTL state stores it: written at ``now`` (ms)."""
    return _pack(now) + value


def alive(stored: bytes, now: int, ttl_ms: int) -> bool:
    """Whether a stamped value is still live at ``now`` (Flink: expired iff stamp + ttl <=
    now)."""
    return _unpack(stored)[0] + ttl_ms > now


def unstamp(stored: bytes) -> bytes:
    return stored[STAMP_SIZE:]


def check_stamped(stored: bytes) -> None:
    if len(stored) < STAMP_SIZE:
        raise FormatError(f"TTL state value of {len(stored)} bytes lacks its "
                          f"{STAMP_SIZE}-byte timestamp")


def purge_expired(tables: list[dict[int, dict[bytes, Any]]], kinds: Sequence[str],
                  ttls: Sequence[int | None], now: int) -> int:
    """Drop every entry of a TTL state expired at ``now`` from ``tables``: values, list
    elements, map entries; keys left empty go too. Returns how many entries went.

    Never changes a list, a map or a key group's dict in place: it puts new ones in their
    place (the caller holds the backend's lock, as writers do), because the task thread reads
    without the lock, and a list shortened under its iterator skips live elements, a dict
    shrunk under it raises. Raises :class:`~dstl_ray.errors.FormatError` on a stored value
    too short for a stamp (a spec that does not fit its file)."""
    dropped = 0
    for sid, ttl in enumerate(ttls):
        if ttl is None:
            continue
        kind = kinds[sid]

        def alive(x: bytes, ttl: int = ttl) -> bool:
            check_stamped(x)
            return _unpack(x)[0] + ttl > now

        for kg, d in list(tables[sid].items()):
            changed = False
            nd: dict[bytes, Any] = {}
            for key, v in d.items():
                if kind == "value":
                    kept: Any = v if alive(v) else None
                    gone = int(kept is None)
                elif kind == "list":
                    kept = [x for x in v if alive(x)]  # a new list
                    gone = len(v) - len(kept)
                else:
                    kept = {uk: x for uk, x in v.items() if alive(x)}  # a new dict
                    gone = len(v) - len(kept)
                if not gone:
                    nd[key] = v
                    continue
                dropped += gone
                changed = True
                if kept:
                    nd[key] = kept
            if changed:
                tables[sid][kg] = nd  # (an existing key: the outer dict keeps its size)
    return dropped


def check_ttl_change(name: str, had: int | None, want: int | None) -> int | None:
    """The TTL (ms) state ``name`` goes on with when its TTL was ``had`` and a descriptor
    asks for ``want``: a new duration applies from now on (Flink keeps the TTL out of
    snapshots), but turning TTL on or off is refused, as Flink refuses it: stored values
    carry timestamps or they do not."""
    if (had is None) != (want is None):
        was, now = ("with", "without") if had is not None else ("without", "with")
        raise StateError(f"state {name!r} was written {was} a TTL and cannot be used {now} "
                         f"one (its stored values {'carry' if had else 'lack'} timestamps); "
                         f"use a new state name")
    return want


def spec_ttl(spec: Sequence[Any]) -> int | None:
    """The TTL (ms) of one entry of a component's state spec: ``(name, kind)`` has none,
    ``(name, kind, ttl_ms)`` has one."""
    return spec[2] if len(spec) > 2 else None
