"""A segment read back from JSON (``Segment.from_json``): its one-pass reading of a
well-formed segment accepts nothing the full checks refuse and reads what they read."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dstl_ray.errors import HandleError
from dstl_ray.format.segment import Segment

PARTS = st.sampled_from(["dstl", "node-1", "a.dstl", ".hidden", "..", ".", "", "x y", "ok=1",
                         "a\n", "-x", "é", "A" * 201, "0" * 200])
PATHS = st.one_of(st.lists(PARTS, min_size=1, max_size=4).map("/".join),
                  st.text(max_size=30), st.none(), st.integers())
NUMBERS = st.one_of(st.integers(-3, 1 << 40), st.booleans(), st.floats(0, 5), st.none(),
                    st.text(max_size=2))
SQNS = st.one_of(st.lists(NUMBERS, max_size=3), st.tuples(NUMBERS, NUMBERS), NUMBERS)


def _outcome(read, d):
    try:
        return read(d)
    except HandleError as e:
        return type(e)


@settings(max_examples=600, deadline=None)
@given(st.fixed_dictionaries({"path": PATHS, "offset": NUMBERS, "length": NUMBERS,
                              "sqn": SQNS},
                             optional={"node": st.one_of(st.text(max_size=5), st.none())}))
def test_the_quick_reading_agrees_with_the_checks(d):
    assert _outcome(Segment.from_json, d) == _outcome(Segment._checked, d)


def test_a_bad_segment_is_named():
    good = Segment("dstl/n/f.dstl", 0, 10, 1, 2, "n")
    assert Segment.from_json(good.to_json()) == good
    for bad, what in (({**good.to_json(), "path": "../f.dstl"}, "escapes"),
                      ({**good.to_json(), "offset": -1}, "segment offset"),
                      ({**good.to_json(), "sqn": [3, 2]}, "malformed segment"),
                      ({**good.to_json(), "length": True}, "segment length"),
                      # a name ends where the text does ("$" also matched before a newline)
                      ({**good.to_json(), "path": "dstl/n/f.dstl\n"}, "escapes")):
        with pytest.raises(HandleError, match=what):
            Segment.from_json(bad)
