"""Incremental materialization of the ``rocksdb`` state table (Flink's incremental RocksDB
checkpoints under FLIP-158 "Materializing state changes", step 3) and its way back.

Uploading (:class:`SstUploads`): a materialization of the rocksdb table is a local RocksDB
checkpoint (:class:`LocalCheckpoint`: hard links to the database's immutable SST files).
Only SST files not uploaded before are uploaded, in parallel (at most :data:`PARALLEL` at
once); the others are named again by the new :class:`~dstl_ray.format.incremental.RocksDBHandle`,
so the shared state registry keeps them while any checkpoint or the backend's base names them.
RocksDB never reuses an SST file's name within one database, and an SST file never changes,
so a local name identifies its bytes.

Downloading (:func:`download`): a restore takes the files kept on this machine
(:mod:`dstl_ray.state.local_recovery`), fetches the others in parallel, checks each
one's size and CRC32C (a missing, short or corrupt file raises an error naming it) and lays
them out as a RocksDB directory, which the rocksdb table opens as its database or copies from
(:mod:`dstl_ray.state.rocksdb`); :func:`read_changes` turns one into change records for any
other reader (the heap table, fuzzers, tools).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import google_crc32c
from rocksdict import AccessType, Options, Rdict

from ..errors import FormatError, LocalStateError, StorageError
from ..format.incremental import (
    BUNDLE_SUFFIX,
    SST_SUFFIX,
    RocksDBHandle,
    UploadedFile,
    decode_bundle,
    encode_bundle,
    local_name_ok,
)
from ..format.materialized import StatesSpec
from ..keygroups import KeyGroupRange
from ..storage.base import COPY_CHUNK, Storage, join, write_local_file
from ..storage.deleter import Deleter
from ..storage.registry import get_storage
from .local_recovery import LocalRecovery
from .records import StateKind, encode_full
from .rocksdb_keys import entries

T = TypeVar("T")
R = TypeVar("R")
PARALLEL = 4  # files up- or downloaded at once per backend (streamed: COPY_CHUNK each)
_IO = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="dstl-sst")


def crc32c_of(data: bytes) -> int:
    return google_crc32c.value(data)


def file_crc32c(path: str) -> int:
    """CRC32C of a local file, read :data:`COPY_CHUNK` bytes at a time."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(COPY_CHUNK):
            crc = google_crc32c.extend(crc, chunk)
    return crc


@dataclass
class LocalCheckpoint:
    """A RocksDB checkpoint in a local directory; :meth:`close` deletes it. ``recovery``
    keeps the files of its upload for a restore on this machine (task-local recovery)."""

    path: str
    recovery: LocalRecovery | None = None
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            shutil.rmtree(self.path, ignore_errors=True)


def _bounded(fn: Callable[[T], R], items: list[T]) -> list[R]:
    """``[fn(x) for x in items]`` on the I/O pool, at most :data:`PARALLEL` at once; the
    first error is raised after every started call ended."""
    out: list[Any] = [None] * len(items)
    sem = threading.Semaphore(PARALLEL)

    def run(i: int) -> None:
        try:
            out[i] = fn(items[i])
        finally:
            sem.release()

    futures = []
    for i in range(len(items)):
        sem.acquire()
        futures.append(_IO.submit(run, i))
        if futures[-1].done() and futures[-1].exception() is not None:
            break
    concurrent.futures.wait(futures)
    for f in futures:
        if f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    return out


