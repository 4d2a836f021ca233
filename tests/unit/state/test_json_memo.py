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
        dm.decode(json.dumps({"i": i, "pad": "z" * 10}), json.loads)
    assert len(dm._memo) <= 2 and dm._bytes <= 2000
    dm.decode("[" + "1," * 500 + "1]", json.loads)  # larger than the whole memo
    assert len(dm._memo) <= 2 and dm._bytes <= 2000


def test_spliced_members_are_not_given_twice():
    with pytest.raises(ValueError, match="given twice"):
        json_with({"a": 1}, a="2")
    assert json.loads(json_with({}, a="[1]")) == {"a": [1]} and json_with({}) == "{}"


def test_a_decode_memo_hands_out_what_the_same_text_decoded_to():
    memo, calls = DecodeMemo(), []

    def read(text):
        calls.append(text)
        return KeyedStateSnapshot.from_json(text, BASE)

    text = snapshot().to_json()
    first = memo.decode(text, read)
    assert first == snapshot() and memo.decode(text, read) is first
    assert len(calls) == 1 and memo.hits == 1
    # the same values in other JSON (5.0 for 5, another key order) decode again, and what
    # the checks refuse is refused every time
    d = json.loads(text)
    d["components"][0]["sqn"] = 5.0
    assert json.loads(json.dumps(d)) == json.loads(text)  # equal, as Python compares
    for _ in range(2):
        with pytest.raises(HandleError, match="materialized sqn"):
            memo.decode(json.dumps(d), read)
    assert len(calls) == 3
    bad = json.loads(text)
    bad["components"][1]["handle"]["job_path"] = "file:///elsewhere/job"
    with pytest.raises(HandleError, match="outside the job's base path"):
        memo.decode(json.dumps(bad), read)
    with pytest.raises(HandleError, match="not valid JSON"):
        memo.decode(text[:-1], read)
