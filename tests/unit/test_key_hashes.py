"""Key hashes (dstl_ray.key_hashes): Spark's xxhash64 as Python computes it, how a backend
files keys under it, the name checkpoint metadata records, and a restore under another hash
refused. Spark's own xxhash64 is checked against these in tests/spark/test_jvm_route.py."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

import dstl_ray as d
from dstl_ray.checkpoint.metadata import CheckpointMetadata
from dstl_ray.checkpoint.recovery import load_checkpoint, restore_backends
from dstl_ray.errors import ConfigError, HandleError, KeyGroupError
from dstl_ray.key_hashes import (
    BLAKE2B,
    SparkXxHash64,
    key_hash_named,
    spark_key_hash,
)
from dstl_ray.keygroups import assign_key_group, hash_input

from .ckpt_util import MAXP, client, new_base


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


@given(st.text(max_size=40), st.integers(1, 1 << 15))
def test_a_string_keys_group_is_the_pmod_of_its_signed_xxhash64(key, maxp):
    want = _signed(xxhash.xxh64_intdigest(key.encode(), 42)) % maxp
    assert SparkXxHash64("string").key_group(key, maxp) == want
    assert 0 <= want < maxp


@given(st.integers(-(1 << 31), (1 << 31) - 1), st.integers(-(1 << 63), (1 << 63) - 1))
def test_int_and_bigint_keys_hash_their_little_endian_bytes(i, n):
    assert SparkXxHash64("int").key_group(i, 128) == \
        _signed(xxhash.xxh64_intdigest(struct.pack("<i", i), 42)) % 128
    assert SparkXxHash64("bigint").key_group(n, 100) == \
        _signed(xxhash.xxh64_intdigest(struct.pack("<q", n), 42)) % 100


@pytest.mark.parametrize("kind,key", [("string", 1), ("string", b"x"), ("int", "1"),
                                      ("int", 1 << 31), ("int", True), ("bigint", 1.5),
                                      ("binary", "x")])
def test_a_key_the_column_could_not_hold_is_refused_by_name(kind, key):
    with pytest.raises(KeyGroupError, match=kind):
        SparkXxHash64(kind).key_group(key, 128)


def test_a_null_key_hashes_to_the_seed_as_in_spark():
    for kind in ("string", "int", "bigint", "binary"):
        assert SparkXxHash64(kind).key_group(None, 100) == 42
        assert SparkXxHash64(kind).key_group(None, 32) == 42 % 32


def test_names_round_trip_and_unknown_ones_are_refused():
    for h in (BLAKE2B, *(SparkXxHash64(t) for t in ("string", "int", "bigint", "binary"))):
        assert key_hash_named(h.name) == h
    assert key_hash_named(None) is BLAKE2B  # metadata written before hashes were named
    assert spark_key_hash("string").name == "spark-xxhash64:string"
    assert spark_key_hash("double") is BLAKE2B  # Spark routes what it hashes like Python
    for bad in ("murmur", "spark-xxhash64:double", 3):
        with pytest.raises(KeyGroupError, match="key hash"):
            key_hash_named(bad)


def test_a_backend_files_and_restores_keys_by_its_hash(tmp_path):
    base = new_base(tmp_path)
    kind = SparkXxHash64("string")
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP)
    coord.key_hash = kind.name
    bs = coord.restore(client("job", base), "op", 2, key_hash=kind,
                       materialization_interval=None)
    keys = [f"k{i}" for i in range(60)]
    for k in keys:  # each key lands in the backend its Spark key group belongs to
        owner = [b for b in bs if kind.key_group(k, MAXP) in b.key_group_range]
        owner[0].value_state("v").update(k, k.upper())
    moved = [k for k in keys if kind.key_group(k, MAXP) != assign_key_group(k, MAXP)]
    assert moved  # the two hashes disagree: a restore under the other would lose these
    other = next(k for k in keys if kind.key_group(k, MAXP) not in bs[0].key_group_range)
    with pytest.raises(KeyGroupError, match="outside this backend's range"):
        bs[0].value_state("v").update(other, 1)  # its Spark key group is the other's
    cc = coord.trigger_checkpoint().result(timeout=60)
    meta = load_checkpoint(cc.metadata_url).metadata
    assert meta.key_hash == kind.name
    assert '"version":2' in meta.to_json()  # a version knowing no key hashes refuses it
    assert '"key_hash":"spark-xxhash64:string"' in meta.to_json()
    # columnar access agrees with per-key access
    refs = bs[0].value_state("v").refs([k for k in keys if kind.key_group(k, MAXP) <= 7])
    assert all(ref[1] == hash_input(k) for ref, k in zip(
        refs, [k for k in keys if kind.key_group(k, MAXP) <= 7], strict=True))
    for b in bs:
        b.close()
    # restored under the same hash at another parallelism: every key's value
    back = restore_backends(client("job", base), cc, "op", 3, MAXP, key_hash=kind,
                            materialization_interval=None)
    got = {}
    for k in keys:
        (b,) = [b for b in back if kind.key_group(k, MAXP) in b.key_group_range]
        got[k] = b.value_state("v").value(k)
    assert got == {k: k.upper() for k in keys}
    for b in back:
        b.close()
    with pytest.raises(ConfigError, match="key hash spark-xxhash64:string, the job uses "
                                          "blake2b"):
        restore_backends(client("job", base), cc, "op", 2, MAXP)
    # a backend of another hash cannot join: the checkpoint names one
    coord2 = d.CheckpointCoordinator("job2", base, max_parallelism=MAXP)
    coord2.restore(client("job2", base), "a", 1, key_hash=kind, materialization_interval=None)
    assert coord2.key_hash == kind.name
    with pytest.raises(ConfigError, match="cannot join backends of spark-xxhash64:string"):
        coord2.restore(client("job2", base), "b", 1, materialization_interval=None)
    coord2.shutdown()
    coord.shutdown()


def test_metadata_without_a_key_hash_is_blake2b_and_a_bad_one_is_refused():
    meta = CheckpointMetadata("job", 1, "checkpoint", 16, ())
    text = meta.to_json()
    assert "key_hash" not in text and '"version":1' in text  # what versions before wrote
    assert CheckpointMetadata.from_json(text, "file:///b/job/chk-1/_metadata").key_hash \
        == "blake2b"
    named = text.replace('"epoch"', '"key_hash":"md5","epoch"')
    with pytest.raises(HandleError, match="version 2 and only it names a key hash"):
        CheckpointMetadata.from_json(named, "file:///b/job/chk-1/_metadata")
    bad = named.replace('"version":1', '"version":2')
    with pytest.raises(HandleError, match="unknown key hash 'md5'"):
        CheckpointMetadata.from_json(bad, "file:///b/job/chk-1/_metadata")
