"""A parent that answers a forward after the child gave up (paused past its deadline and the
reply grace): the child flushed those requests itself, so the parent's segments are nobody's;
the child releases them, unused, at the node that flushed them when the answer comes at last.
Before, the answer was dropped and the parent's file stayed until the job's next recovery."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import pytest

from dstl_ray import ChangelogConfig
from dstl_ray.format.changelog import EncodedSection
from dstl_ray.format.segment import Segment
from dstl_ray.node import ChangelogNode
from dstl_ray.node import routing as routing_mod
from dstl_ray.transport.base import PersistRequest


class _Ref:
    def __init__(self, fut: concurrent.futures.Future) -> None:
        self._fut = fut

    def future(self) -> concurrent.futures.Future:
        return self._fut

    def __await__(self) -> Any:  # as a Ray ObjectRef
        return asyncio.wrap_future(self._fut).__await__()


class _Method:
    def __init__(self, calls: list[tuple[str, tuple[Any, ...]]], name: str,
                 result: concurrent.futures.Future | None = None) -> None:
        self.calls, self.name, self.result = calls, name, result

    def remote(self, *args: Any) -> _Ref:
        self.calls.append((self.name, args))
        fut = self.result or concurrent.futures.Future()
        if self.result is None:
            fut.set_result(None)
        return _Ref(fut)


class _Parent:
    """The parent's actor handle: persist_batch answers when the test says so."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.answer: concurrent.futures.Future = concurrent.futures.Future()
        self.persist_batch = _Method(self.calls, "persist_batch", self.answer)
        self.release = _Method(self.calls, "release")


def _request(log: bytes) -> PersistRequest:
    section = EncodedSection(log_id=log, data=b"x" * 5, index=(), sqn_min=0, sqn_max=0,
                             flags=0)
    return PersistRequest(job_id="j", section=section, source=log.hex(), checkpoint_id=3)


@pytest.mark.parametrize("late", [True, False])
def test_an_answer_after_the_grace_is_released_unused(tmp_path, monkeypatch, late):
    monkeypatch.setattr(routing_mod, "REPLY_GRACE_S", 0.05)
    node = ChangelogNode("n1", "child", f"file://{tmp_path}", ChangelogConfig(),
                         parent="parent", level=1)
    parent = _Parent()
    node._peers.handles["parent"] = parent
    reqs = [_request(b"\x0a" * 16), _request(b"\x0b" * 16)]

    async def run() -> None:
        if late:
            with pytest.raises(asyncio.TimeoutError):
                await node._router.forward("parent", reqs, 0.05)
            assert node._router.late_answers  # still listening for the answer
        else:
            parent.answer.set_result([Segment("dstl/parent/f.dstl", 0, 5, 0, 0, "parent"),
                                      Segment("dstl/parent/f.dstl", 5, 5, 0, 0, "parent")])
            segs = await node._router.forward("parent", reqs, 0.05)
            assert len(segs) == 2
            return
        parent.answer.set_result([Segment("dstl/parent/f.dstl", 0, 5, 0, 0, "parent"),
                                  ValueError("the parent could not write log-b")])
        for _ in range(100):
            if not node._router.late_answers:
                break
            await asyncio.sleep(0.01)

    asyncio.run(run())
    releases = [args for name, args in parent.calls if name == "release"]
    if not late:
        assert releases == [] and node.counters.late_answers_released == 0
        return
    # only the segment the parent wrote, at the node that flushed it, unused
    assert [(a[0], a[1], a[2], a[3], a[5]) for a in releases] == [
        ("j", "dstl/parent/f.dstl", "0a" * 16, False, 0)]
    assert node.counters.late_answers_released == 1 and not node._router.late_answers
