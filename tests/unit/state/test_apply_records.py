"""The batched replay loop (apply_records) is exactly apply_record applied one by one: same
tables for any mix of ops and state kinds, and the same FormatError on a bad record."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from dstl_ray.errors import FormatError
from dstl_ray.state.records import Op, StateKind, apply_record, apply_records, encode, join_items

KINDS = [StateKind.VALUE, StateKind.LIST, StateKind.MAP, StateKind.VALUE]
OPS = {StateKind.VALUE: [Op.VALUE_SET, Op.VALUE_CLEAR],
       StateKind.LIST: [Op.LIST_ADD, Op.LIST_SET, Op.LIST_CLEAR],
       StateKind.MAP: [Op.MAP_PUT, Op.MAP_REMOVE, Op.MAP_CLEAR]}


@st.composite
def records(draw):
    sid = draw(st.integers(0, len(KINDS) - 1))
    op = draw(st.sampled_from(OPS[KINDS[sid]]))
    key = draw(st.binary(max_size=6))
    val = draw(st.binary(max_size=8))
    if op is Op.LIST_SET:
        val = join_items(draw(st.lists(st.binary(max_size=4), max_size=3)))
    ukey = draw(st.binary(max_size=4)) if op in (Op.MAP_PUT, Op.MAP_REMOVE) else None
    rec = encode(op, sid, key, val, ukey)
    if draw(st.integers(0, 30)) == 0:  # now and then a torn or flipped record
        cut = draw(st.integers(0, len(rec)))
        rec = rec[:cut] if draw(st.booleans()) else bytes([rec[0] ^ 0xFF]) + rec[1:]
    return rec


def _run(fn, recs, sid_map):
    tables = [{} for _ in KINDS]
    try:
        fn(recs, tables, sid_map)
    except FormatError as e:
        return "error", type(e), tables
    return "ok", None, tables


@settings(max_examples=300, deadline=None)
@given(st.lists(records(), max_size=40), st.booleans())
def test_batched_equals_one_by_one(recs, use_map):
    sid_map = [0, 1, 2, 3] if use_map else None

    def one_by_one(rs, tables, m):
        for r in rs:
            apply_record(r, tables, KINDS, 5, m)

    def batched(rs, tables, m):
        apply_records(rs, tables, KINDS, 5, m)

    a, b = _run(one_by_one, copy.copy(recs), sid_map), _run(batched, copy.copy(recs), sid_map)
    assert a[0] == b[0] and a[1] == b[1]
    if a[0] == "ok":
        assert a[2] == b[2]


def test_value_set_for_a_list_state_is_refused():
    rec = encode(Op.VALUE_SET, 1, b"k", b"v")
    tables = [{} for _ in KINDS]
    try:
        apply_records([rec], tables, KINDS, 0)
    except FormatError as e:
        assert "does not fit" in str(e)
    else:
        raise AssertionError("a value set on a list state was applied")
