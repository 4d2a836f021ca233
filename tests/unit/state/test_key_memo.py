"""A per-key update reads and writes several states of one key in a row: the key is hashed
once (keygroups.assign_key_group remembers the last key object), and keys that are equal but
not the same key (1, True and 1.0 are three keys) are never confused."""

from __future__ import annotations

import dstl_ray as d
from dstl_ray import keygroups

from ..ckpt_util import MAXP, client, new_base


def _backend() -> d.ChangelogKeyedStateBackend:
    return d.ChangelogKeyedStateBackend(client("memo", new_base()), "op",
                                        d.KeyGroupRange(0, MAXP - 1), MAXP,
                                        materialization_interval=None)


def test_one_keys_states_hash_it_once(monkeypatch):
    calls = []
    real = keygroups.stable_hash
    monkeypatch.setattr(keygroups, "stable_hash", lambda key: calls.append(key) or real(key))
    b = _backend()
    try:
        count, total = b.value_state("count"), b.value_state("sum")
        key = "user-7"
        count.update(key, count.value(key, 0) + 1)
        total.update(key, total.value(key, 0) + 5)
        assert calls == ["user-7"]
        other = "user-8"
        count.update(other, 1)
        assert (count.value(key), total.value(key), count.value(other)) == (1, 5, 1)
        assert calls == ["user-7", "user-8", "user-7", "user-8"]
    finally:
        b.close()


def test_equal_keys_of_other_types_stay_apart():
    b = _backend()
    try:
        v = b.value_state("v")
        for key, value in ((1, "int"), (True, "bool"), (1.0, "float"), (b"1", "bytes"),
                           ("1", "str")):
            v.update(key, value)
        assert [v.value(k) for k in (1, True, 1.0, b"1", "1")] == [
            "int", "bool", "float", "bytes", "str"]
    finally:
        b.close()
