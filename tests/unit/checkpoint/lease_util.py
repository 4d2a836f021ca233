"""Helpers for the job lease's tests: one real time for every simulated process, each with its
own monotonic clock, and storage wrappers whose writes are slow or run another driver first
(real files underneath)."""

from __future__ import annotations

from collections.abc import Callable


class World:
    """Real time ``t`` for every process of a test; :meth:`clock` is one process's monotonic
    clock (its own arbitrary origin), :meth:`sleep` lets time pass and runs what the test
    scheduled meanwhile (another driver's renewals)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.events: list[tuple[float, object]] = []

    def clock(self, offset: float = 0.0):
        return lambda: offset + self.t

    def at(self, when: float, fn) -> None:
        self.events.append((when, fn))
        self.events.sort(key=lambda e: e[0])

    def sleep(self, dt: float) -> None:
        end = self.t + dt
        while self.events and self.events[0][0] <= end:
            when, fn = self.events.pop(0)
            self.t = max(self.t, when)
            fn()
        self.t = end


class SlowWrites:
    """A storage whose writes take ``delay`` seconds of the world's time once armed."""

    def __init__(self, inner, world: World) -> None:
        self.inner = inner
        self.world = world
        self.delay = 0.0

    def write_file(self, url: str, data: bytes) -> None:
        self.world.t += self.delay
        self.inner.write_file(url, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Hooked:
    """A storage whose next write or create of a URL starting with a hooked prefix first runs
    the hook (another driver acting while this one's write is on its way). ``atomic=False``:
    a store without create-if-absent (``create_file`` None, as on some fsspec stores)."""

    def __init__(self, inner, atomic: bool = True) -> None:
        self.inner = inner
        self.hooks: list[tuple[str, Callable[[], object]]] = []
        if not atomic:
            self.create_file = None

    def hook(self, prefix: str, fn: Callable[[], object]) -> None:
        self.hooks.append((prefix, fn))

    def _before(self, url: str) -> None:
        for i, (prefix, fn) in enumerate(self.hooks):
            if url.startswith(prefix):
                del self.hooks[i]
                fn()
                return

    def write_file(self, url: str, data: bytes) -> None:
        self._before(url)
        self.inner.write_file(url, data)

    def create_file(self, url: str, data: bytes) -> bool:
        self._before(url)
        return self.inner.create_file(url, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)

