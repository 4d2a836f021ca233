"""Comparisons on a machine whose speed drifts: each system runs once per round, the systems
of a round one after the other (their order reversed every other round, so neither always
runs on the warmer or the later machine), and a ratio between two systems is the median of
the ratios of each round's pair, not one system's median over another's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def round_order(items: Sequence[T], round_index: int) -> list[T]:
    """``items`` in the order round ``round_index`` runs them: as given on even rounds,
    reversed on odd ones."""
    return list(items) if round_index % 2 == 0 else list(reversed(items))


def median_item(items: Sequence[T], value: Callable[[T], float]) -> T:
    """The item whose ``value`` is the median (the lower middle of an even count)."""
    if not items:
        raise ValueError("no items to take a median of")
    return sorted(items, key=value)[(len(items) - 1) // 2]


def paired_ratios(a: dict[int, float], b: dict[int, float]) -> list[float]:
    """Per round that measured both (rounds by index, in order), ``a``'s value over
    ``b``'s."""
    return [a[i] / b[i] for i in sorted(a.keys() & b.keys()) if b[i]]


def median_ratio(a: dict[int, float], b: dict[int, float]) -> dict[str, Any] | None:
    """The median of :func:`paired_ratios` and each round's (None when no round measured
    both)."""
    got = paired_ratios(a, b)
    if not got:
        return None
    return {"median": median_item(got, float), "per_round": got}
