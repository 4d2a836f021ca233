"""Storage over fsspec URLs.

``file://`` (the default) writes through a temp file, fsync and rename, so a reader never
sees a half-written file; ``memory://`` is for unit tests in one process; ``s3://`` goes
through s3fs as one put (multipart only when large). Paths are full URLs; storages are cached
per (protocol, options) in each process.

S3 options (:func:`s3_options`): endpoint and credentials come from the config
(``s3_endpoint_url``, ``s3_access_key_id``, ``s3_secret_access_key``, ``storage_options``) or
else the standard variables (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``) and the AWS credential
chain. The client's own retries are off: dstl-ray's :class:`~dstl_ray.upload.Uploader` owns the
retry policy and hedging, so attempts are counted honestly. Credentials are never logged: a
storage's ``repr`` shows its options redacted.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import fsspec

from .config import ChangelogConfig, parse_json_object, redact_options
from .errors import StorageError
from .testing.faults import FaultyStorage

MiB = 1024 * 1024
S3_MIN_PART = 5 * MiB


@runtime_checkable
class Storage(Protocol):
    """What dstl-ray needs from a file system; implement it to plug in another store."""

    def write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` as the whole, new file ``path``: all or nothing."""

    def read_file(self, path: str) -> bytes: ...

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """At most ``length`` bytes from ``offset`` (fewer at the end of the file, none past
        it). ``offset`` and ``length`` may come from a forged handle: never allocate
        ``length`` bytes before knowing the file holds them."""

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


APPENDABLE = ("file", "memory")  # files readable while still being appended to


def supports_append(url: str) -> bool:
    return split_protocol(url)[0] in APPENDABLE


def _check_range(path: str, offset: int, length: int) -> None:
    if offset < 0 or length < 0:
        raise StorageError(f"cannot read {path} [{offset}:+{length}]: negative range")


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
        if protocol in ("s3", "s3a"):
            self._fs.retries = 1  # s3fs's own retry loop: off, the Uploader retries

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

    def append_file(self, path: str, data: bytes) -> int:
        """``memory://`` only: object stores make a file visible only once it is closed."""
        if self.protocol != "memory":
            raise StorageError(f"cannot append to {path}: {self.protocol}:// objects are "
                               f"readable only once closed")
        p = self._p(path)
        try:
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
        return bool(self._fs.exists(self._p(path)))

    def list_files(self, prefix: str) -> list[str]:
        try:
            found = self._fs.find(self._p(prefix))
        except FileNotFoundError:
            return []
        return sorted(self._url(p) for p in found)


_cache: dict[tuple[str, str], Storage] = {}
_lock = threading.Lock()


def _env(*names: str) -> str:
    for n in names:
        v = os.environ.get(n)
        if v:
            return v
    return ""


def s3_options(config: ChangelogConfig | None = None) -> dict[str, Any]:
    """s3fs options: config first, then the standard AWS variables; the client's retries
    are off (the Uploader owns the retry policy). Contains credentials: never log it."""
    endpoint = (config.s3_endpoint_url if config else "") or _env(
        "DSTL_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    key = (config.s3_access_key_id if config else "") or _env("AWS_ACCESS_KEY_ID")
    secret = (config.s3_secret_access_key if config else "") or _env("AWS_SECRET_ACCESS_KEY")
    opts: dict[str, Any] = {
        "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 1}}}
    if endpoint:
        opts["endpoint_url"] = endpoint
    if key and secret:
        opts["key"], opts["secret"] = key, secret
        token = _env("AWS_SESSION_TOKEN")
        if token and not (config and config.s3_access_key_id):
            opts["token"] = token
    region = _env("AWS_REGION", "AWS_DEFAULT_REGION")
    if region:
        opts["client_kwargs"] = {"region_name": region}
    extra = parse_json_object("storage_options", config.storage_options) if config else {}
    for k, v in extra.items():  # nested dicts merge, so a region does not drop the retries
        if isinstance(v, dict) and isinstance(opts.get(k), dict):
            opts[k] = {**opts[k], **v}
        else:
            opts[k] = v
    json.dumps(opts)  # options must be plain data (they key the cache)
    return opts


def get_storage(url: str, options: Mapping[str, Any] | None = None,
                multipart_threshold: int | None = None) -> Storage:
    """The (cached) storage for ``url``'s protocol. ``s3://`` without ``options`` takes them
    from the environment (:func:`s3_options`)."""
    proto, _ = split_protocol(url)
    if options is None and proto in ("s3", "s3a"):
        options = s3_options()
    key = (proto, json.dumps([options or {}, multipart_threshold], sort_keys=True,
                             default=repr))
    with _lock:
        st = _cache.get(key)
        if st is None:
            if proto == "file":
                st = LocalStorage()
            elif multipart_threshold is not None:
                st = FsspecStorage(proto, options, multipart_threshold)
            else:
                st = FsspecStorage(proto, options)
            _cache[key] = st
        return st


def storage_for(url: str, config: ChangelogConfig) -> Storage:
    """The storage a node (or direct transport) writes ``url`` with under ``config``:
    S3 options from the config, wrapped in fault injection when ``fault_spec`` is set (a
    fresh wrapper per call, so each uploader has its own fault script)."""
    proto, _ = split_protocol(url)
    if proto in ("s3", "s3a"):
        st = get_storage(url, s3_options(config), config.s3_multipart_threshold)
    else:
        st = get_storage(url, parse_json_object("storage_options", config.storage_options)
                         or None)
    if config.fault_spec:
        st = FaultyStorage(st, config.fault_spec)
    return st
