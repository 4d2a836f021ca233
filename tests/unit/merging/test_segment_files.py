"""A node's merged changelog files (dstl_ray.merging.segments) on real files: a flush is freed
only when every section in it was released and no retained checkpoint can name it."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from dstl_ray.merging.pool import FileMergingOptions
from dstl_ray.merging.segments import FlushFiles
from dstl_ray.storage.local import LocalStorage

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
                min_size=1, max_size=4, unique_by=lambda r: r[0]),  # a section goes once
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


def test_a_dead_writers_sections_go_once_the_watermark_passes_its_bound(tmp_path):
    """A writer that died without releasing (a killed process): its sections are released
    as used by checkpoints up to its bound; the flush stays while another log holds it, and
    until the watermark passes the bound."""
    ff = _files(tmp_path)
    rel, base = ff.append(b"x" * 100, [("dead", 0), ("live", 50)])
    rel2, base2 = ff.append(b"y" * 40, [("dead", 0)])
    assert ff.forget("dead", 7) == 2
    ff.subsumed(6)
    assert _exists(tmp_path, rel) and _exists(tmp_path, rel2), "checkpoint 7 may name them"
    ff.subsumed(7)
    assert _exists(tmp_path, rel), "the live log still holds its section of the first flush"
    ff.release(rel, base + 50, "live", True, 7)
    ff.subsumed(8)  # (the file is sealed only when full: it goes with its last flush)
    assert ff.stats_dict()["live_bytes"] == 0


def test_a_dead_writers_flush_landing_later_is_released_as_it_lands(tmp_path):
    ff = _files(tmp_path)
    ff.forget("dead", 4)  # declared dead while one of its requests was still in a batch
    rel, _ = ff.append(b"x" * 30, [("dead", 0)])
    ff.subsumed(4)
    assert ff.stats_dict()["live_bytes"] == 0


def test_a_dead_writer_with_an_unknown_use_is_never_freed_by_watermark(tmp_path):
    from dstl_ray.merging.pool import UNKNOWN_USE

    ff = _files(tmp_path)
    rel, _ = ff.append(b"x" * 30, [("dead", 0)])
    ff.forget("dead", UNKNOWN_USE)
    ff.subsumed(10**9)
    assert _exists(tmp_path, rel) and ff.stats_dict()["live_bytes"] == 30


def test_a_dead_writer_that_never_named_a_checkpoint_is_released_unused(tmp_path):
    ff = _files(tmp_path)
    rel, base = ff.append(b"x" * 30, [("dead", 0), ("other", 10)])
    ff.forget("dead", -1)
    ff.release(rel, base + 10, "other", False, -1)
    assert ff.stats_dict()["live_bytes"] == 0


def test_a_section_retained_by_a_restored_log_outlives_the_dead_writer(tmp_path):
    ff = _files(tmp_path)
    rel, base = ff.append(b"x" * 30, [("dead", 0)])
    assert ff.retain(rel, base, "restored")  # the restored backend names it too
    ff.forget("dead", 3)
    ff.subsumed(20)
    assert _exists(tmp_path, rel), "the restored log has not released it"
    ff.release(rel, base, "restored", True, 25)
    ff.subsumed(25)
    assert ff.stats_dict()["live_bytes"] == 0
