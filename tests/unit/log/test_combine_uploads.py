"""combine_uploads: a persist's handle over its uploads' segments, resolved once every
upload is done (at once when all are done already: a checkpoint without new changes), or a
PersistError naming the first failure; never left pending."""

from __future__ import annotations

import concurrent.futures

import pytest

from dstl_ray.errors import PersistError
from dstl_ray.format.segment import Segment
from dstl_ray.keygroups import KeyGroupRange
from dstl_ray.log.uploads import Upload, combine_uploads

LOG = "ab" * 16
KGR = KeyGroupRange(0, 7)


def _upload(sqn: int, segment: Segment | None = None, error: Exception | None = None
            ) -> Upload:
    up = Upload((sqn,), 10, False)
    if segment is not None:
        up.segment = segment  # (as the writer does: the segment first, then the future)
        up.future.set_result(segment)
    elif error is not None:
        up.future.set_exception(error)
    return up


def _seg(sqn: int, path: str = "dstl/n/f.dstl") -> Segment:
    return Segment(path, sqn * 100, 100, sqn, sqn)


def test_uploads_done_already_resolve_at_once_sorted_by_sqn():
    ups = [_upload(3, _seg(3)), _upload(1, _seg(1)), _upload(2, _seg(2, "dstl/n/g.dstl"))]
    result: concurrent.futures.Future = concurrent.futures.Future()
    combine_uploads(result, ups, "file:///b/job", LOG, KGR, 0, 3)
    assert result.done()
    h = result.result()
    assert [s.sqn_min for s in h.segments] == [1, 2, 3]
    assert (h.sqn_from, h.sqn_to, h.log_id) == (0, 3, LOG)


def test_an_upload_failed_already_fails_the_persist_at_once():
    ups = [_upload(1, _seg(1)), _upload(2, error=OSError("disk gone"))]
    result: concurrent.futures.Future = concurrent.futures.Future()
    combine_uploads(result, ups, "file:///b/job", LOG, KGR, 0, 2)
    with pytest.raises(PersistError, match="disk gone"):
        result.result(timeout=0)


def test_pending_uploads_resolve_when_the_last_lands():
    done, pending = _upload(1, _seg(1)), _upload(2)
    result: concurrent.futures.Future = concurrent.futures.Future()
    combine_uploads(result, [done, pending], "file:///b/job", LOG, KGR, 0, 2)
    assert not result.done()
    pending.segment = _seg(2)
    pending.future.set_result(pending.segment)
    assert [s.sqn_min for s in result.result(timeout=1).segments] == [1, 2]


def test_no_uploads_give_an_empty_handle():
    result: concurrent.futures.Future = concurrent.futures.Future()
    combine_uploads(result, [], "file:///b/job", LOG, KGR, 4, 4)
    assert result.result(timeout=0).is_empty()


def test_a_handle_that_cannot_be_built_fails_rather_than_hangs(monkeypatch):
    from dstl_ray.log import uploads

    def broken(*_a: object) -> None:
        raise ValueError("bad handle")

    monkeypatch.setattr(uploads, "StateChangelogHandle", broken)
    for ups in ([_upload(1, _seg(1))], []):  # done already, and none at all
        result: concurrent.futures.Future = concurrent.futures.Future()
        combine_uploads(result, ups, "file:///b/job", LOG, KGR, 0, 1)
        with pytest.raises(PersistError, match="bad handle"):
            result.result(timeout=0)
    pending = _upload(2)
    result = concurrent.futures.Future()
    combine_uploads(result, [pending], "file:///b/job", LOG, KGR, 1, 2)
    pending.segment = _seg(2)
    pending.future.set_result(pending.segment)
    with pytest.raises(PersistError, match="bad handle"):
        result.result(timeout=1)
