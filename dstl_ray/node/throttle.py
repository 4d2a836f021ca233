"""In-flight upload bytes of a node (Flink's ``UploadThrottle``, option
``dstl.dfs.upload.max-in-flight``): batches wait when too many bytes are being written.

docs/architecture.md "Write path" 5.
"""

from __future__ import annotations

import asyncio
import time


class ByteBudget:
    """Bounded in-flight upload bytes (Flink: max-in-flight): acquirers wait when exceeded.
    A single batch larger than the limit is admitted alone, so nothing can deadlock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.waiting = 0
        self.waits = 0  # acquisitions that had to wait (backpressure)
        self.wait_s = 0.0  # total time spent waiting
        self.peak = 0  # most bytes ever in flight
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            self.waiting += 1
            t0 = time.monotonic()
            admit = lambda: self.used == 0 or self.used + n <= self.limit  # noqa: E731
            try:
                if not admit():
                    self.waits += 1
                    await self._cond.wait_for(admit)
            finally:
                self.waiting -= 1
                self.wait_s += time.monotonic() - t0
            self.used += n
            self.peak = max(self.peak, self.used)

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()
