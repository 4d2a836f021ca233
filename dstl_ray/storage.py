"""Storage over fsspec URLs (design.md "Storage").

``file://`` (the default) writes through a temp file, fsync and rename, so a reader never
sees a half-written file; ``memory://`` is for unit tests in one process; ``s3://`` goes
through s3fs as one put (multipart only when large). Paths are full URLs; storages are cached
per (protocol, options) in each process.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import fsspec

from .errors import StorageError


@runtime_checkable
class Storage(Protocol):
    """What dstl-ray needs from a file system; implement it to plug in another store."""

    def write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` as the whole, new file ``path``: all or nothing."""

    def read_file(self, path: str) -> bytes: ...

    def read_range(self, path: str, offset: int, length: int) -> bytes: ...

    def delete(self, path: str) -> None:
        """Delete ``path``; a missing file is not an error."""

    def exists(self, path: str) -> bool: ...

    def list_files(self, prefix: str) -> list[str]:
        """Every file under directory ``prefix`` (recursively), as full URLs."""


def split_protocol(url: str) -> tuple[str, str]:
    if "://" not in url:
        return "file", os.path.abspath(url)
    proto, rest = url.split("://", 1)
    return proto, rest


def normalize_url(url: str) -> str:
    """``/a/b`` -> ``file:///a/b``; trailing slashes removed."""
    proto, rest = split_protocol(url)
    if proto == "file":
        rest = os.path.abspath(rest)
    return f"{proto}://{rest.rstrip('/') or '/'}"


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


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
        local = self._local(path)
        directory = os.path.dirname(local)
        tmp = f"{local}.tmp-{uuid.uuid4().hex}"
        try:
            os.makedirs(directory, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
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
            raise StorageError(f"cannot write {path}: {e}") from e

    def read_file(self, path: str) -> bytes:
        try:
            with open(self._local(path), "rb") as f:
                return f.read()
        except OSError as e:
            raise StorageError(f"cannot read {path}: {e}") from e

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        try:
            with open(self._local(path), "rb") as f:
                f.seek(offset)
                return f.read(length)
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


class FsspecStorage:
    """Any fsspec file system (``memory://``, ``s3://`` ...): one put per file."""

    def __init__(self, protocol: str, options: Mapping[str, Any] | None = None) -> None:
        self.protocol = protocol
        self._fs = fsspec.filesystem(protocol, **dict(options or {}))

    def _p(self, path: str) -> str:
        proto, rest = split_protocol(path)
        if proto != self.protocol:
            raise StorageError(f"{path} is not a {self.protocol}:// path")
        return rest if proto != "memory" else "/" + rest.lstrip("/")

    def _url(self, p: str) -> str:
        return f"{self.protocol}://{p.lstrip('/')}"

    def write_file(self, path: str, data: bytes) -> None:
        try:
            self._fs.pipe_file(self._p(path), data)
        except Exception as e:  # noqa: BLE001 - any client error becomes a StorageError
            raise StorageError(f"cannot write {path}: {type(e).__name__}: {e}") from e

    def read_file(self, path: str) -> bytes:
        try:
            return self._fs.cat_file(self._p(path))
        except Exception as e:  # noqa: BLE001
            raise StorageError(f"cannot read {path}: {type(e).__name__}: {e}") from e

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        try:
            return self._fs.cat_file(self._p(path), start=offset, end=offset + length)
        except Exception as e:  # noqa: BLE001
            raise StorageError(
                f"cannot read {path} [{offset}:+{length}]: {type(e).__name__}: {e}") from e

    def delete(self, path: str) -> None:
        try:
            self._fs.rm_file(self._p(path))
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001
            raise StorageError(f"cannot delete {path}: {type(e).__name__}: {e}") from e

    def exists(self, path: str) -> bool:
        return bool(self._fs.exists(self._p(path)))

    def list_files(self, prefix: str) -> list[str]:
        try:
            found = self._fs.find(self._p(prefix))
        except FileNotFoundError:
            return []
        return sorted(self._url(p) for p in found)


_cache: dict[tuple[str, tuple[tuple[str, Any], ...]], Storage] = {}
_lock = threading.Lock()


def get_storage(url: str, options: Mapping[str, Any] | None = None) -> Storage:
    """The (cached) storage for ``url``'s protocol."""
    proto, _ = split_protocol(url)
    key = (proto, tuple(sorted((options or {}).items())))
    with _lock:
        st = _cache.get(key)
        if st is None:
            st = LocalStorage() if proto == "file" else FsspecStorage(proto, options)
            _cache[key] = st
        return st
