"""``file://``: local files, each written whole or not at all, durable on return
(docs/architecture.md "Write path" 5).

A new file is written as an unnamed inode in its directory, fsynced, linked under its name,
and the directory fsynced (:mod:`dstl_ray.storage.unnamed`): as durable as temp + fsync +
rename, without a temporary name. Replacing an existing file (the job lease's renewals)
links the written inode under a temp name and renames it over the old one, so that name
lives only between two metadata calls. Where unnamed files are not available, a named temp
file is written, fsynced and renamed.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Callable
from typing import BinaryIO

from ..errors import StorageError
from . import unnamed
from .base import COPY_CHUNK, _check_range, split_protocol


def _temp_name(local: str) -> str:
    return f"{local}.tmp-{uuid.uuid4().hex}"


def _sync_dir(directory: str) -> None:
    """Make a new name in ``directory`` durable (a link or rename changes the directory)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(directory: str, fsync: bool) -> bool:
    """Create ``directory`` and its missing parents; with ``fsync``, each new directory's
    name made durable in its parent (a directory's name lives in its parent: fsyncing the
    new directory, as a file write in it does, does not persist the name). One made by
    someone else between the check and the ``mkdir``: its parent is fsynced all the same,
    as that maker may not be done. A directory found there is taken as durable (its maker
    fsyncs its parent; :meth:`LocalStorage.make_dirs` does not take it). Whether it was
    there."""
    if os.path.isdir(directory):
        return True
    missing = []
    d = directory
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if not parent or parent == d:  # a relative path's first part, or the root
            break
        d = parent
    for new in reversed(missing):
        try:
            os.mkdir(new)
        except FileExistsError:
            if not os.path.isdir(new):
                raise
        if fsync:
            _sync_dir(os.path.dirname(new) or ".")
    return False


def _unlink_quietly(path: str | None) -> None:
    if path is None:
        return
    try:
        os.unlink(path)
    except OSError:
        pass


