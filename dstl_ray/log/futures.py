"""Waiting on several futures at once without a thread that waits: :func:`when_all_done`."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Collection


def when_all_done(futures: Collection[concurrent.futures.Future], fn: Callable[[], None]
                  ) -> None:
    """Call ``fn`` once every one of ``futures`` is done, exactly once: at once, in this
    thread, when they all are already (none, or a checkpoint without new changes: no
    callback per future), else from the thread that completes the last of them."""
    pending = [f for f in futures if not f.done()]
    if not pending:
        fn()
        return
    left = [len(pending)]
    lock = threading.Lock()

    def one_done(_: concurrent.futures.Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()

    for f in pending:
        f.add_done_callback(one_done)
