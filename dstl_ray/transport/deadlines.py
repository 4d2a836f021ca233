"""What a writer process waits for from its node actor, each until a deadline
(docs/architecture.md "Write path" 6, the deadline on the writer's side).

Every persist call (and every mark a handle waits for) has the transport's
``persist_timeout_s``: a node actor that does not answer in time (hung, overloaded, its
upstream stuck) fails the call's requests, and the writers send their changes again with
their next request instead of waiting forever. An entry leaves the table exactly once:
answered (:meth:`Deadlines.pop` finds it, so the answer is in time) or expired
(:meth:`Deadlines.take_expired` took it, so an answer that comes after is late and its
segments are released unused). Pure bookkeeping: the clock is the caller's, and so is the
lock.
"""

from __future__ import annotations

import itertools
from typing import Generic, TypeVar

T = TypeVar("T")


class Deadlines(Generic[T]):
    """Entries waiting for an answer, each with its deadline (``time.monotonic()``). Not
    thread-safe: its owner holds a lock around every use."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[float, T]] = {}
        self._numbers = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, deadline: float, entry: T) -> int:
        """Wait for ``entry`` until ``deadline``; its number, for :meth:`pop`."""
        number = next(self._numbers)
        self._entries[number] = (deadline, entry)
        return number

    def pop(self, number: int) -> T | None:
        """The entry answered now, if still waited for (None: it expired, or was taken)."""
        got = self._entries.pop(number, None)
        return None if got is None else got[1]

    def take_expired(self, now: float) -> list[T]:
        """The entries whose deadline is ``now`` or before, no longer waited for."""
        gone = [n for n, (d, _) in self._entries.items() if d <= now]
        return [self._entries.pop(n)[1] for n in gone]

    def take_all(self) -> list[T]:
        """Every entry, no longer waited for (the transport is closing)."""
        out = [e for _, e in self._entries.values()]
        self._entries.clear()
        return out

    def nearest(self) -> float | None:
        """The earliest deadline (None: nothing is waited for)."""
        return min((d for d, _ in self._entries.values()), default=None)
