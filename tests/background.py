"""Standalone runs for the test session: experiments that start a Ray cluster (and Spark) of
their own in a subprocess (the chaos harnesses, the demo, the Flink comparison's dstl-ray
side). Their tests only read what the run left behind, so the session starts them at its
beginning, one at a time on a thread, while the tests that need no cluster run in the
foreground; a test that needs a run's result waits for it (or runs it, when the session did
not start it: a test file run on its own).

One run at a time: each starts a Ray cluster of its own, and two of them at once beside the
session's shared cluster would crowd this machine's two cores.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Run:
    """A command to run in the repository's root; ``{out}`` in it is the run's own directory
    (created empty). ``timeout`` is in seconds."""

    name: str
    argv: tuple[str, ...]
    timeout: float = 900.0


@dataclass(frozen=True)
class Finished:
    """What a run left: its process (stdout and stderr captured) and its directory."""

    proc: subprocess.CompletedProcess[str]
    out: Path


class BackgroundRuns:
    """Runs started once per session; :meth:`result` gives each run's :class:`Finished`."""

    def __init__(self, runs: Iterable[Run]) -> None:
        self.runs = {r.name: r for r in runs}
        self._root = Path(tempfile.mkdtemp(prefix="dstl-test-runs-"))
        self._lock = threading.Lock()
        self._done: dict[str, Finished | BaseException] = {}
        self._events: dict[str, threading.Event] = {}
        self._thread: threading.Thread | None = None
        self.seconds: dict[str, float] = {}  # each finished run's wall time

    def start(self, names: list[str]) -> None:
        """Run ``names`` in order on a background thread (names not known are refused)."""
        unknown = [n for n in names if n not in self.runs]
        if unknown:
            raise ValueError(f"no background run named {unknown}; known: {sorted(self.runs)}")
        with self._lock:
            todo = [n for n in names if n not in self._events]
            for n in todo:
                self._events[n] = threading.Event()
        if todo:
            self._thread = threading.Thread(target=self._work, args=(todo,), daemon=True,
                                            name="dstl-test-runs")
            self._thread.start()

    def result(self, name: str) -> Finished:
        """The run ``name`` once it has finished (run here and now if it was never started).
        Re-raises what the run itself raised (a timeout)."""
        with self._lock:
            ev = self._events.get(name)
            if ev is None:
                ev = self._events[name] = threading.Event()
                mine = True
            else:
                mine = False
        if mine:
            self._one(name)
        ev.wait()
        got = self._done[name]
        if isinstance(got, BaseException):
            raise got
        return got

    def wait_idle(self) -> None:
        """Until no run is going (the runs started so far have all finished)."""
        thread = self._thread
        if thread is not None:
            thread.join()

    def close(self) -> None:
        """Remove what the runs wrote (a run still going is left to its timeout)."""
        shutil.rmtree(self._root, ignore_errors=True)

    def _work(self, names: list[str]) -> None:
        for n in names:
            self._one(n)

    def _one(self, name: str) -> None:
        run = self.runs[name]
        out = self._root / name
        out.mkdir(parents=True, exist_ok=True)
        argv = [a.replace("{out}", str(out)) for a in run.argv]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                                  timeout=run.timeout)
            self._done[name] = Finished(proc, out)
        except BaseException as e:  # noqa: BLE001 - handed to the test that reads it
            self._done[name] = e
        finally:
            self.seconds[name] = round(time.monotonic() - t0, 1)
            self._events[name].set()
