"""Handle JSON: stable, versioned, no pickle, paths confined to the job directory."""

from __future__ import annotations

import json
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dstl_ray import (
    DirectTransport,
    FormatError,
    HandleError,
    KeyGroupRange,
    Segment,
    StateChangelogClient,
    StateChangelogHandle,
)
from dstl_ray.storage.base import join
from dstl_ray.storage.registry import get_storage


def _handle(**kw):
    d = dict(job_path="file:///data/job", log_id="ab" * 16, key_group_range=KeyGroupRange(0, 7),
             sqn_from=2, sqn_to=4,
             segments=(Segment("dstl/n1/f.dstl", 16, 100, 1, 3, "dstl-node-1"),))
    d.update(kw)
    return StateChangelogHandle(**d)


def test_json_round_trip_and_version():
    h = _handle()
    text = h.to_json()
    assert StateChangelogHandle.from_json(text) == h
    d = json.loads(text)
    assert d["version"] == 1 and d["type"] == "dstl-changelog-handle"
    d["version"] = 2
    with pytest.raises(HandleError, match="unsupported handle version 2"):
        StateChangelogHandle.from_json(json.dumps(d))


@pytest.mark.parametrize("path", ["../other/f.dstl", "/etc/passwd", "dstl/../../x.dstl",
                                  "s3://bucket/x.dstl", "dstl\\..\\x.dstl", "", "dstl//x.dstl",
                                  "dstl/./x.dstl", "dstl/f.txt"])
def test_paths_escaping_the_job_directory_are_refused(path):
    d = json.loads(_handle().to_json())
    d["segments"][0]["path"] = path
    with pytest.raises(HandleError):
        StateChangelogHandle.from_json(json.dumps(d))


def test_handle_for_another_base_path_is_refused():
    text = _handle().to_json()
    assert StateChangelogHandle.from_json(text, expected_job_path="file:///data/job/")
    with pytest.raises(HandleError, match="outside the job's base path"):
        StateChangelogHandle.from_json(text, expected_job_path="file:///other/job")


def test_pickle_is_not_json():
    import pickle

    with pytest.raises(HandleError):
        StateChangelogHandle.from_json(pickle.dumps(_handle()))


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                        max_size=5),
                    max_leaves=20))
def test_arbitrary_json_is_a_handle_error_never_a_crash(doc):
    try:
        StateChangelogHandle.from_dict(doc)
    except HandleError:
        pass


def test_torn_segment_is_detected():
    base = f"memory://h-{uuid.uuid4().hex}"
    t = DirectTransport("job", base)
    w = StateChangelogClient("job", transport=t).create_writer("op", KeyGroupRange(0, 3))
    for kg in range(4):
        w.append(kg, b"v%d" % kg)
    h = w.persist_durably(0).result(timeout=10)
    st_ = get_storage(base)
    path = join(h.job_path, h.segments[0].path)
    data = st_.read_file(path)
    # cut the file right after the first key-group block: a block boundary
    first_block_end = 16 + 60 + 2 + 8 + 4 + 4 + 2
    st_.write_file(path, data[:first_block_end])
    with pytest.raises(FormatError, match="torn"):
        h.read_all()
