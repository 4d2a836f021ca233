"""The Storage conformance suite (dstl_ray.testing.storage_suite) on the storages of one
process: local files, memory, and the fault-injecting wrapper with no faults configured."""

from __future__ import annotations

import uuid

import pytest

from dstl_ray.storage import unnamed
from dstl_ray.storage.fsspec import FsspecStorage
from dstl_ray.storage.local import LocalStorage
from dstl_ray.storage.registry import get_storage
from dstl_ray.testing.faults import FaultSpec, FaultyStorage
from dstl_ray.testing.storage_suite import StorageSuite


class TestLocalStorage(StorageSuite):
    @pytest.fixture
    def storage(self):
        return LocalStorage()

    @pytest.fixture
    def base(self, tmp_path):
        return f"file://{tmp_path}/store"


class TestMemoryStorage(StorageSuite):
    @pytest.fixture
    def storage(self):
        st = get_storage("memory://x")
        assert isinstance(st, FsspecStorage)
        return st

    @pytest.fixture
    def base(self, storage):
        url = f"memory://conformance-{uuid.uuid4().hex[:10]}"
        yield url
        for f in storage.list_files(url):  # the memory store is one per process
            storage.delete(f)


class TestFaultyLocalStorageWithoutFaults(StorageSuite):
    @pytest.fixture
    def storage(self):
        return FaultyStorage(LocalStorage(), FaultSpec())

    @pytest.fixture
    def base(self, tmp_path):
        return f"file://{tmp_path}/store"


class TestLocalStorageWithNamedTemps(StorageSuite):
    """Where unnamed files cannot be linked, local files are written as named temp files."""

    @pytest.fixture
    def storage(self, monkeypatch):
        monkeypatch.setattr(unnamed, "_ways", [])
        return LocalStorage()

    @pytest.fixture
    def base(self, tmp_path):
        return f"file://{tmp_path}/store"
