"""The salt of spark_glue.jvm_route, in Python: Spark's Murmur3 of (key's hash, salt) is the
wanted subtask whatever the key's hash. Spark computing it in SQL, and every row in its
subtask's partition, is checked in tests/spark/test_jvm_route.py."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from spark_glue.jvm_route import salt_of
from spark_glue.routing import spark_hash_int


@given(st.integers(0, (1 << 32) - 1), st.integers(1, 64), st.data())
def test_the_salt_makes_sparks_hash_the_subtask(seed, parallelism, data):
    subtask = data.draw(st.integers(0, parallelism - 1))
    salt = salt_of(seed, subtask)
    signed_salt = salt - (1 << 32) if salt >= 1 << 31 else salt
    h = spark_hash_int(signed_salt, seed)  # (the seed's 32 bits, as Spark's int holds them)
    assert h == subtask  # so pmod(h, parallelism) is the subtask


def test_the_plan_check_finds_the_exchange_by_key_and_salt_only():
    from spark_glue.jvm_route import salted_exchange

    line = "+- Exchange hashpartitioning({}, _dstl_salt#5, 4), ENSURE_REQUIREMENTS, [plan_id=3]"
    assert salted_exchange(line.format("user#1"), 4)
    assert salted_exchange(line.format("lower(u)#1L"), 4)  # a key named with parentheses
    assert not salted_exchange(line.format("user#1"), 3)  # into another count of partitions
    assert not salted_exchange("Exchange hashpartitioning(user#1, 4)\n _dstl_salt#5, 4)", 4)
    assert not salted_exchange("Exchange hashpartitioning(u#1, x_dstl_salt#5, 4)", 4)


def test_a_batch_or_combiner_naming_a_column_like_the_routes_goes_the_python_way():
    from spark_glue.data_path import DataPath

    plain = DataPath("user", {"n": object()})
    assert not plain.clashes(("user", "amount"))
    for name in ("_dstl_salt", "_DSTL_SALT_MIX", "_Dstl_Jvm_Route"):
        assert plain.clashes(("user", name)), name  # the route's would replace it
        assert DataPath("user", {name: object()}).clashes(("user", "amount")), name
    assert not DataPath("user", None).clashes(("user", "_dstl_salty"))
    assert not DataPath("user", lambda pdf: pdf).clashes(("user", "amount"))
