"""A writer's uploads and the handle built from them (FLIP-158 "API": ``persistDurably``
resolves to a handle; "Example": a handle combines what earlier uploads already hold with
what the new request sends).

Each request a writer sends to the tree is one :class:`Upload` holding some changesets; its
future resolves to the :class:`Segment` the tree wrote them to. ``persist_durably`` combines
the uploads it needs into ONE :class:`StateChangelogHandle`: it fails with
:class:`PersistError` if any of them failed (the writer keeps the changes and re-sends them),
and it never stays pending.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field

from ..errors import PersistError
from ..format.segment import Segment
from ..keygroups import KeyGroupRange
from .futures import when_all_done
from .handle import StateChangelogHandle


@dataclass(eq=False)
class Upload:
    """One request sent to the tree, holding changesets ``sqns``."""

    sqns: tuple[int, ...]
    size: int
    preemptive: bool
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    segment: Segment | None = None
    used: bool = False  # included in a handle given out by persist_durably
    released: bool = False
    last_checkpoint: int = -1  # newest checkpoint whose handle included it


class InFlight:
    """A writer's uploads not finished yet. It includes those whose changesets were
    truncated while they uploaded: no sqn names them any more, yet they land (a declined
    checkpoint's late handle may name one), so closing the writer waits for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._uploads: set[Upload] = set()

    def add(self, up: Upload) -> None:
        with self._lock:
            self._uploads.add(up)
        up.future.add_done_callback(lambda _f: self._landed(up))

    def _landed(self, up: Upload) -> None:
        with self._lock:
            self._uploads.discard(up)

    def futures(self) -> list[concurrent.futures.Future]:
        with self._lock:
            return [u.future for u in self._uploads]


def combine_uploads(result: concurrent.futures.Future, uploads: list[Upload], job_path: str,
                    log_id: str, key_group_range: KeyGroupRange, after: int,
                    sqn_to: int) -> None:
    """Resolve ``result`` once every one of ``uploads`` is done: to the handle of log
    ``log_id``'s changes in ``(after, sqn_to]`` over their segments (sorted by sqn), or to
    a :class:`PersistError` naming the first failure (at once if ``uploads`` is empty)."""
    def finish() -> None:
        errors = [e for e in (u.future.exception() for u in uploads) if e is not None]
        if errors:
            e = errors[0]
            result.set_exception(PersistError(
                f"persist_durably(after={after}) of log {log_id} failed: "
                f"{type(e).__name__}: {e}; the changes are kept and will be re-sent"))
            return
        segs = sorted({u.segment for u in uploads if u.segment is not None},
                      key=lambda s: (s.sqn_min, s.path, s.offset))
        result.set_result(StateChangelogHandle(job_path, log_id, key_group_range, after,
                                               sqn_to, tuple(segs)))

    def settle() -> None:
        try:
            finish()
        except Exception as e:  # noqa: BLE001 - never leave the future pending
            if not result.done():
                result.set_exception(PersistError(f"cannot build handle: {e}"))

    when_all_done([u.future for u in uploads], settle)


def after_both(handle: concurrent.futures.Future, marked: concurrent.futures.Future,
               result: concurrent.futures.Future) -> None:
    """``result`` gets ``handle``'s outcome once ``marked`` (the node took our mark) is done
    too; a mark the node did not take fails it (the handle must not go out)."""
    def done(_: concurrent.futures.Future) -> None:
        if not (handle.done() and marked.done()) or result.done():
            return
        e = marked.exception() or handle.exception()
        try:
            if e is not None:
                result.set_exception(e)
            else:
                result.set_result(handle.result())
        except concurrent.futures.InvalidStateError:
            pass  # the other callback was first

    handle.add_done_callback(done)
    marked.add_done_callback(done)
