"""The Storage conformance suite (dstl_ray.testing.storage_suite) on a real S3 server on
loopback (moto): fsspec/s3fs as the node writes with it (``storage_for``), and the same under
the fault-injecting wrapper with no faults configured."""

from __future__ import annotations

import json
import uuid

import pytest

from dstl_ray import ChangelogConfig
from dstl_ray.storage.fsspec import FsspecStorage
from dstl_ray.storage.registry import storage_for
from dstl_ray.testing.faults import FaultyStorage
from dstl_ray.testing.s3server import LoopbackS3
from dstl_ray.testing.storage_suite import StorageSuite


@pytest.fixture(scope="module")
def s3():
    with LoopbackS3() as server:
        yield server


class _OnS3(StorageSuite):
    fault_spec = ""

    @pytest.fixture
    def base(self, s3):
        return s3.url(f"conformance-{uuid.uuid4().hex[:10]}")

    @pytest.fixture
    def storage(self, s3, base):
        return storage_for(base, ChangelogConfig(**s3.config_options(),
                                                 fault_spec=self.fault_spec))

    @pytest.fixture
    def large_size(self, storage):
        inner = getattr(storage, "inner", storage)
        return inner.multipart_threshold + 17  # through the multipart upload


class TestS3Storage(_OnS3):
    def test_is_fsspec_on_s3(self, storage):
        assert isinstance(storage, FsspecStorage) and storage.protocol == "s3"

    def test_a_large_file_goes_multipart(self, storage, base, large_size):
        before = storage.multipart_uploads
        self.test_large_file(storage, base, large_size)
        assert storage.multipart_uploads == before + 1


class TestFaultyS3StorageWithoutFaults(_OnS3):
    fault_spec = json.dumps({"seed": 1})

    def test_is_the_wrapper_injecting_nothing(self, storage, base):
        assert isinstance(storage, FaultyStorage)
        storage.write_file(f"{base}/x", b"x")
        assert storage.injected == {"ok": 1}
