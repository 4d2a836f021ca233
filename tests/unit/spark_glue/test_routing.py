"""The operator's Arrow data path (spark_glue.routing) without Spark: the map side's split by
subtask agrees with the key groups, every row arrives exactly once, the reduce side groups
rows by key in order, and a payload sent to the wrong subtask is refused."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dstl_ray.keygroups import assign_key_group
from spark_glue.routing import (
    EMPTY,
    PAYLOAD,
    ROUTE,
    SUBTASK,
    chunks,
    group_by_key,
    read_payloads,
    route_values,
    rows_of,
    spark_hash_int,
    splitter,
    subtasks_of,
)

MAXP = 128


def subtask_of(key, maxp: int, p: int) -> int:
    """The oracle: Flink's operator index of the key's key group."""
    return assign_key_group(key, maxp) * p // maxp


def _batch(keys: list, amounts: list[int] | None = None) -> pa.RecordBatch:
    amounts = amounts if amounts is not None else list(range(len(keys)))
    return pa.RecordBatch.from_pydict({"user": keys, "amount": amounts})


@given(st.lists(st.one_of(st.text(max_size=6), st.none()), max_size=60),
       st.integers(1, 9))
@settings(max_examples=60, deadline=None)
def test_subtasks_of_agrees_with_the_key_group_of_every_key(keys, p):
    got = subtasks_of(pa.array(keys, pa.string()), MAXP, p).tolist()
    assert got == [subtask_of(k, MAXP, p) for k in keys]


@given(st.lists(st.integers(-50, 50), max_size=80), st.integers(1, 6))
@settings(max_examples=60, deadline=None)
def test_split_sends_every_row_once_to_its_subtask(keys, p):
    routes = list(range(100, 100 + p))
    out = list(splitter("user", MAXP, p, routes)([_batch(keys), _batch([])]))
    seen = []
    for rb in out:
        assert rb.schema.names == [ROUTE, SUBTASK, PAYLOAD]
        for r, s, payload in zip(*(c.to_pylist() for c in rb.columns), strict=True):
            assert r == routes[s]
            part = read_payloads(s, [(r, s, payload)])
            for k, a in zip(part.column("user").to_pylist(), part.column("amount").to_pylist(),
                            strict=True):
                assert subtask_of(k, MAXP, p) == s
                seen.append((k, a))
    assert sorted(seen) == sorted(zip(keys, range(len(keys)), strict=True))


@given(st.lists(st.lists(st.integers(0, 9), max_size=12), max_size=8), st.integers(1, 3))
@settings(max_examples=60, deadline=None)
def test_a_partitions_batches_split_as_one_chunk_keep_each_keys_row_order(sizes, p):
    """Spark hands ``mapInArrow`` many small batches: they are split a chunk at a time, and
    every subtask still gets each key's rows once, in the order they came."""
    batches, n = [], 0
    for keys in sizes:
        batches.append(_batch(keys, list(range(n, n + len(keys)))))
        n += len(keys)
    out = list(splitter("user", MAXP, p, list(range(p)))(batches))
    assert len(out) == (1 if n else 0)  # one chunk: one output batch
    rows = []
    for rb in out:
        for r, s, payload in zip(*(c.to_pylist() for c in rb.columns), strict=True):
            rows += [(s, *x.values()) for x in read_payloads(s, [(r, s, payload)]).to_pylist()]
    assert sorted(a for _s, _k, a in rows) == list(range(n))
    for s, k, _a in rows:
        assert subtask_of(k, MAXP, p) == s
    by_key = {}
    for _s, k, a in rows:
        by_key.setdefault(k, []).append(a)
    assert all(v == sorted(v) for v in by_key.values())


def test_chunks_gather_batches_up_to_a_row_or_byte_bound():
    batches = [_batch(list(range(i, i + 10))) for i in range(0, 100, 10)] + [_batch([])]
    got = list(chunks(batches, rows=25, size=1 << 30))
    assert [t.num_rows for t in got] == [30, 30, 30, 10]
    assert sum((t.column("user").to_pylist() for t in got), []) == list(range(100))
    assert [t.num_rows for t in chunks(batches, rows=10**9, size=1)] == [10] * 10
    assert list(chunks([_batch([])])) == []


def _count_and_sum(pdf):
    return pdf.groupby("user", as_index=False).agg(n=("amount", "size"),
                                                  total=("amount", "sum"))


