"""Task-local recovery for the ``rocksdb`` state table (Flink's ``state.backend.local-recovery``:
a secondary copy of the latest snapshot on the task's own disk, restored from when the task
comes back on the same machine, the DFS copy being the primary).

After each materialization uploads its SST files (:mod:`dstl_ray.state.incremental`), the
table hard-links them under a per-machine, per-user directory (mode 0700; a link, or one
another user owns, turns the feature off, and the sweep never follows a link), one folder per
job (its normalized DFS directory), operator and key-group range, each
file named by its upload's name (``mat/<uuid>.sst`` -> ``<uuid>.sst``: a name never reused,
so a name identifies the bytes). The links share the database's inodes: they cost no space
until compaction deletes the database's own names. A folder keeps the files of its range's
last two materializations (a restore may have to fall back to the one before the latest
when the latest's checkpoint never completed).

A restore of a handle on this machine takes the files it finds there, each checked against
the handle's size and CRC32C as a download is; anything that fails (a missing, short or
corrupt file, a file system without hard links, an I/O error) leaves the file to be
downloaded (:func:`~dstl_ray.state.incremental.download`, which also confirms that the DFS
still holds every file taken locally: later checkpoints name them, so a restore elsewhere
must find them). So a query restarted on its machines restores its RocksDB state without
copying it. Folders not written for :data:`MAX_AGE_S` (a job gone for a day) are swept by the
next table created under the same local directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable
from urllib.parse import quote

from ..format.incremental import RocksDBHandle, UploadedFile
from ..keygroups import KeyGroupRange
from ..storage.base import normalize_url

log = logging.getLogger(__name__)

ROOT = "dstl-local-recovery"  # under the table's local directory, + "-<uid>"
MAX_AGE_S = 24 * 3600.0


class LocalRecovery:
    """The local copies of one machine's rocksdb materializations of ``operator`` under
    ``local_dir``."""

    def __init__(self, local_dir: str, operator: str = "",
                 clock: Callable[[], float] = time.time) -> None:
        self.root = os.path.join(local_dir, f"{ROOT}-{os.getuid()}")
        self._operator = operator
        self._clock = clock
        self._previous: dict[str, frozenset[str]] = {}  # folder -> the last handle's names
        self.taken = 0  # SST files restores took from here

    def _folder(self, job_url: str, key_groups: KeyGroupRange) -> str:
        """The folder of one key-group range of this operator of the job whose DFS directory
        is ``job_url`` (jobs of one id under two checkpoint directories keep apart)."""
        url = normalize_url(job_url).rstrip("/")
        tag = hashlib.sha1(f"{url}\n{self._operator}".encode()).hexdigest()[:16]
        name = quote(url.rsplit("/", 1)[-1], safe="")[:48]
        return os.path.join(self.root, f"{name}-{tag}", f"{key_groups.start}-{key_groups.end}")

    def _root_ok(self, create: bool = True) -> bool:
        """The root is this user's own private directory, not a link (a shared temp
        directory: another user must not read our state, plant files for a restore, or
        point a sweep elsewhere); one of ours open to others is made private again."""
        try:
            if create:
                os.makedirs(self.root, mode=0o700, exist_ok=True)
            st = os.lstat(self.root)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
                os.chmod(self.root, 0o700)  # (files in it are checked by CRC all the same)
                st = os.lstat(self.root)
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("local recovery off: %s: %s", self.root, e)
            return False
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            log.warning("local recovery off: %s is not a private directory of this user",
                        self.root)
            return False
        return True

    @staticmethod
    def _name(f: UploadedFile) -> str:
        return os.path.basename(f.path)

    def keep(self, checkpoint_dir: str, handle: RocksDBHandle, job_url: str) -> None:
        """Link the SST files of ``handle`` (a materialization of the local checkpoint in
        ``checkpoint_dir``, uploaded under ``job_url``) into its range's folder, dropping
        files of neither it nor the one before, and the folders of this operator's ranges
        that overlap it (a rescaled job's). Best effort: the upload is what counts, so a
        local failure is logged and nothing more."""
        if not self._root_ok():
            return
        folder = self._folder(job_url, handle.key_group_range)
        names = frozenset(self._name(f) for f in handle.ssts)
        wanted = names | self._previous.get(folder, frozenset())
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            for f in handle.ssts:
                src, dst = os.path.join(checkpoint_dir, f.name), os.path.join(
                    folder, self._name(f))
                if not _same_file(src, dst):  # new, or a damaged copy replaced
                    tmp = f"{dst}.{uuid.uuid4().hex}.tmp"
                    os.link(src, tmp)
                    os.replace(tmp, dst)
            for n in os.listdir(folder):
                if n not in wanted:
                    os.unlink(os.path.join(folder, n))
            os.utime(folder)  # in use (the age sweep)
            self._previous[folder] = names
            self._drop_overlapping(os.path.dirname(folder), handle.key_group_range)
        except OSError as e:
            log.warning("local recovery copy of %s in %s not kept: %s",
                        handle.key_group_range, folder, e)

    def _drop_overlapping(self, job_dir: str, kgr: KeyGroupRange) -> None:
        for n in os.listdir(job_dir):
            lo, _, hi = n.partition("-")
            if not (lo.isdigit() and hi.isdigit()) or (int(lo), int(hi)) == (kgr.start,
                                                                               kgr.end):
                continue
            if int(lo) <= kgr.end and kgr.start <= int(hi):
                shutil.rmtree(os.path.join(job_dir, n), ignore_errors=True)

    def take(self, handle: RocksDBHandle, job_url: str, dest: str,
             check: Callable[[UploadedFile, str], bool]) -> set[str]:
        """Hard-link into ``dest`` the SST files of ``handle`` (of the job at ``job_url``)
        kept here that ``check(file, local path)`` accepts (size and CRC32C); returns the
        local names linked. A file that fails is left to be downloaded; a link that cannot
        be removed again is a :class:`OSError` (a download must never write into a file a
        database shares)."""
        folder = self._folder(job_url, handle.key_group_range)
        linked: set[str] = set()
        if not os.path.isdir(folder) or not self._root_ok():
            return linked
        for f in handle.ssts:
            src, dst = os.path.join(folder, self._name(f)), os.path.join(dest, f.name)
            try:
                os.link(src, dst)
            except OSError:
                continue
            try:
                ok = check(f, dst)
            except OSError as e:
                log.warning("local recovery copy %s unreadable, downloading it: %s", src, e)
                ok = False
            if ok:
                linked.add(f.name)
            else:
                os.unlink(dst)
                with contextlib.suppress(OSError):
                    os.unlink(src)  # (not read again by every restore until the next keep)
        self._previous[folder] = frozenset(self._name(f) for f in handle.ssts)
        self.taken += len(linked)
        return linked

    def sweep(self) -> list[str]:
        """Delete the folders not written for :data:`MAX_AGE_S`; returns them. Only in a
        root of this user's own, and never through a link."""
        gone: list[str] = []
        if not self._root_ok(create=False):
            return gone
        for job in _dirs(self.root):
            for rng in _dirs(job.path):
                try:
                    old = self._clock() - rng.stat(follow_symlinks=False).st_mtime > MAX_AGE_S
                except OSError:
                    continue
                if old:
                    shutil.rmtree(rng.path, ignore_errors=True)
                    gone.append(rng.path)
            if not _dirs(job.path):
                with contextlib.suppress(OSError):
                    os.rmdir(job.path)
        return gone


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _dirs(path: str) -> list[os.DirEntry[str]]:
    """The real directories (not links) in ``path``."""
    try:
        with os.scandir(path) as it:
            return [e for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
