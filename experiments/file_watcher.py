"""Every file name created under a directory during an experiment, seen by a watcher in a
process of its own: the watcher must not take the interpreter lock from the process it
measures (polling every 2 ms in the driver slowed the driver's own checkpoint calls), and
every system compared is watched the same way.

On Linux the watcher listens to inotify (``IN_CREATE`` / ``IN_MOVED_TO`` on every directory
of the tree, new ones included): it sees every name ever created, however short-lived (a
temp file renamed within a millisecond), and costs nothing between events, so it takes no
CPU from the systems it measures on a small machine. Elsewhere, or when inotify is not
available, it polls (every ``interval`` s), which sees only the names that live long
enough: a lower bound."""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import select
import struct
from pathlib import Path
from typing import Any

IN_MOVED_TO, IN_CREATE, IN_Q_OVERFLOW, IN_ISDIR = 0x80, 0x100, 0x4000, 0x40000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)


def _scan(root: str, seen: set[str]) -> None:
    for dp, _, fs in os.walk(root):
        for f in fs:
            if not f.endswith(".crc"):  # Hadoop checksum side files
                seen.add(os.path.join(dp, f))


class _Inotify:
    """A recursive inotify watch of ``root``: :meth:`read` adds the names created since."""

    def __init__(self, root: str, seen: set[str]) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._add = libc.inotify_add_watch
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.dirs: dict[int, str] = {}
        self.seen = seen
        self.watch_tree(root)

    def watch_tree(self, top: str) -> None:
        """Watch ``top`` and every directory under it, then list them: a name created before
        its directory's watch was in place is seen by the listing."""
        for dp, _, _ in os.walk(top):
            wd = self._add(self.fd, dp.encode(), IN_CREATE | IN_MOVED_TO)
            if wd >= 0:
                self.dirs[wd] = dp
        _scan(top, self.seen)

    def read(self) -> None:
        try:
            data = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return
        i = 0
        while i + _EVENT.size <= len(data):
            wd, mask, _, n = _EVENT.unpack_from(data, i)
            name = data[i + _EVENT.size:i + _EVENT.size + n].rstrip(b"\0").decode()
            i += _EVENT.size + n
            if mask & IN_Q_OVERFLOW:  # events were dropped: list everything
                for d in list(self.dirs.values()):
                    self.watch_tree(d)
                continue
            parent = self.dirs.get(wd)
            if parent is None or not name:
                continue
            path = os.path.join(parent, name)
            if mask & IN_ISDIR:
                self.watch_tree(path)
            elif not name.endswith(".crc"):
                self.seen.add(path)


def _watch(root: str, interval: float, conn: Any) -> None:
    """The watcher process: follow inotify events (or scan every ``interval`` s); on a
    request, take in what is pending, scan once more and send every name seen so far
    ("stop": then exit)."""
    seen: set[str] = set()
    os.makedirs(root, exist_ok=True)
    try:
        ino: _Inotify | None = _Inotify(root, seen)
    except (OSError, AttributeError):  # not Linux, or no inotify: poll
        ino = None
    while True:
        if ino is not None:
            ready, _, _ = select.select([ino.fd, conn], [], [])
            if ino.fd in ready:
                ino.read()
            if conn not in ready:
                continue
        else:
            _scan(root, seen)
            if not conn.poll(interval):
                continue
        msg = conn.recv()
        if ino is not None:
            ino.read()
        _scan(root, seen)
        conn.send(sorted(seen))
        if msg == "stop":
            return


class FileWatcher:
    """Every file name created under ``root`` (inotify; else polled every ``interval`` s), to
    count creations, not survivors. ``seen`` holds the names after the ``with`` block."""

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
        self._conn.send("names")  # returns once the watches are in place
        self._conn.recv()
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.send("stop")
        self.seen = set(self._conn.recv())
        self._proc.join(timeout=30)
