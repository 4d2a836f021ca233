"""A node's merged changelog files (FLIP-306 "Merging DSTL files", across checkpoints).

The tree already writes one changelog file per flush whatever the number of writers (merging
within a checkpoint). With ``file_merging=across_checkpoints`` a flushing node appends each
flush of a job to its open physical file ``{job}/segments/{node}/{uuid}.dstl`` instead of
writing a new file. Handles are unchanged: a segment already names a byte range of a file,
so readers need nothing new.

Ownership (FLIP-306 4.3-4.4, 4.8): these files belong to the node that writes them; the
coordinator's registry claims the ``segments`` directory and never deletes them. The node
counts, per flush, the logs that have not released it yet (a writer releases an upload when
it truncates after a materialization, or closes), whether any of them gave it out in a handle,
and the newest checkpoint that may name it (the writer's newest persisted checkpoint id when
it released). Persist requests carry the job's subsumed watermark (the coordinator's, via the
backend and its writer), so a lost notification is made good by the next request. A flush is
dead when every log released it and it was unused or the watermark passed its last use; a
physical file is deleted when all its flushes are dead. A node restarted by Ray forgets its
files: they stay until the job's next recovery deletes what no checkpoint names.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field

from .format import FILE_SUFFIX
from .merging import UNKNOWN_USE, FileMergingOptions
from .storage import Storage, join

log = logging.getLogger(__name__)

SEGMENTS_DIR = "segments"


@dataclass
class _Flush:
    length: int
    logs: set[str]
    used: bool = False
    last_use: int = -1  # newest checkpoint id that may name it

    def live(self, watermark: int) -> bool:
        return bool(self.logs) or (self.used and self.last_use > watermark)


@dataclass
class _File:
    rel: str
    size: int = 0
    sealed: bool = False
    busy: bool = False
    flushes: dict[int, _Flush] = field(default_factory=dict)  # base offset -> flush

    def live_bytes(self, watermark: int) -> int:
        return sum(f.length for f in self.flushes.values() if f.live(watermark))


class FlushFiles:
    """Merged changelog files of one job on one node. Thread-safe."""

    def __init__(self, storage: Storage, job_path: str, node_key: str,
                 options: FileMergingOptions) -> None:
        self.storage, self.job_path, self.options = storage, job_path, options
        self.dir = f"{SEGMENTS_DIR}/{node_key}"
        self.watermark = -1
        self.files_created = 0
        self.files_deleted = 0
        self._files: dict[str, _File] = {}
        self._cond = threading.Condition()

    def owns(self, rel: str) -> bool:
        return rel.startswith(self.dir + "/")

    def _take(self) -> _File:
        with self._cond:
            while True:
                free = [f for f in self._files.values() if not f.sealed and not f.busy]
                if free:
                    f = free[0]
                    break
                if sum(f.busy for f in self._files.values()) < self.options.max_file_pool_size:
                    f = _File(f"{self.dir}/{uuid.uuid4().hex}{FILE_SUFFIX}")
                    self._files[f.rel] = f
                    self.files_created += 1
                    break
                self._cond.wait()
            f.busy = True
            return f

    def append(self, data: bytes, logs: set[str]) -> tuple[str, int]:
        """Append one flush (a whole changelog file's bytes); returns (path, base offset)
        once durable. Blocking: call it from a worker thread."""
        f = self._take()
        try:
            offset = self.storage.append_file(  # type: ignore[attr-defined]
                join(self.job_path, f.rel), data)
            with self._cond:
                if offset < f.size:  # deleted under us (recovery's orphan cleanup) and new
                    f.flushes.clear()
                f.size = offset + len(data)
                f.flushes[offset] = _Flush(len(data), set(logs))
                if f.size >= self.options.max_file_size:
                    f.sealed = True
            return f.rel, offset
        except BaseException:
            with self._cond:
                f.sealed = True  # a torn tail is never named; the next flush takes a new file
            raise
        finally:
            with self._cond:
                f.busy = False
                self._cond.notify_all()
            self._collect()

    def release(self, rel: str, offset: int, log_id: str, used: bool,
                last_checkpoint: int) -> None:
        """``log_id`` no longer needs its section at ``offset`` of ``rel``; ``used``: it gave
        it out in a handle, of a checkpoint no newer than ``last_checkpoint`` (-1: unknown)."""
        with self._cond:
            f = self._files.get(rel)
            if f is None:
                return
            fl = next((x for base, x in f.flushes.items()
                       if base <= offset < base + x.length), None)
            if fl is None:
                return
            fl.logs.discard(log_id)
            if used:
                fl.used = True
                fl.last_use = max(fl.last_use, last_checkpoint if last_checkpoint >= 0
                                  else UNKNOWN_USE)
        self._collect()

    def subsumed(self, watermark: int) -> None:
        with self._cond:
            if watermark <= self.watermark:
                return
            self.watermark = watermark
        self._collect()

    def _collect(self) -> None:
        wm = self.watermark
        dead: list[_File] = []
        with self._cond:
            for f in self._files.values():
                if f.busy:
                    continue
                live = f.live_bytes(wm)
                if live == 0 and f.flushes:
                    dead.append(f)
                elif not f.sealed and f.size > self.options.max_space_amplification * live:
                    f.sealed = True  # mostly dead: stop appending (FLIP-306 4.7)
            for f in dead:
                del self._files[f.rel]
        for f in dead:
            try:
                self.storage.delete(join(self.job_path, f.rel))
                self.files_deleted += 1
            except Exception as e:  # noqa: BLE001 - recovery's orphan cleanup gets it
                log.warning("cannot delete merged changelog file %s: %s", f.rel, e)

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"files": len(self._files), "files_created": self.files_created,
                    "files_deleted": self.files_deleted,
                    "bytes": sum(f.size for f in self._files.values()),
                    "live_bytes": sum(f.live_bytes(self.watermark)
                                      for f in self._files.values())}
