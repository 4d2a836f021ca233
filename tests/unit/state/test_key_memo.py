"""A per-key update reads and writes several states of one key in a row, and hot keys come
back batch after batch: the backend remembers the key group and bytes of up to
``access.REF_MEMO`` exact ``int`` and ``str`` keys (short ones: the memo holds each key), so
such a key is hashed and encoded once while remembered; keys that are equal but not the same
key (1, True and 1.0 are three keys) are never confused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import dstl_ray as d
from dstl_ray import keygroups
from dstl_ray.state.records import TaggedSerializer

from ..ckpt_util import MAXP, client, new_base


@pytest.fixture
def b() -> Iterator[d.ChangelogKeyedStateBackend]:
    """A backend of every key group, closed after the test."""
    backend = d.ChangelogKeyedStateBackend(client("memo", new_base()), "op",
                                           d.KeyGroupRange(0, MAXP - 1), MAXP,
                                           materialization_interval=None)
    yield backend
    backend.close()


def test_one_keys_states_hash_it_once(monkeypatch, b):
    calls = []
    real = keygroups.hash_input
    monkeypatch.setattr(keygroups, "hash_input", lambda key: calls.append(key) or real(key))
    count, total = b.value_state("count"), b.value_state("sum")
    key = "user-7"
    count.update(key, count.value(key, 0) + 1)
    total.update(key, total.value(key, 0) + 5)
    assert calls == ["user-7"]
    other = "user-8"
    count.update(other, 1)
    assert (count.value(key), total.value(key), count.value(other)) == (1, 5, 1)
    assert calls == ["user-7", "user-8"]  # remembered: neither is hashed again
    assert count.value("user-" + str(7)) == 1  # an equal str, another object
    assert calls == ["user-7", "user-8"]


def test_the_memo_is_bounded_and_starts_over(monkeypatch, b):
    from dstl_ray.state import access

    monkeypatch.setattr(access, "REF_MEMO", 8)
    calls = []
    real = keygroups.hash_input
    monkeypatch.setattr(keygroups, "hash_input", lambda key: calls.append(key) or real(key))
    v = b.value_state("v")
    for i in range(20):
        v.update(i, i * 10)
    assert len(b._refs) <= 8
    assert [v.value(i) for i in range(20)] == [i * 10 for i in range(20)]
    assert calls.count(0) == 2  # forgotten once the memo filled, hashed anew


def test_long_keys_and_bytes_keys_are_not_remembered(b):
    v = b.value_state("v")
    keys = ["x" * 65, b"raw", 1 << 70, -(1 << 70), "y" * 64, 1 << 40]
    for i, key in enumerate(keys):
        v.update(key, i)
    assert set(b._refs) == {"y" * 64, 1 << 40}
    assert [v.value(k) for k in keys] == list(range(len(keys)))


def test_equal_keys_of_other_types_stay_apart(b):
    v = b.value_state("v")
    for key, value in ((1, "int"), (True, "bool"), (1.0, "float"), (b"1", "bytes"),
                       ("1", "str")):
        v.update(key, value)
    assert [v.value(k) for k in (1, True, 1.0, b"1", "1")] == [
        "int", "bool", "float", "bytes", "str"]


def test_a_key_outside_the_range_is_refused_every_time():
    b = d.ChangelogKeyedStateBackend(client("memo", new_base()), "op", d.KeyGroupRange(0, 0),
                                     MAXP, materialization_interval=None)
    try:
        v = b.value_state("v")
        key = next(k for k in (f"k{i}" for i in range(1000))
                   if d.assign_key_group(k, MAXP) != 0)
        for _ in range(2):
            with pytest.raises(d.KeyGroupError, match="outside this backend's range"):
                v.update(key, 1)
        inside = next(k for k in (f"k{i}" for i in range(1000))
                      if d.assign_key_group(k, MAXP) == 0)
        v.update(inside, 1)
        with pytest.raises(d.KeyGroupError):
            v.value(key)
        assert v.value(inside) == 1
    finally:
        b.close()


def test_a_custom_serializer_still_encodes_the_key():
    class Upper(TaggedSerializer):
        def serialize(self, obj, _depth=0):
            return super().serialize(obj.upper() if isinstance(obj, str) else obj, _depth)

    b = d.ChangelogKeyedStateBackend(client("memo", new_base()), "op",
                                     d.KeyGroupRange(0, MAXP - 1), MAXP,
                                     materialization_interval=None, serializer=Upper())
    try:
        v = b.value_state("v")
        v.update("a", 1)
        assert v.ref("a")[1] == b"sA"  # the serializer's encoding, not the hash input
        assert v.value("a") == 1 and list(v.keys()) == ["A"]
    finally:
        b.close()
