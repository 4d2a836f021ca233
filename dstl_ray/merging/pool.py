"""File merging of materialized state (FLIP-306 "Unified file merging mechanism").

Segment files (FLIP-306 4.1, 4.3): a subtask writes its materializations (logical ``.dstm``
files) into physical files of its own directory, ``{job}/shared/{op}-{first kg}-{last kg}/``.
A :class:`~dstl_ray.format.materialized.MaterializedHandle` names the physical file, the offset and
the length of its logical file ("SegmentFileStateHandle"). Changelog files are merged by the
node tree already: one file per tree flush, whatever the number of writers.

Modes (4.1.1): ``within_checkpoint`` closes a physical file after the segments of one
checkpoint; a subtask materializes at most once per checkpoint, so each of its physical files
holds one segment, in the subtask's directory under the rules below. ``across_checkpoints``
keeps appending successive materializations to the open physical file until it holds
``max_file_size`` bytes; it needs a file system where appended bytes are readable before the
file is closed (``file://``; object stores are refused).

Ownership and cleanup (4.3-4.5, 4.8): the directory belongs to the coordinator (reported in
every snapshot as ``owned_dir``, the "DirectoryStateHandle"; the shared state registry never
deletes files of a claimed directory), the files to the subtask. This manager counts references
from logical segments to physical files: a segment is live while it is the backend's current
materialized state or a checkpoint that used it may still be retained. The coordinator sends a
watermark, the newest checkpoint id up to which every checkpoint is subsumed or declined, so a
lost notification is made good by the next one. A physical file is deleted once it takes no
more segments and all of its segments are dead. After a failover the restored subtask (same
operator and key groups, so the same directory) adopts the segments it restored from; after a
rescale a subtask's state comes from other subtasks' directories and it writes its own copy at
once (a forced materialization), the old directories' files then go by reference count.

Space amplification (4.7): when a physical file's bytes exceed ``max_space_amplification``
times its live bytes, an open file stops taking segments, and a closed one whose live segment
is the current state has that segment rewritten into a fresh file (compaction); the next
checkpoint refers to the copy and the old file goes once the checkpoints using it are subsumed.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..config import ChangelogConfig
from ..errors import ConfigError
from ..format.materialized import MAT_SUFFIX, SHARED_DIR
from ..keygroups import KeyGroupRange
from ..storage.base import Storage, join, split_protocol, supports_append
from ..storage.deleter import Deleter, background_deleter

log = logging.getLogger(__name__)

UNKNOWN_USE = (1 << 63) - 1  # a use by a checkpoint of unknown id: never freed by watermark


@dataclass(frozen=True)
class FileMergingOptions:
    """FLIP-306 "Public interfaces": ``state.checkpoints.file-merging.*``."""

    mode: str = "none"  # none | within_checkpoint | across_checkpoints
    max_file_size: int = 32 * 1024 * 1024
    max_file_pool_size: int = 4
    max_space_amplification: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in ("none", "within_checkpoint", "across_checkpoints"):
            raise ConfigError(f"option file_merging must be one of none, within_checkpoint, "
                              f"across_checkpoints, got {self.mode!r}")
        if not isinstance(self.max_file_size, int) or self.max_file_size < 1:
            raise ConfigError(f"option file_merging_max_file_size must be >= 1, got "
                              f"{self.max_file_size!r}")
        if not isinstance(self.max_file_pool_size, int) or self.max_file_pool_size < 1:
            raise ConfigError(f"option file_merging_max_file_pool_size must be >= 1, got "
                              f"{self.max_file_pool_size!r}")
        if not self.max_space_amplification >= 1.0:
            raise ConfigError(f"option file_merging_max_space_amplification must be >= 1, "
                              f"got {self.max_space_amplification!r}")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def across(self) -> bool:
        return self.mode == "across_checkpoints"

    @classmethod
    def from_config(cls, config: ChangelogConfig | None) -> FileMergingOptions:
        if config is None:
            return cls()
        return cls(config.file_merging, config.file_merging_max_file_size,
                   config.file_merging_max_file_pool_size,
                   config.file_merging_max_space_amplification)

    def check_storage(self, url: str) -> None:
        """Refuse merging across checkpoints where appended bytes are not readable before
        the file is closed (FLIP-306 4.1.1: object stores)."""
        if self.across and not supports_append(url):
            raise ConfigError(f"option file_merging=across_checkpoints needs a file system "
                              f"whose files are readable before they are closed (file://); "
                              f"{split_protocol(url)[0]}:// makes an object visible only "
                              f"once written whole: use within_checkpoint")


def subtask_dir(operator_id: str, key_group_range: KeyGroupRange) -> str:
    """The subtask's directory relative to the job directory; the operator id is hashed, so
    it cannot steer the path."""
    op = hashlib.sha256(operator_id.encode()).hexdigest()[:16]
    return f"{SHARED_DIR}/{op}-{key_group_range.start}-{key_group_range.end}"


@dataclass
class _Segment:
    length: int
    last_use: int = -1  # newest checkpoint id whose snapshot named it (-1: none yet)
    base: bool = False  # the backend's current materialized state
    held: bool = True  # just written: live until it becomes the state or is discarded


@dataclass
class PooledFile:
    rel: str  # path relative to the job directory
    size: int = 0
    sealed: bool = False  # takes no more segments
    busy: bool = False  # a writer holds it (FLIP-306 4.6: one writer per open file)

    def live_bytes(self, watermark: int) -> int:
        raise NotImplementedError


@dataclass
class PhysicalFile(PooledFile):
    segments: dict[int, _Segment] = field(default_factory=dict)  # offset -> segment

    def live_bytes(self, watermark: int) -> int:
        return sum(s.length for s in self.segments.values()
                   if s.base or s.held or s.last_use > watermark)


@dataclass
class PoolStats:
    files_created: int = 0
    files_deleted: int = 0


@dataclass
class MergingStats(PoolStats):
    segments_written: int = 0
    bytes_written: int = 0
    compactions: int = 0
    bytes_compacted: int = 0
    adopted: int = 0


class FilePool:
    """Physical files of one owner in its directory: at most ``max_file_pool_size`` taken
    by writers at once, one writer each (FLIP-306 4.6), deleted once nothing in them is
    live; an open file past ``max_space_amplification`` takes no more segments (4.7).
    Subclasses say what a file holds and what is live. Thread-safe."""

    suffix = ""

    def __init__(self, storage: Storage, job_path: str, directory: str,
                 options: FileMergingOptions, stats: PoolStats,
                 deleter: Deleter | None = None) -> None:
        self.storage, self.job_path, self.dir, self.options = (storage, job_path, directory,
                                                                options)
        self.stats = stats
        self.deleter = deleter  # None: dead files are deleted in the calling thread
        self.watermark = -1
        self._files: dict[str, Any] = {}
        self._cond = threading.Condition()

    def owns(self, rel: str) -> bool:
        return rel.startswith(self.dir + "/")

    def _new_file(self, rel: str) -> PooledFile:
        raise NotImplementedError

    def _take(self) -> Any:
        """An open file for one writer."""
        with self._cond:
            while True:
                free = [f for f in self._files.values() if not f.sealed and not f.busy]
                if free:
                    f = free[0]
                    break
                if sum(f.busy for f in self._files.values()) < self.options.max_file_pool_size:
                    f = self._new_file(f"{self.dir}/{uuid.uuid4().hex}{self.suffix}")
                    self._files[f.rel] = f
                    self.stats.files_created += 1
                    break
                self._cond.wait()
            f.busy = True
            return f

    def _give_back(self, f: PooledFile, seal: bool) -> None:
        with self._cond:
            f.busy = False
            f.sealed = f.sealed or seal or f.size >= self.options.max_file_size
            self._cond.notify_all()
        self._collect()

    def subsumed(self, watermark: int) -> None:
        """Every checkpoint up to ``watermark`` is subsumed or declined (never goes back)."""
        with self._cond:
            if watermark <= self.watermark:
                return
            self.watermark = watermark
        self._collect()

    def size(self) -> int:
        """Files tracked, and the pieces (segments, flushes) they hold."""
        with self._cond:
            return len(self._files) + sum(len(getattr(f, "segments", None) or
                                              getattr(f, "flushes", None) or ())
                                          for f in self._files.values())

    def abandon(self) -> None:
        """Forget every file without deleting any: they belong to someone else now (a node's
        merged files of a job's earlier incarnation go by the new run's reference counts)."""
        with self._cond:
            self._files.clear()

    def _collect(self) -> None:
        wm = self.watermark
        dead: list[PooledFile] = []
        with self._cond:
            for f in self._files.values():
                if f.busy:
                    continue
                live = f.live_bytes(wm)
                if live == 0:
                    dead.append(f)
                elif (not f.sealed and f.size > 0
                      and f.size > self.options.max_space_amplification * live):
                    f.sealed = True  # stop feeding a file that is mostly dead (4.7)
            for f in dead:
                del self._files[f.rel]
        self._delete(dead)

    def _delete(self, files: list[PooledFile]) -> None:
        for f in files:
            if self.deleter is not None:  # off the caller's locks (a backend's)
                self.deleter.submit(lambda f=f: self._delete_one(f), f"merged file {f.rel}")
                continue
            try:
                self._delete_one(f)
            except Exception as e:  # noqa: BLE001 - recovery's orphan cleanup gets it
                log.warning("cannot delete merged file %s: %s", f.rel, e)

    def _delete_one(self, f: PooledFile) -> None:
        self.storage.delete(join(self.job_path, f.rel))
        with self._cond:
            self.stats.files_deleted += 1


class SubtaskFileManager(FilePool):
    """Physical files of one subtask (FLIP-306 "FileMergingSnapshotManager" for the shared
    scope): hands out segments, counts their uses, deletes dead files. Thread-safe."""

    suffix = MAT_SUFFIX

    def __init__(self, storage: Storage, job_path: str, operator_id: str,
                 key_group_range: KeyGroupRange, options: FileMergingOptions,
                 deleter: Deleter | None = None) -> None:
        options.check_storage(job_path)
        self.stats: MergingStats = MergingStats()
        # a backend calls us under its lock: dead files go to the background deleter
        super().__init__(storage, job_path, subtask_dir(operator_id, key_group_range),
                         options, self.stats, deleter or background_deleter())

    def _new_file(self, rel: str) -> PhysicalFile:
        return PhysicalFile(rel)

    @property
    def dir_url(self) -> str:
        return join(self.job_path, self.dir)

    def write(self, data: bytes) -> tuple[str, int]:
        """Write one logical file as a segment; returns (physical path, offset) once it is
        durable and readable."""
        f = self._take()
        try:
            url = join(self.job_path, f.rel)
            if f.size == 0 and not self.options.across:
                self.storage.write_file(url, data)  # one segment: an atomic whole file
                offset = 0
            else:
                offset = self.storage.append_file(url, data)  # type: ignore[attr-defined]
            with self._cond:
                f.size = offset + len(data)
                f.segments[offset] = _Segment(len(data))
                self.stats.segments_written += 1
                self.stats.bytes_written += len(data)
            return f.rel, offset
        except BaseException:
            with self._cond:  # a torn tail is never named by a handle; start a fresh file
                f.sealed = True
            raise
        finally:
            self._give_back(f, seal=not self.options.across)

    # ------------------------------------------------------------------ uses

    def _segment(self, rel: str, offset: int) -> _Segment | None:
        f = self._files.get(rel)
        return f.segments.get(offset) if f else None

    def set_base(self, rel: str | None, offset: int = 0) -> None:
        """The backend's materialized state is now this segment (None: not one of ours)."""
        with self._cond:
            for f in self._files.values():
                for s in f.segments.values():
                    s.base = False
            s = self._segment(rel, offset) if rel is not None else None
            if s is not None:
                s.base, s.held = True, False
        self._collect()

    def used(self, rel: str, offset: int, checkpoint_id: int) -> None:
        """The snapshot of ``checkpoint_id`` (-1: unknown) names this segment."""
        cid = checkpoint_id if checkpoint_id >= 0 else UNKNOWN_USE
        with self._cond:
            s = self._segment(rel, offset)
            if s is not None:
                s.last_use = max(s.last_use, cid)

    def discard(self, rel: str, offset: int) -> None:
        """A segment no checkpoint will name (its backend closed while writing it)."""
        with self._cond:
            f = self._files.get(rel)
            if f is not None:
                f.segments.pop(offset, None)
        self._collect()

    def adopt(self, rel: str, offset: int, length: int, checkpoint_id: int,
              base: bool = True) -> None:
        """Take over a segment of our directory (FLIP-306 4.5, 4.8 "Failover") that a
        restored (``base``: our state) or another retained checkpoint uses; its file takes
        no new segments."""
        with self._cond:
            f = self._files.get(rel)
            if f is None:
                f = self._files[rel] = PhysicalFile(rel, sealed=True)
                self.stats.adopted += 1
            f.size = max(f.size, offset + length)
            s = f.segments.setdefault(offset, _Segment(length, held=False))
            s.base = s.base or base  # restored state is named by our next snapshots
            s.last_use = max(s.last_use,
                             checkpoint_id if checkpoint_id >= 0 else UNKNOWN_USE)

    # ------------------------------------------------------------------ cleanup

    def compaction_candidate(self) -> tuple[str, int, int] | None:
        """The current state's segment, if it sits in a closed file whose size exceeds
        ``max_space_amplification`` times its live bytes: (path, offset, length)."""
        wm = self.watermark
        with self._cond:
            for f in self._files.values():
                if not f.sealed or f.busy:
                    continue
                for off, s in f.segments.items():
                    if s.base and f.size > self.options.max_space_amplification * \
                            f.live_bytes(wm):
                        return f.rel, off, s.length
        return None

    def compacted(self, length: int) -> None:
        with self._cond:
            self.stats.compactions += 1
            self.stats.bytes_compacted += length

    def close(self) -> None:
        """Backend shutdown: files no checkpoint named are deleted, the rest stay for the
        coordinator's checkpoints (their directory stays claimed)."""
        with self._cond:
            unused = [f for f in self._files.values()
                      if not f.busy and all(s.last_use < 0 for s in f.segments.values())]
            for f in self._files.values():
                for s in f.segments.values():
                    s.held = False
            for f in self._files.values():
                f.sealed = True
            for f in unused:
                del self._files[f.rel]
        self._delete(unused)

    # ------------------------------------------------------------------ introspection

    def space(self) -> dict[str, Any]:
        """Bytes on storage vs live bytes of this subtask's physical files."""
        wm = self.watermark
        with self._cond:
            total = sum(f.size for f in self._files.values())
            live = sum(f.live_bytes(wm) for f in self._files.values())
            return {"files": len(self._files), "bytes": total, "live_bytes": live,
                    "amplification": (total / live) if live else None}
