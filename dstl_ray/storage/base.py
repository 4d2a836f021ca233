"""The storage contract (``Storage``) and URL helpers every backend shares."""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

from ..errors import StorageError

MiB = 1024 * 1024


S3_MIN_PART = 5 * MiB
COPY_CHUNK = 8 * MiB  # what a streamed copy holds in memory at once


def write_local_file(storage: Storage, path: str, local_path: str) -> None:
    """Write the local file ``local_path`` as ``path``: streamed by a storage that offers
    ``write_from(path, local_path)`` (local files, fsspec), read whole otherwise."""
    write_from = getattr(storage, "write_from", None)
    if write_from is not None:
        write_from(path, local_path)
        return
    with open(local_path, "rb") as f:
        storage.write_file(path, f.read())


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
        if url.startswith("file:/"):  # RFC 8089's short form of a local file's URL
            return "file", os.path.abspath(url[len("file:"):])
        return "file", os.path.abspath(url)
    proto, rest = url.split("://", 1)
    return proto, rest


_COLLAPSING = ("s3", "s3a")  # s3fs lists ``bk//x/f`` as ``bk/x/f``


def normalize_url(url: str) -> str:
    """The one spelling of the file or directory at ``url``: the form its storage lists it
    under (``list_files``), so two spellings of one file compare equal. Every URL the
    project builds starts from it, and every key made of a URL (the shared state registry's,
    orphan cleanup's, a restore's "is this the job's own directory") is it.

    ``/a/b`` and ``file:////a//b/`` -> ``file:///a/b`` (a local path, made absolute and
    normalized; POSIX keeps a leading ``//``, Linux treats it as ``/``); ``memory:///m/f`` ->
    ``memory://m/f`` (fsspec's memory store has one root; its listings name no leading
    ``/``); ``s3://bk//x/f`` -> ``s3://bk/x/f`` (s3fs's listings collapse repeated slashes, so
    a file written under the other spelling would never be found by a listing of its
    directory); trailing slashes removed everywhere.

    A URL with a protocol has one answer whatever the process does (a bare path's, or a
    ``file://`` URL's relative path's, depends on the working directory), so its answer is
    kept (:data:`_NORMALIZED`): a checkpoint's completion normalizes every file it names,
    the same files checkpoint after checkpoint until the next materialization."""
    known = _NORMALIZED.get(url)
    if known is not None:
        return known
    out = _normalize(url)
    if url.startswith("file:///") or ("://" in url and not url.startswith("file://")):
        if len(_NORMALIZED) >= _NORMALIZED_MAX:
            _NORMALIZED.clear()  # (a bound, not an LRU: a rebuild costs one pass)
        _NORMALIZED[url] = out
    return out


# normalize_url's answers that are pure functions of the URL, bounded
_NORMALIZED: dict[str, str] = {}
_NORMALIZED_MAX = 1 << 14


def _normalize(url: str) -> str:
    proto, rest = split_protocol(url)
    if proto == "file":
        rest = "/" + os.path.abspath(rest).lstrip("/")
    elif proto == "memory":
        rest = rest.strip("/")
    elif proto in _COLLAPSING:
        rest = "/".join(p for p in rest.split("/") if p)
    return f"{proto}://{rest.rstrip('/') or '/'}"


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


APPENDABLE = ("file", "memory")  # files readable while still being appended to


def supports_append(url: str) -> bool:
    return split_protocol(url)[0] in APPENDABLE


def _check_range(path: str, offset: int, length: int) -> None:
    if offset < 0 or length < 0:
        raise StorageError(f"cannot read {path} [{offset}:+{length}]: negative range")
