"""The conformance suite of the :class:`~dstl_ray.storage.base.Storage` protocol: what the upload
path, the readers (handles, checkpoints), the orphan cleanup and FLIP-306's merged files rely on,
checked the same way for every backend (after fsspec's ``fsspec/tests/abstract``).

Bind it with a small class that provides two fixtures, ``storage`` and ``base`` (the URL of a
fresh, empty directory on it)::

    class TestMyStorage(StorageSuite):
        @pytest.fixture
        def storage(self):
            return MyStorage()

        @pytest.fixture
        def base(self, tmp_path):
            return f"my://{tmp_path.name}"

Optional fixtures: ``appendable`` (the backend keeps appended bytes readable at once, FLIP-306
"SEGMENTED_ACROSS_CP_BOUNDARY"; default: :func:`~dstl_ray.storage.base.supports_append` of ``base``)
and ``large_size`` (bytes of the large-file case; a backend with a multipart path sets it above
its threshold). Needs pytest; ``dstl_ray.testing`` does not import this module.

What is not in the contract, so not checked: several appenders on one file at once (the merged
files hand each physical file to one appender at a time), directories as entries of their own.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from ..errors import StorageError
from ..storage.base import (
    MiB,
    Storage,
    join,
    split_protocol,
    supports_append,
    write_local_file,
)


def _payload(tag: str, size: int) -> bytes:
    """``size`` bytes that differ for each ``tag`` and at every offset (so a wrong range or a
    mixed-up file cannot pass for the right one)."""
    seed = tag.encode()
    block = (seed + bytes(range(256))) * (1 + size // (len(seed) + 256))
    return block[:size]


class StorageSuite:
    """Test methods every :class:`~dstl_ray.storage.base.Storage` must pass."""

    # ------------------------------------------------------------------ fixtures to bind

    @pytest.fixture
    def storage(self) -> Storage:
        raise NotImplementedError("bind the suite: provide a `storage` fixture")

    @pytest.fixture
    def base(self) -> str:
        raise NotImplementedError("bind the suite: provide a `base` fixture (an empty dir URL)")

    @pytest.fixture
    def appendable(self, base: str) -> bool:
        return supports_append(base)

    @pytest.fixture
    def large_size(self) -> int:
        return 3 * MiB + 17

    # ------------------------------------------------------------------ whole files

    def test_is_a_storage(self, storage):
        assert isinstance(storage, Storage)

    def test_write_then_read_returns_the_bytes(self, storage, base):
        url = join(base, "a.bin")
        data = bytes(range(256)) * 3
        storage.write_file(url, data)
        assert storage.read_file(url) == data

    def test_empty_file(self, storage, base):
        url = join(base, "empty")
        storage.write_file(url, b"")
        assert storage.exists(url)
        assert storage.read_file(url) == b""
        assert storage.read_range(url, 0, 10) == b""
        assert storage.list_files(base) == [url]

    def test_write_replaces_an_existing_file_whole(self, storage, base):
        url = join(base, "f")
        storage.write_file(url, _payload("long", 5000))
        storage.write_file(url, b"short")
        assert storage.read_file(url) == b"short"

    def test_nested_paths_need_no_directories_made_first(self, storage, base):
        url = join(base, "job", "dstl", "node-1", "x.dstl")
        storage.write_file(url, b"deep")
        assert storage.read_file(url) == b"deep"
        assert storage.exists(url)

    def test_names_with_spaces_and_equals_signs(self, storage, base):
        url = join(base, "job id=7 a", "part=1 %41.bin")
        storage.write_file(url, b"odd name")
        assert storage.read_file(url) == b"odd name"
        assert storage.list_files(base) == [url]

    def test_large_file(self, storage, base, large_size):
        url = join(base, "large.bin")
        data = _payload("large", large_size)
        storage.write_file(url, data)
        assert storage.read_file(url) == data
        mid = large_size // 2
        assert storage.read_range(url, mid - 1000, 4000) == data[mid - 1000:mid + 3000]
        assert storage.read_range(url, large_size - 5, 100) == data[-5:]

    def test_a_local_file_is_written_whole_streamed_or_not(self, storage, base, large_size,
                                                             tmp_path):
        """``write_local_file`` (SST uploads of the rocksdb state table): streamed where
        the storage has ``write_from``, read whole otherwise; the bytes arrive either way,
        nested directories need not exist, and a missing local file names it."""
        data = _payload("local", large_size)
        local = tmp_path / "sst.bin"
        local.write_bytes(data)
        url = join(base, "job", "mat", "x.sst")
        write_local_file(storage, url, str(local))
        assert storage.read_file(url) == data
        write_local_file(storage, url, str(local))  # again: replaced whole
        assert storage.read_file(url) == data and storage.list_files(base) == [url]
        with pytest.raises((StorageError, OSError)) as ei:
            write_local_file(storage, join(base, "y.sst"), str(tmp_path / "missing"))
        assert "missing" in str(ei.value)

    def test_a_rewrite_is_never_seen_half_done(self, storage, base):
        """write_file is all or nothing: a reader sees the old or the new file, never a mix,
        a prefix or no file."""
        url = join(base, "swap")
        versions = [bytes([65 + i]) * 64 * 1024 for i in range(2)]
        storage.write_file(url, versions[0])
        stop = threading.Event()
        seen: list[bytes] = []

        def read() -> None:
            while not stop.is_set():
                seen.append(storage.read_file(url))

        reader = threading.Thread(target=read)
        reader.start()
        try:
            for i in range(20):
                storage.write_file(url, versions[(i + 1) % 2])
        finally:
            stop.set()
            reader.join(timeout=60)
        assert seen, "the reader never got a turn"
        assert all(s in versions for s in seen), {len(s) for s in seen if s not in versions}

    def test_writes_from_many_threads(self, storage, base):
        """The uploader writes from a thread pool: distinct files at once all land whole."""
        urls = [join(base, f"t{i}", "f.bin") for i in range(16)]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda u: storage.write_file(u, _payload(u, 10_000)), urls))
        for u in urls:
            assert storage.read_file(u) == _payload(u, 10_000)
        assert storage.list_files(base) == sorted(urls)

    # ------------------------------------------------------------------ ranges

    def test_read_range(self, storage, base):
        url = join(base, "r.bin")
        data = _payload("range", 1000)
        storage.write_file(url, data)
        assert storage.read_range(url, 0, 1000) == data
        assert storage.read_range(url, 10, 20) == data[10:30]
        assert storage.read_range(url, 999, 1) == data[999:]
        assert storage.read_range(url, 990, 50) == data[990:]  # fewer at the end of the file
        assert storage.read_range(url, 1000, 10) == b""  # none past it
        assert storage.read_range(url, 5000, 10) == b""

    def test_a_zero_length_range_is_empty(self, storage, base):
        url = join(base, "z.bin")
        storage.write_file(url, _payload("zero", 100))
        assert storage.read_range(url, 0, 0) == b""
        assert storage.read_range(url, 50, 0) == b""

    def test_a_forged_huge_length_reads_what_the_file_holds(self, storage, base):
        """Offsets and lengths come from handles, which may be forged: the answer is what the
        file holds, and nothing of the asked size is allocated."""
        url = join(base, "h.bin")
        data = _payload("huge", 300)
        storage.write_file(url, data)
        assert storage.read_range(url, 100, 2**62) == data[100:]

    def test_a_negative_range_is_refused_naming_the_file(self, storage, base):
        url = join(base, "n.bin")
        storage.write_file(url, b"0123456789")
        for offset, length in ((-1, 4), (2, -1)):
            with pytest.raises(StorageError, match="n.bin"):
                storage.read_range(url, offset, length)

    # ------------------------------------------------------------------ missing files, errors

    def test_reading_a_missing_file_raises_storage_error_naming_it(self, storage, base):
        url = join(base, "nowhere", "missing.bin")
        with pytest.raises(StorageError, match="missing.bin"):
            storage.read_file(url)
        for offset, length in ((0, 10), (0, 0), (5, 1)):
            with pytest.raises(StorageError, match="missing.bin"):
                storage.read_range(url, offset, length)

    def test_a_path_of_another_protocol_is_refused_naming_it(self, storage, base):
        proto = split_protocol(base)[0]
        other = "memory" if proto != "memory" else "file"
        url = f"{other}://elsewhere/wrong-store.bin"
        for call in (lambda: storage.write_file(url, b"x"), lambda: storage.read_file(url),
                     lambda: storage.read_range(url, 0, 1)):
            with pytest.raises(StorageError, match="wrong-store.bin"):
                call()

    # ------------------------------------------------------------------ exists, delete

    def test_exists_follows_write_and_delete(self, storage, base):
        url = join(base, "e", "x")
        assert not storage.exists(url)
        storage.write_file(url, b"1")
        assert storage.exists(url)
        storage.delete(url)
        assert not storage.exists(url)
        with pytest.raises(StorageError, match="e/x"):
            storage.read_file(url)

    def test_deleting_a_missing_file_is_not_an_error(self, storage, base):
        storage.delete(join(base, "never", "written"))
        url = join(base, "twice")
        storage.write_file(url, b"1")
        storage.delete(url)
        storage.delete(url)
        assert not storage.exists(url)

    def test_delete_removes_that_file_only(self, storage, base):
        keep, gone = join(base, "d", "keep"), join(base, "d", "gone")
        storage.write_file(keep, b"k")
        storage.write_file(gone, b"g")
        storage.delete(gone)
        assert storage.list_files(base) == [keep]
        assert storage.read_file(keep) == b"k"

    # ------------------------------------------------------------------ listing

    def test_list_is_recursive_sorted_full_urls_that_read_back(self, storage, base):
        names = ["b", "a/1", "a/2", "a/sub/3", "c/d/e/4"]
        for n in names:
            storage.write_file(join(base, n), n.encode())
        listed = storage.list_files(base)
        assert listed == sorted(join(base, n) for n in names)
        for url in listed:
            assert split_protocol(url)[0] == split_protocol(base)[0]
            assert storage.read_file(url) == url[len(base) + 1:].encode()

    def test_list_takes_a_directory_not_a_name_prefix(self, storage, base):
        """``list_files(.../job)`` is the job's directory: not ``job2`` nor ``job.meta``."""
        inside = join(base, "job", "f")
        for n in ("job/f", "job2/g", "job.meta", "jobx"):
            storage.write_file(join(base, n), b"x")
        assert storage.list_files(join(base, "job")) == [inside]
        assert storage.list_files(join(base, "job") + "/") == [inside]

    def test_list_of_a_missing_directory_is_empty(self, storage, base):
        assert storage.list_files(join(base, "no", "such", "dir")) == []
        assert storage.list_files(base) == []

    def test_list_forgets_deleted_files(self, storage, base):
        a, b = join(base, "l", "a"), join(base, "l", "b")
        storage.write_file(a, b"a")
        storage.write_file(b, b"b")
        storage.delete(a)
        assert storage.list_files(join(base, "l")) == [b]
        storage.delete(b)
        assert storage.list_files(join(base, "l")) == []

    # ------------------------------------------------------------------ appends (FLIP-306)

    def test_append_returns_offsets_and_keeps_bytes_readable(self, storage, base, appendable):
        if not appendable:
            pytest.skip("this storage does not append (see the refusal case)")
        url = join(base, "merged", "m.dsts")
        parts = [_payload(f"p{i}", n) for i, n in enumerate((10, 0, 4096, 1))]
        offset = 0
        for p in parts:
            assert storage.append_file(url, p) == offset
            offset += len(p)
            # readable at once, before the file is closed for good
            assert storage.read_file(url) == b"".join(parts)[:offset]
        whole = b"".join(parts)
        assert storage.read_range(url, 10, 4096) == parts[2]
        assert storage.list_files(base) == [url]
        assert storage.read_file(url) == whole

    def test_append_continues_a_written_file(self, storage, base, appendable):
        if not appendable:
            pytest.skip("this storage does not append")
        url = join(base, "w")
        storage.write_file(url, b"12345")
        assert storage.append_file(url, b"678") == 5
        assert storage.read_file(url) == b"12345678"

    def test_append_after_delete_starts_again_at_zero(self, storage, base, appendable):
        """The merged files notice a file deleted under them (recovery's orphan cleanup) by
        an offset lower than they expected."""
        if not appendable:
            pytest.skip("this storage does not append")
        url = join(base, "again")
        storage.append_file(url, b"abc")
        storage.delete(url)
        assert storage.append_file(url, b"xy") == 0
        assert storage.read_file(url) == b"xy"

    def test_append_is_refused_naming_the_file_where_unsupported(self, storage, base,
                                                                 appendable):
        if appendable:
            pytest.skip("this storage appends")
        url = join(base, "no-append.dsts")
        with pytest.raises(StorageError, match="no-append.dsts"):
            storage.append_file(url, b"x")
        assert not storage.exists(url)

    # ------------------------------------------------------------------ create if absent

    def test_create_file_only_if_absent(self, storage, base):
        """``create_file`` is optional (the job lease uses it where the store has it): True
        once, then False without touching the file."""
        create = getattr(storage, "create_file", None)
        if create is None:
            pytest.skip("this storage has no create_file")
        url = join(base, "lease", "lease.json")
        assert create(url, b"first") is True
        assert create(url, b"second") is False
        assert storage.read_file(url) == b"first"
        assert storage.list_files(base) == [url]  # no temp file left beside it
