"""Request hedging (FLIP-158 "DFS write latency / Request hedging", after Dean & Barroso,
"The Tail at Scale"): when an upload attempt is slower than a delay, a second attempt of the
same request starts and the first to finish wins.

The delay is fixed (``hedge_delay_s``) or a quantile (``hedge_quantile``) of a sliding window
of recent successful attempt latencies; until the window holds ``hedge_min_samples`` latencies
the fixed delay applies (no hedging if it is 0). Hedging at quantile q sends about 1 - q extra
requests: that is the knob between tail latency and load on the store.
"""

from __future__ import annotations

import bisect
import collections
import threading

from ..config import ChangelogConfig


class LatencyWindow:
    """The last ``size`` latencies (seconds), with quantiles over them; thread-safe."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("window size must be >= 1")
        self._order: collections.deque[float] = collections.deque()
        self._sorted: list[float] = []
        self._size = size
        self._lock = threading.Lock()

    def add(self, latency_s: float) -> None:
        with self._lock:
            self._order.append(latency_s)
            bisect.insort(self._sorted, latency_s)
            if len(self._order) > self._size:
                old = self._order.popleft()
                del self._sorted[bisect.bisect_left(self._sorted, old)]

    def __len__(self) -> int:
        return len(self._order)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (nearest rank), or None while empty."""
        with self._lock:
            if not self._sorted:
                return None
            i = min(len(self._sorted) - 1, max(0, int(q * len(self._sorted))))
            return self._sorted[i]


class HedgePolicy:
    """When to start the hedged attempt of a request."""

    def __init__(self, delay_s: float = 0.0, quantile: float = 0.0, window: int = 1000,
                 min_samples: int = 20) -> None:
        if delay_s < 0 or not 0 <= quantile < 1:
            raise ValueError("hedge delay must be >= 0 and quantile in [0, 1)")
        self.fixed_delay_s = delay_s
        self.quantile = quantile
        self.min_samples = min_samples
        self.latencies = LatencyWindow(window)

    @classmethod
    def from_config(cls, config: ChangelogConfig) -> HedgePolicy:
        return cls(config.hedge_delay_s, config.hedge_quantile, config.hedge_window,
                   config.hedge_min_samples)

    @property
    def enabled(self) -> bool:
        return self.fixed_delay_s > 0 or self.quantile > 0

    def record(self, latency_s: float) -> None:
        """A successful attempt took ``latency_s``."""
        self.latencies.add(latency_s)

    def delay(self) -> float | None:
        """Seconds after an attempt starts before its hedge starts; None: do not hedge."""
        if self.quantile > 0 and len(self.latencies) >= self.min_samples:
            return self.latencies.quantile(self.quantile)
        return self.fixed_delay_s if self.fixed_delay_s > 0 else None
