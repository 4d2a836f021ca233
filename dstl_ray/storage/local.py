"""``file://``: local files, written as temp + fsync + rename (docs/architecture.md "Write
path" 5)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from typing import BinaryIO

from ..errors import StorageError
from .base import COPY_CHUNK, _check_range, split_protocol


class LocalStorage:
    """``file://``: temp file + fsync + rename, so a file exists whole or not at all."""

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
        :meth:`write_file` writes: a temp file, fsynced, renamed into place."""
        def fill(f: BinaryIO) -> None:
            with open(local_path, "rb") as src:
                shutil.copyfileobj(src, f, COPY_CHUNK)

        self._replace(path, fill, f" from {local_path}")

    def _replace(self, path: str, fill: Callable[[BinaryIO], object], what: str) -> None:
        """Write ``path`` whole or not at all: ``fill`` writes a temp file, which is fsynced
        and renamed into place, then the directory is fsynced."""
        local = self._local(path)
        directory = os.path.dirname(local)
        tmp = f"{local}.tmp-{uuid.uuid4().hex}"
        try:
            os.makedirs(directory, exist_ok=True)
            with open(tmp, "wb") as f:
                fill(f)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, local)
            if self._fsync:
                fd = os.open(directory, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise StorageError(f"cannot write {path}{what}: {e}") from e

    def create_file(self, path: str, data: bytes) -> bool:
        """Write ``path`` only if it does not exist yet, atomically (a hard link of a
        complete temp file fails if the name exists): False if someone else created it."""
        local = self._local(path)
        tmp = f"{local}.tmp-{uuid.uuid4().hex}"
        try:
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, local)
            except FileExistsError:
                return False
            return True
        except OSError as e:
            raise StorageError(f"cannot create {path}: {e}") from e
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def append_file(self, path: str, data: bytes) -> int:
        """Append ``data`` to ``path`` (created if missing), durable before returning;
        returns the offset it starts at. The bytes are readable at once, before any close
        of the physical file (FLIP-306 "SEGMENTED_ACROSS_CP_BOUNDARY" needs this)."""
        local = self._local(path)
        directory = os.path.dirname(local)
        try:
            os.makedirs(directory, exist_ok=True)
            created = not os.path.exists(local)
            with open(local, "ab") as f:
                offset = f.tell()
                f.write(data)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            if created and self._fsync:
                fd = os.open(directory, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
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

    def exists(self, path: str) -> bool:
        return os.path.exists(self._local(path))

    def list_files(self, prefix: str) -> list[str]:
        root = self._local(prefix)
        out = []
        for dirpath, _, files in os.walk(root):
            for name in files:
                out.append("file://" + os.path.join(dirpath, name))
        return sorted(out)
