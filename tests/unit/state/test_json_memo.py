"""Snapshot JSON made once (dstl_ray/state/json_memo.py): text spliced from parts encodes what
``json.dumps`` would, memos hand out only what the encoder or decoder gave for the same
input, and they stay bounded."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dstl_ray.checkpoint.metadata import CheckpointMetadata
from dstl_ray.errors import HandleError
from dstl_ray.format.materialized import MaterializedHandle
from dstl_ray.format.segment import Segment
from dstl_ray.keygroups import KeyGroupRange
from dstl_ray.log.handle import StateChangelogHandle
from dstl_ray.state.json_memo import DecodeMemo, TextMemo, json_list, json_with
from dstl_ray.state.snapshot import (
    ChangelogComponent,
    KeyedStateSnapshot,
    component_from_dict,
)

BASE = "file:///dfs"
scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.floats(
    allow_nan=False)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=5), inner, max_size=3), max_leaves=10)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=6), values, max_size=4),
       st.dictionaries(st.from_regex(r"[a-z_]{1,6}", fullmatch=True), values, max_size=3))
def test_spliced_json_is_the_object_with_its_members(fields, encoded):
    fields = {k: v for k, v in fields.items() if k not in encoded}
    text = json_with(fields, **{k: json.dumps(v) for k, v in encoded.items()})
    assert json.loads(text) == {**fields, **encoded}
    assert json.loads(json_list(json.dumps(v) for v in encoded.values())) == list(
        encoded.values())


def snapshot(sqn_to: int = 7) -> KeyedStateSnapshot:
    mat = MaterializedHandle("job", "mat/a.dstm", KeyGroupRange(0, 3), (("v", "value"),),
                             ((0, 12, 40), (2, 52, 40)), 92, sqn=5)
    handle = StateChangelogHandle(f"{BASE}/job", "ab" * 16, KeyGroupRange(0, 3), 5, sqn_to,
                                  (Segment("dstl/n/f.dstl", 16, 100, 6, sqn_to, "n"),))
    return KeyedStateSnapshot("op", KeyGroupRange(0, 3),
                              (mat, ChangelogComponent("job", (("v", "value"),), handle)),
                              event_time_ms=11)


def test_snapshot_and_metadata_text_read_back_as_their_dicts():
    s = snapshot()
    assert json.loads(s.to_json()) == json.loads(json.dumps(s.to_dict()))
    assert s.to_json() == s.to_json()  # (the second from the memo)
    meta = CheckpointMetadata("job", 3, "checkpoint", 4, (s, snapshot(9)), epoch=2)
    back = CheckpointMetadata.from_json(meta.to_json(), f"{BASE}/job/chk-3/_metadata")
    assert back == meta


def test_a_text_memo_encodes_an_object_once_and_another_object_again():
    memo, calls = TextMemo(), []

    def enc(o):
        calls.append(o)
        return json.dumps(o.to_dict())

    a, b = snapshot(), snapshot()  # equal, not the same
    assert memo.text(a, enc) == memo.text(a, enc) == memo.text(b, enc)
    assert calls == [a, b] and memo.hits == 1


def test_memos_stay_bounded_in_entries_and_bytes():
    memo = TextMemo(max_entries=3, max_bytes=8000)
    for o in [object() for _ in range(10)]:
        memo.text(o, lambda _: "x" * 10)
    assert len(memo._memo) <= 3
    memo.text(object(), lambda _: "y" * 5000)  # larger than the whole memo: not kept
    assert 0 < memo._bytes <= 8000
    dm = DecodeMemo(max_entries=2, max_bytes=2000)
    for i in range(6):
        dm.decode(f"n{i}", {"i": i, "pad": "z" * 10}, lambda v: v["i"])
    assert len(dm._memo) <= 2 and dm._bytes <= 2000
    # a name decoded again replaces its entry and its size
    dm = DecodeMemo(max_entries=5, max_bytes=100_000)
    for i in range(50):
        dm.decode("same", {"i": i}, lambda v: v["i"])
    assert len(dm._memo) == 1 and dm._bytes == len(json.dumps({"i": 49})) * 8


def test_spliced_members_are_not_given_twice():
    with pytest.raises(ValueError, match="given twice"):
        json_with({"a": 1}, a="2")
    assert json.loads(json_with({}, a="[1]")) == {"a": [1]} and json_with({}) == "{}"


def test_a_decode_memo_hands_out_only_what_the_same_json_decoded_to():
    memo, calls = DecodeMemo(), []
    d = snapshot().to_dict()["components"][0]
    want = component_from_dict(d, BASE)

    def dec(v):
        calls.append(v)
        return component_from_dict(v, BASE)

    first = memo.decode("a.dstm", d, dec)
    d["size"] = 93  # the caller's dict changes later: the memo kept its own copy
    assert memo.decode("a.dstm", {**d, "size": 92}, dec) is first and memo.hits == 1
    assert memo.decode("a.dstm", d, dec).size == 93  # different JSON: decoded again
    assert first == want and len(calls) == 2
    # one entry per name, the latest: 93 is kept now, 92 decodes again
    assert memo.decode("a.dstm", {**d, "size": 92}, dec) == first and len(calls) == 3
    # a bad component under a name the memo knows is refused as without a memo
    with pytest.raises(HandleError, match="outside key groups"):
        memo.decode("a.dstm", {**d, "size": 10}, dec)
    # equal to a kept one as Python compares it, but not the same JSON: decoded (and
    # refused) again, as without a memo
    good = snapshot().to_dict()["components"][0]
    memo.decode("m", good, dec)
    assert {**good, "sqn": 5.0} == good
    with pytest.raises(HandleError, match="materialized sqn"):
        memo.decode("m", {**good, "sqn": 5.0}, dec)
    # not JSON (a set): decoded, not kept
    memo.decode("odd", {"x": {1}}, lambda v: 1)
    assert "odd" not in memo._memo


def test_snapshots_decoded_through_a_memo_are_the_ones_decoded_without():
    memo = DecodeMemo()
    for sqn_to in (7, 7, 8, 7):
        d = json.loads(snapshot(sqn_to).to_json())
        with_memo = KeyedStateSnapshot.from_dict(d, BASE, memo)
        assert with_memo == KeyedStateSnapshot.from_dict(d, BASE) == snapshot(sqn_to)
    # the materialized part every time after the first; the handle when it repeated
    assert memo.hits == 3 + 1
    bad = json.loads(snapshot().to_json())
    bad["components"][1]["handle"]["job_path"] = "file:///elsewhere/job"
    with pytest.raises(HandleError, match="outside the job's base path"):
        KeyedStateSnapshot.from_dict(bad, BASE, memo)