class SstUploads:
    """The SST files of one rocksdb table's database uploaded so far, and where: what the
    next materialization may name instead of uploading again."""

    def __init__(self, storage: Storage, job_path: str, job_id: str,
                 deleter: Deleter) -> None:
        self._storage, self._job_path, self._job_id = storage, job_path, job_id
        self._deleter = deleter
        self._lock = threading.Lock()
        self.known: dict[str, UploadedFile] = {}  # local SST name -> its upload
        self.uploaded_bytes = 0  # by the last materialization (SSTs and bundle)

    def seed(self, files: dict[str, UploadedFile]) -> None:
        """After a restore that opened a handle of this job as the database: its SST files
        are uploaded already."""
        with self._lock:
            self.known.update(files)

    def names(self) -> frozenset[str]:
        """The local names of the SST files uploaded so far."""
        with self._lock:
            return frozenset(self.known)

    def upload(self, ckpt: LocalCheckpoint, key_groups: KeyGroupRange, states: StatesSpec,
               sqn: int) -> RocksDBHandle:
        """Upload what ``ckpt`` holds that is not uploaded yet and return its handle. On
        failure, what this call uploaded is deleted again (no checkpoint names it)."""
        names = sorted(os.listdir(ckpt.path))
        ssts = [n for n in names if n.endswith(SST_SUFFIX)]
        private = [n for n in names if not n.endswith(SST_SUFFIX) and local_name_ok(n)]
        with self._lock:
            known = dict(self.known)
        sizes = {n: os.path.getsize(os.path.join(ckpt.path, n)) for n in ssts}
        new = [n for n in ssts if n not in known or known[n].size != sizes[n]]
        done: list[str] = []  # URLs written by this call

        def put(name: str, data: bytes, suffix: str) -> UploadedFile:
            rel = f"mat/{uuid.uuid4().hex}{suffix}"
            url = join(self._job_path, rel)
            done.append(url)
            self._storage.write_file(url, data)
            return UploadedFile(name, rel, len(data), crc32c_of(data))

        def put_sst(name: str) -> UploadedFile:
            """Streamed: an SST of a big database may be larger than memory allows."""
            local = os.path.join(ckpt.path, name)
            rel = f"mat/{uuid.uuid4().hex}{SST_SUFFIX}"
            url = join(self._job_path, rel)
            crc = file_crc32c(local)
            done.append(url)  # before the write: a failed one may leave a partial object
            write_local_file(self._storage, url, local)
            return UploadedFile(name, rel, sizes[name], crc)

        try:
            uploaded = dict(zip(new, _bounded(put_sst, new), strict=True))
            bundle_files = []
            for n in private:
                with open(os.path.join(ckpt.path, n), "rb") as f:
                    bundle_files.append((n, f.read()))
            bundle = put("bundle", encode_bundle(bundle_files), BUNDLE_SUFFIX)
        except BaseException:
            for url in done:
                self._deleter.delete(self._storage, url)
            raise
        files = tuple(uploaded.get(n) or known[n] for n in ssts)
        with self._lock:
            self.known = {f.name: f for f in files}  # older SSTs are gone from the database
            self.uploaded_bytes = sum(f.size for f in uploaded.values()) + bundle.size
        handle = RocksDBHandle(self._job_id, key_groups, states, files, bundle, sqn)
        if ckpt.recovery is not None:
            ckpt.recovery.keep(ckpt.path, handle, self._job_path)
        return handle