class LocalStorage:
    """``file://``: a file exists whole or not at all (see the module docstring)."""

    protocol = "file"

    def __init__(self, fsync: bool = True) -> None:
        self._fsync = fsync

    @staticmethod
    def _local(path: str) -> str:
        proto, rest = split_protocol(path)
        if proto != "file":
            raise StorageError(f"not a file:// path: {path}")
        return rest

    def write_file(self, path: str, data: bytes) -> None:
        self._replace(path, lambda f: f.write(data), "")

    def write_from(self, path: str, local_path: str) -> None:
        """Copy the local file ``local_path`` to ``path`` without holding it in memory, as
        :meth:`write_file` writes (see the module docstring)."""
        def fill(f: BinaryIO) -> None:
            with open(local_path, "rb") as src:
                shutil.copyfileobj(src, f, COPY_CHUNK)

        self._replace(path, fill, f" from {local_path}")

    def _replace(self, path: str, fill: Callable[[BinaryIO], object], what: str) -> None:
        """Write ``path`` whole or not at all: ``fill`` writes an unnamed inode (or else a
        temp file), which is fsynced and linked (renamed) into place, then the directory is
        fsynced."""
        local = self._local(path)
        directory = os.path.dirname(local)
        tmp: str | None = None
        try:
            _make_dirs(directory, self._fsync)
            if not self._write_unnamed(local, directory, fill):
                tmp = _temp_name(local)
                self._write_named(tmp, fill, self._fsync)
                os.replace(tmp, local)
                tmp = None
            if self._fsync:
                _sync_dir(directory)
        except OSError as e:
            _unlink_quietly(tmp)
            raise StorageError(f"cannot write {path}{what}: {e}") from e

    def _write_unnamed(self, local: str, directory: str,
                       fill: Callable[[BinaryIO], object]) -> bool:
        """Write ``local`` without a temp name (its data durable before it has a name);
        False, with nothing written, where unnamed files are not available."""
        fd = unnamed.open_unnamed(directory)
        if fd is None:
            return False
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                fill(f)
            if self._fsync:
                os.fsync(fd)
            try:
                return unnamed.link_unnamed(fd, local)
            except FileExistsError:  # replace it: a temp name for the time of one rename
                tmp = _temp_name(local)
                if not unnamed.link_unnamed(fd, tmp):
                    return False
                try:
                    os.replace(tmp, local)
                except OSError:
                    _unlink_quietly(tmp)
                    raise
                return True
        finally:
            os.close(fd)

    @staticmethod
    def _write_named(tmp: str, fill: Callable[[BinaryIO], object], fsync: bool) -> None:
        with open(tmp, "wb") as f:
            fill(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())

    def create_file(self, path: str, data: bytes) -> bool:
        """Write ``path`` only if it does not exist yet, atomically (a hard link of a
        complete, fsynced file fails if the name exists): False if someone else created it."""
        local = self._local(path)
        directory = os.path.dirname(local)
        tmp: str | None = None
        try:
            _make_dirs(directory, self._fsync)
            fd = unnamed.open_unnamed(directory)
            linked = False
            if fd is not None:
                try:
                    unnamed.write_all(fd, data)
                    os.fsync(fd)
                    linked = unnamed.link_unnamed(fd, local)
                except FileExistsError:
                    return False
                finally:
                    os.close(fd)
            if not linked:
                tmp = _temp_name(local)
                self._write_named(tmp, lambda f: f.write(data), True)
                try:
                    os.link(tmp, local)
                except FileExistsError:
                    return False
            _sync_dir(directory)
            return True
        except OSError as e:
            raise StorageError(f"cannot create {path}: {e}") from e
        finally:
            _unlink_quietly(tmp)

    def append_file(self, path: str, data: bytes) -> int:
        """Append ``data`` to ``path`` (created if missing), durable before returning;
        returns the offset it starts at. The bytes are readable at once, before any close
        of the physical file (FLIP-306 "SEGMENTED_ACROSS_CP_BOUNDARY" needs this)."""
        local = self._local(path)
        directory = os.path.dirname(local)
        try:
            _make_dirs(directory, self._fsync)
            created = not os.path.exists(local)
            with open(local, "ab") as f:
                offset = f.tell()
                f.write(data)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            if created and self._fsync:
                _sync_dir(directory)
            return offset
        except OSError as e:
            raise StorageError(f"cannot append to {path}: {e}") from e

    def read_file(self, path: str) -> bytes:
        try:
            with open(self._local(path), "rb") as f:
                return f.read()
        except OSError as e:
            raise StorageError(f"cannot read {path}: {e}") from e

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        _check_range(path, offset, length)
        try:
            with open(self._local(path), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if offset >= size:
                    return b""
                f.seek(offset)
                return f.read(min(length, size - offset))  # a buffer of what the file holds
        except OSError as e:
            raise StorageError(f"cannot read {path} [{offset}:+{length}]: {e}") from e

    def delete(self, path: str) -> None:
        try:
            os.unlink(self._local(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"cannot delete {path}: {e}") from e

    def make_dirs(self, path: str) -> None:
        """Create directory ``path`` and its parents, their names durable, ``path``'s too
        when it was there already (a checkpoint's ``chk-n`` made ahead of its metadata).
        Optional in the storage contract: stores without directories (S3) have nothing to
        make."""
        local = self._local(path)
        try:
            if _make_dirs(local, self._fsync) and self._fsync:  # its maker may not be done
                _sync_dir(os.path.dirname(local.rstrip("/")) or ".")
        except OSError as e:
            raise StorageError(f"cannot make directory {path}: {e}") from e

    def list_dirs(self, path: str) -> list[str]:
        """The URLs of the directories directly in directory ``path`` (none if it is
        missing). Optional in the storage contract, as :meth:`delete_dir` is."""
        root = self._local(path)
        try:
            with os.scandir(root) as it:
                return sorted("file://" + os.path.join(root, e.name) for e in it
                              if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StorageError(f"cannot list directories of {path}: {e}") from e

    def delete_dir(self, path: str) -> None:
        """Remove directory ``path`` if it is empty (a subsumed checkpoint's ``chk-n``);
        a missing or non-empty directory is left as it is. Optional in the storage
        contract: stores without directories (S3) have nothing to remove."""
        try:
            os.rmdir(self._local(path))
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as e:
            if e.errno != errno.ENOTEMPTY:
                raise StorageError(f"cannot remove directory {path}: {e}") from e

    def exists(self, path: str) -> bool:
        return os.path.exists(self._local(path))

    def list_files(self, prefix: str) -> list[str]:
        root = self._local(prefix)
        out = []
        for dirpath, _, files in os.walk(root):
            for name in files:
                out.append("file://" + os.path.join(dirpath, name))
        return sorted(out)
