"""A node's merged changelog files (FLIP-306 "Merging DSTL files", across checkpoints).

The tree already writes one changelog file per flush whatever the number of writers (merging
within a checkpoint). With ``file_merging=across_checkpoints`` a flushing node appends each
flush of a job to its open physical file ``{job}/segments/{node}/{uuid}.dstl`` instead of
writing a new file. Handles are unchanged: a segment already names a byte range of a file,
so readers need nothing new.

Ownership (FLIP-306 4.3-4.4, 4.8): these files belong to the node that writes them; the
coordinator's registry claims the ``segments`` directory and never deletes them. The node
counts, per flush, the sections (log id, offset) not released yet (a writer releases an upload
when it truncates after a materialization, or closes; one log may have two sections in one
flush), whether any of them was given out in a handle, and the newest checkpoint that may name
it (the writer's newest persisted checkpoint id when it released). Persist requests carry the
job's subsumed watermark (the coordinator's, via the backend and its writer), so a lost
notification is made good by the next request. A flush is dead when every section was released
and it was unused or the watermark passed its last use; a physical file is deleted when all its
flushes are dead. A backend restored from a checkpoint names the restored changelog too, until
its first materialization: at restore its writer retains those sections at their nodes and
later releases them like its own uploads. A node restarted by Ray forgets its files: they stay
until the job's next recovery deletes what no checkpoint names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..format.changelog import FILE_SUFFIX
from ..storage.base import Storage, join
from .pool import UNKNOWN_USE, FileMergingOptions, FilePool, PooledFile, PoolStats

SEGMENTS_DIR = "segments"
# merged files of writers that carry no incarnation (outside a coordinated job); a plain
# name, since handles naming them must parse (``format.segment.check_relative_path``)
UNMANAGED_DIR = "none"


@dataclass
class _Flush:
    length: int
    sections: set[tuple[str, int]]  # (log id, offset in the file) not released yet
    used: bool = False
    last_use: int = -1  # newest checkpoint id that may name it
    forgotten: set[str] = field(default_factory=set)  # dead logs released from it

    def live(self, watermark: int) -> bool:
        return bool(self.sections) or (self.used and self.last_use > watermark)


@dataclass
class _File(PooledFile):
    flushes: dict[int, _Flush] = field(default_factory=dict)  # base offset -> flush

    def live_bytes(self, watermark: int) -> int:
        return sum(f.length for f in self.flushes.values() if f.live(watermark))


class FlushFiles(FilePool):
    """Merged changelog files of one job on one node. Thread-safe."""

    suffix = FILE_SUFFIX

    def __init__(self, storage: Storage, job_path: str, directory: str,
                 options: FileMergingOptions) -> None:
        super().__init__(storage, job_path, directory, options, PoolStats())
        # logs of writers that died without releasing: log id -> the newest checkpoint id
        # that may name any of their sections (UNKNOWN_USE: unknown, never freed by watermark)
        self._dead: dict[str, int] = {}

    def _new_file(self, rel: str) -> _File:
        return _File(rel)

    def append(self, data: bytes, sections: list[tuple[str, int]]) -> tuple[str, int]:
        """Append one flush (a whole changelog file's bytes, holding ``sections``: (log id,
        offset within ``data``), each released on its own since a log may have two in one
        flush); returns (path, base offset) once durable. Blocking: call it from a worker
        thread."""
        f = self._take()
        failed = False
        try:
            offset = self.storage.append_file(  # type: ignore[attr-defined]
                join(self.job_path, f.rel), data)
            with self._cond:
                if offset < f.size:  # deleted under us (recovery's orphan cleanup) and new
                    f.flushes.clear()
                f.size = offset + len(data)
                fl = _Flush(len(data), {(log, offset + off) for log, off in sections})
                f.flushes[offset] = fl
                for log, _ in sections:  # a dead writer's flush that was still on its way
                    if log in self._dead:
                        self._forget_in(fl, log, self._dead[log])
            return f.rel, offset
        except BaseException:
            failed = True  # a torn tail is never named; the next flush takes a new file
            raise
        finally:
            self._give_back(f, seal=failed)

    def release(self, rel: str, offset: int, log_id: str, used: bool,
                last_checkpoint: int) -> None:
        """``log_id`` no longer needs its section at ``offset`` of ``rel``; ``used``: it gave
        it out in a handle, of a checkpoint no newer than ``last_checkpoint`` (-1: unknown).
        The flush stays while any other section in it is not released."""
        with self._cond:
            f = self._files.get(rel)
            if f is None:
                return
            fl = next((x for base, x in f.flushes.items()
                       if base <= offset < base + x.length), None)
            if fl is None:
                return
            fl.sections.discard((log_id, offset))
            if used:
                fl.used = True
                fl.last_use = max(fl.last_use, last_checkpoint if last_checkpoint >= 0
                                  else UNKNOWN_USE)
        self._collect()

    def forget(self, log_id: str, bound: int) -> int:
        """The writer of ``log_id`` died without releasing its sections: release every one
        of them as used by checkpoints no newer than ``bound`` (its local node's acknowledged
        knowledge: the newest checkpoint id it persisted for, ``UNKNOWN_USE`` if it was ever
        used without one, -1 if never for any checkpoint). Sections of it that land later
        are released as they land. Returns how many sections were released."""
        n = 0
        with self._cond:
            self._dead[log_id] = max(self._dead.get(log_id, -1), bound)
            for f in self._files.values():
                for fl in f.flushes.values():
                    n += self._forget_in(fl, log_id, self._dead[log_id])
        self._collect()
        return n

    @staticmethod
    def _forget_in(fl: _Flush, log_id: str, bound: int) -> int:
        """Release ``log_id``'s sections of ``fl`` up to ``bound``; a flush it was released
        from before (an earlier round with a lower bound) gets the higher one too."""
        mine = {s for s in fl.sections if s[0] == log_id}
        if not mine and log_id not in fl.forgotten:
            return 0
        fl.sections -= mine
        fl.forgotten.add(log_id)
        if bound >= 0:
            fl.used = True
            fl.last_use = max(fl.last_use, bound)
        return len(mine)

    def abandon(self) -> None:
        with self._cond:
            self._dead.clear()
        super().abandon()

    def dead_logs(self) -> int:
        with self._cond:
            return len(self._dead)

    def retain(self, rel: str, offset: int, log_id: str) -> bool:
        """A restored backend's log now names the section at ``offset`` of ``rel`` too (its
        snapshots carry the restored changelog until its first materialization): the flush
        stays until that log releases it as well (FLIP-306 4.8 "take over after failover")."""
        with self._cond:
            f = self._files.get(rel)
            fl = None if f is None else next(
                (x for base, x in f.flushes.items() if base <= offset < base + x.length), None)
            if fl is None:
                return False  # not ours any more (a restarted node never deletes it)
            fl.sections.add((log_id, offset))
            return True

    def stats_dict(self) -> dict[str, int]:
        with self._cond:
            return {"files": len(self._files), "files_created": self.stats.files_created,
                    "files_deleted": self.stats.files_deleted,
                    "bytes": sum(f.size for f in self._files.values()),
                    "live_bytes": sum(f.live_bytes(self.watermark)
                                      for f in self._files.values())}
