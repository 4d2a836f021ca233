"""A driver of one job in a process of its own (:mod:`dstl_ray.testing.lease_driver`), asked
by the lease tests to start, run, report and stop: several race for one job, under
libfaketime (a skewed wall clock), stopped with SIGSTOP (silent but alive) or inside a host
that gets partitioned (``prefix``: ``ip netns exec <namespace>``)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class DriverProcess:
    """``python .../lease_driver.py BASE JOB TTL`` run after ``prefix`` (e.g.
    ``faketime -f +60s``), its stderr in ``logs/driver-NAME-*.log``. Started at once;
    :meth:`ready` waits for its greeting."""

    def __init__(self, base: str, job: str, ttl_s: float, logs: Path, name: str = "real",
                 prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        # run as a file, not with -m: its libfaketime fix must come before dstl_ray's import
        cmd = [*prefix, sys.executable, str(Path(__file__).with_name("lease_driver.py")), base,
               job, str(ttl_s)]
        self.name = name
        self.stderr = logs / f"driver-{name}-{time.monotonic_ns()}.log"
        with open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True,
                                         env={**os.environ, **(env or {})})
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def ready(self, skew_s: float = 0.0) -> DriverProcess:
        """Wait for the greeting; the driver's wall clock must be ``skew_s`` off ours."""
        hello = self.answer()
        skew = hello["wall_clock"] - time.time()
        assert abs(skew - skew_s) < 5, (self.name, skew)
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            return json.loads(self._lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"driver {self.name} did not answer: "
                                 f"{self.stderr.read_text()[-3000:]}") from None

    def ask(self, cmd: str, timeout: float = 60.0) -> dict[str, Any]:
        self.send(cmd)
        return self.answer(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


def until(pred: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``pred`` every 0.1 s until it holds; fail after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


def assert_reads_back(base: str, job: str, state: dict[str, Any]) -> list[Any]:
    """After drivers raced for ``job``: every retained checkpoint loads and names only files
    that exist, and the latest restores to ``state`` (the ``v`` values of the one subtask
    of :mod:`~dstl_ray.testing.lease_driver`). Returns the retained checkpoints."""
    import dstl_ray as d
    from dstl_ray.checkpoint.restore import load_retained
    from dstl_ray.storage.registry import get_storage

    storage = get_storage(base)
    retained, broken = load_retained(f"{base}/{job}", storage)
    assert retained and not broken, broken
    for c in retained:
        missing = [u for u in c.files.values() if not storage.exists(u)]
        assert not missing, (c.checkpoint_id, missing)
    coord = d.CheckpointCoordinator(job, base, max_parallelism=16, retained=1)
    try:
        bs = coord.restore(d.StateChangelogClient(job, transport=d.DirectTransport(job, base)),
                           "op", 1, materialization_interval=None)
        assert bs[0].dump()["v"] == state
    finally:
        coord.shutdown()
    return retained
