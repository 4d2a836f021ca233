from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dstl_ray import KeyGroupError, KeyGroupRange, assign_key_group, key_group_range_for_subtask
from dstl_ray.keygroups import KeyGroupCache, assign_key_groups, hash_input
from dstl_ray.state.records import TaggedSerializer


def test_hash_is_stable_across_processes():
    code = "from dstl_ray import assign_key_group as a; print(a('user-42', 128), a(42, 128))"
    out = {subprocess.check_output([sys.executable, "-c", code], text=True) for _ in range(2)}
    assert len(out) == 1
    assert out.pop().split() == [str(assign_key_group("user-42", 128)),
                                 str(assign_key_group(42, 128))]


@given(st.integers(1, 300), st.data())
def test_subtask_ranges_partition_key_groups(max_par, data):
    par = data.draw(st.integers(1, max_par))
    ranges = [key_group_range_for_subtask(max_par, par, i) for i in range(par)]
    covered = [kg for r in ranges for kg in r]
    assert covered == list(range(max_par))


def test_bad_ranges():
    with pytest.raises(KeyGroupError):
        KeyGroupRange(5, 4)
    with pytest.raises(KeyGroupError):
        KeyGroupRange(-1, 4)
    with pytest.raises(KeyGroupError):
        key_group_range_for_subtask(8, 9, 0)
    assert KeyGroupRange(0, 3).intersect(KeyGroupRange(2, 9)) == KeyGroupRange(2, 3)
    assert KeyGroupRange(0, 1).intersect(KeyGroupRange(2, 9)) is None


KEYS = st.one_of(st.integers(), st.text(), st.binary(), st.booleans(),
                 st.tuples(st.integers(), st.text()))


@given(st.lists(KEYS, max_size=30), st.integers(1, 1 << 15))
def test_key_groups_of_a_column_equal_the_key_group_of_each_key(keys, max_par):
    assert assign_key_groups(keys, max_par) == [(assign_key_group(k, max_par), hash_input(k))
                                                for k in keys]


@given(st.lists(st.one_of(KEYS, st.floats(allow_nan=False), st.sampled_from([1, True, 1.0, "1"])),
                max_size=30), st.integers(1, 1 << 15), st.integers(0, 8))
def test_the_key_group_cache_answers_as_hashing_each_key(keys, max_par, capacity):
    """Asked again (from memory) or for the first time, with 1, True and 1.0 (equal as dict
    keys, hashed apart) side by side, and never holding more than its capacity."""
    cache = KeyGroupCache(max_par, capacity)
    want = [assign_key_group(k, max_par) for k in keys]
    assert cache.key_groups(keys) == want
    assert cache.key_groups(list(reversed(keys))) == want[::-1]
    assert len(cache) <= capacity
    assert KeyGroupCache.of(max_par) is KeyGroupCache.of(max_par)


def test_the_key_group_cache_keeps_no_long_strings_and_takes_int_parallelism():
    cache = KeyGroupCache(128)
    long = "x" * (KeyGroupCache.MAX_STR + 1)
    assert cache.key_groups([long, "short", 7]) == [assign_key_group(k, 128)
                                                   for k in (long, "short", 7)]
    assert len(cache) == 2
    with pytest.raises(TypeError):
        KeyGroupCache.of(128.0)  # type: ignore[arg-type]


@given(st.one_of(st.integers(), st.text()))
def test_an_int_or_str_keys_hash_input_is_its_tagged_encoding(key):
    """What lets a columnar ref encode an int or str key once (ValueState.refs)."""
    assert TaggedSerializer().serialize(key) == hash_input(key)
