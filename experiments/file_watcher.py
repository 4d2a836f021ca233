"""Every file name created under a directory during an experiment, counted by a poller in a
process of its own: the poller must not take the interpreter lock from the process it
measures (polling every 2 ms in the driver slowed the driver's own checkpoint calls), and
every system compared is watched the same way."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any


def _scan(root: str, seen: set[str]) -> None:
    for dp, _, fs in os.walk(root):
        for f in fs:
            if not f.endswith(".crc"):  # Hadoop checksum side files
                seen.add(os.path.join(dp, f))


def _watch(root: str, interval: float, conn: Any) -> None:
    """The poller process: scan every ``interval`` s; on a request, scan once more and send
    every name seen so far ("stop": then exit)."""
    seen: set[str] = set()
    while True:
        _scan(root, seen)
        if conn.poll(interval):
            msg = conn.recv()
            _scan(root, seen)
            conn.send(sorted(seen))
            if msg == "stop":
                return


class FileWatcher:
    """Every file name seen under ``root`` (polled every ``interval`` s), to count creations,
    not survivors. ``seen`` holds the names after the ``with`` block."""

    def __init__(self, root: Path, interval: float = 0.02) -> None:
        self.root, self.interval = root, interval
        self.seen: set[str] = set()
        ctx = multiprocessing.get_context("spawn")  # no copy of this process's threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_watch, args=(str(root), interval, child), daemon=True)

    def names(self) -> set[str]:
        """Every name seen so far, after one more scan."""
        self._conn.send("names")
        self.seen = set(self._conn.recv())
        return set(self.seen)

    def __enter__(self) -> FileWatcher:
        self._proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.send("stop")
        self.seen = set(self._conn.recv())
        self._proc.join(timeout=30)