def test_a_combiner_runs_once_per_input_partition_before_the_split():
    """The operator's ``combine`` (map-side partial aggregation): a partition of several
    batches becomes one combined row per key, each sent to its key's subtask."""
    keys = [f"u{i % 7}" for i in range(300)]
    batches = [_batch(keys[i:i + 50], list(range(i, i + 50))) for i in range(0, 300, 50)]
    p = 3
    out = list(splitter("user", MAXP, p, [0, 1, 2], _count_and_sum)([*batches, _batch([])]))
    got = {}
    for rb in out:
        for r, s, payload in zip(*(c.to_pylist() for c in rb.columns), strict=True):
            part = read_payloads(s, [(r, s, payload)])
            for row in part.to_pylist():
                assert subtask_of(row["user"], MAXP, p) == s and row["user"] not in got
                got[row["user"]] = (row["n"], row["total"])
    assert got == {f"u{k}": (sum(1 for x in keys if x == f"u{k}"),
                             sum(i for i, x in enumerate(keys) if x == f"u{k}"))
                   for k in range(7)}
    assert list(splitter("user", MAXP, p, [0, 1, 2], _count_and_sum)([_batch([])])) == []
    with pytest.raises(ValueError, match="combine must return a pandas DataFrame with the "
                                         "key column 'user'"):
        list(splitter("user", MAXP, p, [0, 1, 2], lambda pdf: pdf[["amount"]])([batches[0]]))


def test_a_payload_of_another_subtask_is_refused():
    (rb,) = splitter("user", MAXP, 2, [7, 9])([_batch(["a"])])
    s = rb.column(1)[0].as_py()
    with pytest.raises(RuntimeError, match=f"subtask {1 - s} was sent a payload of subtask {s}"):
        read_payloads(1 - s, [tuple(c[0].as_py() for c in rb.columns)])


def test_group_by_key_keeps_first_seen_key_order_and_row_order():
    t = pa.table({"user": ["b", "a", "b", None, "a", "b"], "amount": [1, 2, 3, 4, 5, 6]})
    g = group_by_key(t, "user")
    assert g.keys == ["b", "a", None] and g.rows == 6
    amounts = g.table.column("amount").to_pylist()
    per_key = {k: amounts[g.offsets[i]:g.offsets[i + 1]] for i, k in enumerate(g.keys)}
    assert per_key == {"b": [1, 3, 6], "a": [2, 5], None: [4]}
    assert group_by_key(None, "user") is EMPTY and EMPTY.rows == 0
    assert read_payloads(0, []) is None


def test_rows_of_gives_rows_by_name_and_position():
    rows = rows_of(pa.table({"user": ["a", "b"], "amount": [1, 2]}))
    assert [r["amount"] for r in rows] == [1, 2] and rows[1].user == "b" and rows[0][0] == "a"
    assert rows_of(None) == []


def test_rows_of_rows_behave_as_pysparks_rows():
    """Made by the column for speed, they are still pyspark.sql.Row objects in every way a
    user can tell: names, positions, slices, asDict, repr, equality, pickling, errors; a
    field named like a tuple method is reached by name (as with Row)."""
    import pickle

    import cloudpickle
    from pyspark.sql import Row

    r = rows_of(pa.table({"user": ["a"], "amount": [1], "count": [5]}))[0]
    plain = Row(user="a", amount=1, count=5)
    assert isinstance(r, Row) and r == plain and repr(r) == repr(plain)
    assert (r["user"], r.amount, r[2], r[0:2], r["count"]) == ("a", 1, 5, ("a", 1), 5)
    assert r.asDict() == {"user": "a", "amount": 1, "count": 5} and "amount" in r
    for copy in (pickle.loads(pickle.dumps(r)), cloudpickle.loads(cloudpickle.dumps(r))):
        assert copy == plain and copy.amount == 1 and copy.asDict() == plain.asDict()

    def error(row: Row) -> type | None:
        try:
            row["nope"]
        except Exception as e:  # noqa: BLE001 - which one Row raises is what is compared
            return type(e)
        return None

    assert error(r) is not None and error(r) is error(plain)
    with pytest.raises(AttributeError):
        r.nope  # noqa: B018


def test_route_values_follow_sparks_murmur3_hash_partitioning():
    # seen on Spark 3.5.7: SELECT hash(0) and the first ints per partition of 4
    # (tests/spark/test_vectorized_api.py checks every parallelism up to 9 against Spark)
    assert spark_hash_int(0) == 933211791
    assert route_values(4) == (12, 6, 2, 0)
    for p in range(1, 20):
        routes = route_values(p)
        assert [spark_hash_int(v) % p for v in routes] == list(range(p))
        assert len(set(routes)) == p
