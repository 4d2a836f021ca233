"""Any fsspec file system (S3 and the rest) behind the ``Storage`` contract.

``create_file`` (write a name only if it is absent: the job lease's epoch claims, savepoint
markers) exists only where the store can make it atomic: ``memory://`` (one store per
process, every call on it under one lock) and ``s3://`` through an s3fs that sends
``If-None-Match: *`` (a conditional put; a server that ignores the header overwrites, which
the lease's read-back notices only when it comes after the other write). Elsewhere the attribute is None and
callers fall back to write, settle and read back (docs/architecture.md "Storage")."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Mapping
from typing import Any

import fsspec

from ..config import redact_options
from ..errors import StorageError
from .base import S3_MIN_PART, MiB, _check_range, split_protocol

# memory:// is one dict per process (fsspec's MemoryFileSystem.store, shared by every
# instance), which fsspec reads and writes without a lock: a listing iterating it while
# another thread's write adds a file failed ("dictionary changed size during iteration": a
# garbage collection inside the iteration lets the other thread in). Every call of ours on
# it takes this lock, and create and append hold it across their read and their write.
_MEMORY = threading.RLock()


class _OneAtATime:
    """A file system whose every method call holds ``lock`` (``memory://``: see _MEMORY)."""

    def __init__(self, fs: Any, lock: Any) -> None:
        self._fs, self._lock = fs, lock

    def __getattr__(self, name: str) -> Any:
        if name in ("_fs", "_lock") or name.startswith("__"):  # (a copy before __init__)
            raise AttributeError(name)
        attr = getattr(self._fs, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attr(*args, **kwargs)

        return call


def _conditional_put(fs: Any) -> bool:
    """Whether ``fs.pipe_file`` takes ``mode="create"`` (s3fs sends ``If-None-Match: *``)."""
    try:
        return "mode" in inspect.signature(fs.pipe_file).parameters
    except (TypeError, ValueError):
        return False


class FsspecStorage:
    """Any fsspec file system (``memory://``, ``s3://`` ...): one put per file; on S3 a file of
    at least ``multipart_threshold`` bytes goes as a multipart upload."""

    def __init__(self, protocol: str, options: Mapping[str, Any] | None = None,
                 multipart_threshold: int = 16 * MiB) -> None:
        self.protocol = protocol
        self._options = dict(options or {})
        self.multipart_threshold = max(2 * S3_MIN_PART, multipart_threshold)
        self.multipart_uploads = 0
        fs_options = dict(self._options)
        if protocol in ("s3", "s3a", "gs", "gcs", "abfs", "az"):
            # object stores: no cached listings. Other processes write the files this one
            # reads (a driver lists the job directory at restore, then reads checkpoints
            # written since), and a cached listing makes a new object look missing
            fs_options.setdefault("use_listings_cache", False)
        self._fs = fsspec.filesystem(protocol, **fs_options)
        if protocol == "memory":
            self._fs = _OneAtATime(self._fs, _MEMORY)
        if protocol in ("s3", "s3a"):
            self._fs.retries = 1  # s3fs's own retry loop: off, the Uploader retries
        if not (protocol == "memory"
                or (protocol in ("s3", "s3a") and _conditional_put(self._fs))):
            # no atomic create-if-absent here: callers see none and fall back
            self.create_file = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"FsspecStorage({self.protocol!r}, {redact_options(self._options)!r})"

    def _p(self, path: str) -> str:
        proto, rest = split_protocol(path)
        if proto != self.protocol:
            raise StorageError(f"{path} is not a {self.protocol}:// path")
        return rest if proto != "memory" else "/" + rest.lstrip("/")

    def _url(self, p: str) -> str:
        return f"{self.protocol}://{p.lstrip('/')}"

    def write_file(self, path: str, data: bytes) -> None:
        try:
            if self.protocol in ("s3", "s3a") and len(data) >= self.multipart_threshold:
                # s3fs goes multipart when size >= 2 * chunksize; it aborts the upload on error
                part = max(S3_MIN_PART, self.multipart_threshold // 2)
                self._fs.pipe_file(self._p(path), data, chunksize=part)
                self.multipart_uploads += 1
            else:
                self._fs.pipe_file(self._p(path), data)
        except Exception as e:  # noqa: BLE001 - any client error becomes a StorageError
            raise StorageError(f"cannot write {path}: {type(e).__name__}: {e}") from e

    def write_from(self, path: str, local_path: str) -> None:
        """Upload the local file ``local_path`` as ``path``, streamed (S3: multipart above
        the threshold, parts of half of it; s3fs aborts the upload on error)."""
        try:
            if self.protocol in ("s3", "s3a"):
                part = max(S3_MIN_PART, self.multipart_threshold // 2)
                self._fs.put_file(local_path, self._p(path), chunksize=part)
            else:
                self._fs.put_file(local_path, self._p(path))
        except Exception as e:  # noqa: BLE001 - any client error becomes a StorageError
            raise StorageError(f"cannot write {path} from {local_path}: {type(e).__name__}: "
                               f"{e}") from e

    def create_file(self, path: str, data: bytes) -> bool:
        """Write ``path`` only if it does not exist yet, atomically: False if it exists
        (someone else created it). ``memory://`` creates under a process-wide lock; S3 puts
        with ``If-None-Match: *`` (the server refuses the put when the key exists)."""
        p = self._p(path)
        try:
            if self.protocol == "memory":
                with _MEMORY:
                    if self._fs.exists(p):
                        return False
                    self._fs.pipe_file(p, data)
                return True
            self._fs.pipe_file(p, data, mode="create")
            return True
        except FileExistsError:
            return False
        except Exception as e:  # noqa: BLE001 - any client error becomes a StorageError
            raise StorageError(f"cannot create {path}: {type(e).__name__}: {e}") from e

    def append_file(self, path: str, data: bytes) -> int:
        """``memory://`` only: object stores make a file visible only once it is closed."""
        if self.protocol != "memory":
            raise StorageError(f"cannot append to {path}: {self.protocol}:// objects are "
                               f"readable only once closed")
        p = self._p(path)
        try:
            with _MEMORY:  # (two appends at once: each keeps the other's bytes)
                old = self._fs.cat_file(p) if self._fs.exists(p) else b""
                self._fs.pipe_file(p, old + data)
            return len(old)
        except Exception as e:  # noqa: BLE001
            raise StorageError(f"cannot append to {path}: {type(e).__name__}: {e}") from e

    def read_file(self, path: str) -> bytes:
        try:
            return self._fs.cat_file(self._p(path))
        except Exception as e:  # noqa: BLE001
            raise StorageError(f"cannot read {path}: {type(e).__name__}: {e}") from e

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        _check_range(path, offset, length)
        p = self._p(path)
        try:
            if length == 0:
                # an empty range is "bytes=N-(N-1)", which S3 ignores: it answers the whole
                # object. Nothing to read, but a missing file is still an error.
                if not self._fs.exists(p):
                    raise FileNotFoundError(p)
                return b""
            return self._fs.cat_file(p, start=offset, end=offset + length)
        except Exception as e:  # noqa: BLE001
            if self._starts_past_end(p, offset):
                return b""  # S3 answers 416 for a range from the end on: the contract says none
            raise StorageError(
                f"cannot read {path} [{offset}:+{length}]: {type(e).__name__}: {e}") from e

    def _starts_past_end(self, p: str, offset: int) -> bool:
        """``offset`` is at or past the end of the existing file ``p`` (asked only after a
        read failed, so a whole read costs no extra request)."""
        try:
            return offset >= int(self._fs.size(p))
        except Exception:  # noqa: BLE001 - missing or unreachable: the read's error stands
            return False

    def delete(self, path: str) -> None:
        try:
            self._fs.rm_file(self._p(path))
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001
            raise StorageError(f"cannot delete {path}: {type(e).__name__}: {e}") from e

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists; a client error (the store unreachable) is a
        :class:`StorageError`, never False: a lease's fencing check asks this."""
        try:
            return bool(self._fs.exists(self._p(path)))
        except Exception as e:  # noqa: BLE001 - any client error becomes a StorageError
            raise StorageError(f"cannot check {path}: {type(e).__name__}: {e}") from e

    def list_files(self, prefix: str) -> list[str]:
        try:
            found = self._fs.find(self._p(prefix))
        except FileNotFoundError:
            return []
        except Exception as e:  # noqa: BLE001 - any client error becomes a StorageError
            raise StorageError(f"cannot list {prefix}: {type(e).__name__}: {e}") from e
        return sorted(self._url(p) for p in found)
