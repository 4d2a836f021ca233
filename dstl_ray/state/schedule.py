"""When a backend materializes (FLIP-158 "Materializing state changes" runs on a schedule of
its own, not only when a checkpoint asks; Flink's ``PeriodicMaterializationManager``): the
interval, the time the last one started, and optionally a timer thread that starts one
whenever the interval has passed. The clock is injected (tests drive it)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..errors import DstlError

log = logging.getLogger(__name__)


class MaterializationSchedule:
    """``interval()`` seconds between materializations (None: only when asked; read at each
    check, so the owner may change it)."""

    def __init__(self, interval: Callable[[], float | None], clock: Callable[[], float]
                 ) -> None:
        self._interval = interval
        self._clock = clock
        self.last_start = clock()
        self.stop = threading.Event()  # ends the timer thread (set when the backend closes)

    def due(self) -> bool:
        interval = self._interval()
        return interval is not None and self._clock() - self.last_start >= interval

    def started(self) -> None:
        """A materialization starts now."""
        self.last_start = self._clock()

    def run_in_background(self, maybe_materialize: Callable[[], Any], name: str) -> None:
        """A daemon thread that calls ``maybe_materialize`` a few times per interval (at
        most every second) until :attr:`stop` is set; a failed start is retried at the next
        tick."""
        interval = self._interval()
        if interval is None:
            return
        tick = max(0.01, min(1.0, interval / 4))

        def loop() -> None:
            while not self.stop.wait(tick):
                try:
                    maybe_materialize()
                except DstlError as e:
                    log.warning("periodic materialization (%s): %s", name, e)

        threading.Thread(target=loop, daemon=True, name=name).start()
