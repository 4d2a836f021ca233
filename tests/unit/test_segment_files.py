"""A node's merged changelog files (dstl_ray.segment_files) on real files: a flush is freed
only when every section in it was released and no retained checkpoint can name it."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from dstl_ray.merging import FileMergingOptions
from dstl_ray.segment_files import FlushFiles
from dstl_ray.storage import LocalStorage

OPTS = FileMergingOptions("across_checkpoints", max_file_size=1 << 20,
                          max_space_amplification=1e6)


def _files(tmp_path):
    return FlushFiles(LocalStorage(fsync=False), f"file://{tmp_path}/job", "segments/node-a", OPTS)


def _exists(tmp_path, rel):
    return os.path.exists(tmp_path / "job" / rel)


def test_two_sections_of_one_log_in_one_flush_are_released_one_by_one(tmp_path):
    ff = _files(tmp_path)
    # a pre-emptive upload and the checkpoint's request of the same log, in one flush
    rel, base = ff.append(b"x" * 100, [("log1", 10), ("log1", 60)])
    ff.release(rel, base + 10, "log1", True, 3)  # the older one, after a materialization
    ff.subsumed(10)
    assert _exists(tmp_path, rel), "the other section of the same log is still live"
    ff.release(rel, base + 60, "log1", True, 12)
    assert _exists(tmp_path, rel), "checkpoint 12 may still name it"
    ff.subsumed(12)
    assert not _exists(tmp_path, rel)


def test_an_unused_flush_goes_when_released_and_a_later_watermark_frees_the_rest(tmp_path):
    ff = _files(tmp_path)
    a, ba = ff.append(b"a" * 50, [("l1", 0), ("l2", 20)])
    b, bb = ff.append(b"b" * 50, [("l1", 0)])
    assert a == b and bb == ba + 50  # appended to the same open file
    ff.release(a, ba, "l1", False, -1)
    ff.release(a, ba + 20, "l2", True, 5)
    ff.release(b, bb, "l1", True, -1)  # used by a checkpoint of unknown id: kept
    ff.subsumed(100)
    assert _exists(tmp_path, a)
    assert ff.stats_dict()["live_bytes"] == 50


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.integers(-1, 8)),
                min_size=1, max_size=8),
       st.lists(st.integers(0, 10), min_size=1, max_size=4))
def test_a_file_goes_only_when_nothing_in_it_can_be_named(tmp_path_factory, releases,
                                                           watermarks):
    """Model: one flush of 4 sections, released in any order (used or not, with the newest
    checkpoint that used them, -1 unknown), then watermarks: the file is gone exactly when
    every section was released and every use is at or below the watermark."""
    tmp = tmp_path_factory.mktemp("ff")
    ff = _files(tmp)
    rel, base = ff.append(b"z" * 40, [(f"log{i}", i * 10) for i in range(4)])
    for idx, used, last in releases:
        ff.release(rel, base + idx * 10, f"log{idx}", used, last)
    for w in watermarks:
        ff.subsumed(w)
    wm = max(watermarks)
    dead = ({idx for idx, _, _ in releases} == {0, 1, 2, 3}
            and all(0 <= last <= wm for _, used, last in releases if used))
    assert _exists(tmp, rel) == (not dead)
