"""Which process a recorded pid names, told apart from every other process: the machine where
the pid means something (host, boot, pid namespace) and the process's start time.

Dead-process checks use it: a job lease whose holder is gone (:mod:`dstl_ray.checkpoint.lease`)
and the RocksDB working directory of a killed worker (:mod:`dstl_ray.state.rocksdb_local`).
A pid alone is not enough for either:

* Two containers on one host share the host name (and often a mounted temp directory), not
  their pids: pid 4711 of another pid namespace says nothing about this one's pid 4711, so a
  record of another machine is never judged dead from here (it might be deleted while live).
* The kernel reuses pids: a record whose pid now names another process would be taken for
  alive forever (a leak). ``/proc/PID/stat`` field 22, the process's start time in clock ticks
  after boot, tells the recorded process from a later one with the same pid (the boot id in
  the machine makes the ticks comparable).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

HOST = socket.gethostname()


def machine() -> str:
    """Where a pid means this process table: the host, its boot, its pid namespace (two
    containers on one host share a host name, not their pids)."""
    parts = [HOST]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("?")
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append("?")
    return "/".join(parts)


MACHINE = machine()


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists in this pid namespace (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stat(pid: int) -> tuple[str, int] | None:
    """State letter and start time (field 22) of ``/proc/PID/stat``; None: no such process,
    or no readable ``/proc``. The command name (field 2) may hold spaces and parentheses, so
    the fields are counted after its last ``)``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
        rest = text[text.rindex(")") + 2:].split()
        return rest[0], int(rest[19])  # fields 3 (state) and 22 (starttime)
    except (OSError, ValueError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks after boot (None: unknown)."""
    st = _stat(pid)
    return None if st is None else st[1]


@dataclass(frozen=True)
class ProcessId:
    """One process: its machine (:func:`machine`), pid and start time (None: unknown, as
    on a system without ``/proc``; then the pid alone decides)."""

    machine: str
    pid: int
    start: int | None

    @classmethod
    def current(cls) -> ProcessId:
        pid = os.getpid()
        return cls(MACHINE, pid, start_time(pid))

    def to_dict(self) -> dict[str, Any]:
        return {"machine": self.machine, "pid": self.pid, "start": self.start}

    @classmethod
    def from_dict(cls, rec: Any) -> ProcessId | None:
        """The identity a record holds; None when it holds none (a record of an older
        version, or not a record at all): such a process can never be judged dead."""
        if not isinstance(rec, dict):
            return None
        m, pid, start = rec.get("machine"), rec.get("pid"), rec.get("start")
        if not isinstance(m, str) or not m or isinstance(pid, bool) \
                or not isinstance(pid, int) or pid <= 0:
            return None
        if start is not None and (isinstance(start, bool) or not isinstance(start, int)):
            return None
        return cls(m, pid, start)

    def local(self) -> bool:
        """Of this machine: its pid can be asked about here."""
        return self.machine == MACHINE

    def dead(self) -> bool:
        """Known to be gone: of this machine, and its pid names no process, a zombie (exited,
        not yet reaped), or a process started at another time (the pid was reused). A process
        of another machine or pid namespace is never known dead from here."""
        if not self.local():
            return False
        st = _stat(self.pid)
        if st is None:  # no such process, or no /proc to tell
            return not pid_alive(self.pid)
        state, start = st
        if state in ("Z", "X"):
            return True
        return self.start is not None and start != self.start
