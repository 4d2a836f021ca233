from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dstl_ray import KeyGroupError, KeyGroupRange, assign_key_group, key_group_range_for_subtask


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