def download(handle: RocksDBHandle, base_path: str, dest: str,
             storage: Storage | None = None, local: LocalRecovery | None = None) -> None:
    """Lay ``handle``'s files out in the new directory ``dest`` as a RocksDB database,
    fetching at most :data:`PARALLEL` at once; with ``local``, the SST files kept on this
    machine are hard-linked instead (task-local recovery). Every file's size and CRC32C is
    checked; a file that is missing, short or corrupt raises an error naming its URL
    (:class:`~dstl_ray.errors.StorageError` or :class:`~dstl_ray.errors.FormatError`)."""
    root = join(base_path, handle.job)
    _local(dest, os.makedirs, dest)

    def local_ok(f: UploadedFile, path: str) -> bool:
        return os.path.getsize(path) == f.size and file_crc32c(path) == f.crc

    def check(f: UploadedFile, url: str, size: int, crc: int) -> None:
        if size != f.size:
            raise FormatError(f"file has {size} bytes, the handle says {f.size} "
                              f"(RocksDB {f.name})", path=url)
        if crc != f.crc:
            raise FormatError(f"CRC32C mismatch (stored {f.crc:#010x}, computed "
                              f"{crc:#010x}; RocksDB {f.name})", path=url)

    def fetch(f: UploadedFile) -> bytes:
        url = join(root, f.path)
        data = (storage or get_storage(url)).read_file(url)
        check(f, url, len(data), crc32c_of(data))
        return data

    def fetch_sst(f: UploadedFile) -> None:
        """Streamed in ranges of COPY_CHUNK bytes: an SST may be larger than memory allows;
        one byte past the handle's size is asked for, so a longer file is noticed."""
        url = join(root, f.path)
        st = storage or get_storage(url)
        local = os.path.join(dest, f.name)
        crc, size = 0, 0
        with _local(local, open, local, "xb") as out:  # never into a linked file
            while True:
                chunk = st.read_range(url, size, min(COPY_CHUNK, f.size + 1 - size))
                if not chunk:
                    break
                crc = google_crc32c.extend(crc, chunk)
                size += len(chunk)
                _local(local, out.write, chunk)
                if size > f.size:
                    break
        if size == 0 and not st.exists(url):
            raise StorageError(f"file not found: {url} (RocksDB {f.name})")
        check(f, url, size, crc)

    def confirm(f: UploadedFile) -> None:
        """A file taken from the local copy is still on the DFS, at its size: the next
        checkpoints name it, and a restore on another machine must find it."""
        url = join(root, f.path)
        st = storage or get_storage(url)
        tail = st.read_range(url, f.size - 1, 2) if f.size else b""
        if not tail and not st.exists(url):
            raise StorageError(f"file not found: {url} (RocksDB {f.name})")
        if len(tail) != min(f.size, 1):
            raise FormatError(f"file is {'longer' if len(tail) > 1 else 'shorter'} than the "
                              f"{f.size} bytes the handle says (RocksDB {f.name})", path=url)

    here = _local(dest, local.take, handle, root, dest, local_ok) if local is not None \
        else set()
    _bounded(confirm, [f for f in handle.ssts if f.name in here])
    _bounded(fetch_sst, [f for f in handle.ssts if f.name not in here])
    bundle_url = join(root, handle.bundle.path)
    for name, data in decode_bundle(fetch(handle.bundle), bundle_url):
        _write_local(os.path.join(dest, name), data)


def _local(path: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on the local disk: its errors (a full disk) are
    :class:`~dstl_ray.errors.LocalStateError` naming ``path``, not a checkpoint's fault."""
    try:
        return fn(*args)
    except OSError as e:
        raise LocalStateError(f"local state directory {path}: {e}") from e


def _write_local(path: str, data: bytes) -> None:
    def write() -> None:
        with open(path, "xb") as out:
            out.write(data)
    _local(path, write)


def read_changes(handle: RocksDBHandle, base_path: str, key_groups: KeyGroupRange,
                 storage: Storage | None = None, local_dir: str | None = None
                 ) -> Iterator[tuple[int, list[bytes]]]:
    """(key group, change records) of ``handle`` within ``key_groups``: the records that
    recreate its entries (as a materialized file holds them), in the state ids of the
    handle's spec. Downloads the database into a temporary directory, deleted afterwards."""
    tmp = tempfile.mkdtemp(prefix="dstl-rocksdb-read-", dir=local_dir)
    try:
        path = os.path.join(tmp, "db")
        download(handle, base_path, path, storage)
        db = Rdict(path, Options(raw_mode=True), access_type=AccessType.read_only())
        try:
            kinds = [StateKind(s[1]) for s in handle.states]
            for kg in key_groups:
                recs: list[bytes] = []
                for sid, kind in enumerate(kinds):
                    for key, value in entries(db, kg, sid, kind):
                        recs += encode_full(sid, kind, key, value)
                if recs:
                    yield kg, recs
        finally:
            db.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

