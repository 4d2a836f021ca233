"""The one place that frees unused uploads (Flink's ``TaskChangelogRegistry``: startTracking /
release): a file written for several logs is deleted once every log released its section and
none of them gave the section out in a handle (a pre-emptive upload no checkpoint used).

Used by the node actor for the files it flushes and by ``DirectTransport`` for its own.
docs/architecture.md "Write path" 6.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

Section = tuple[str, int]  # (log id, offset of its section in the file)


class UploadRegistry:
    """Uploaded file -> the sections not yet released, and whether any was used.

    Thread-safe: ``DirectTransport`` releases from writers' threads. Deleting is the caller's
    job (on its own thread or executor): :meth:`release` only says when a file became unused.
    """

    def __init__(self) -> None:
        # path -> ({(log id, section offset)} not yet released, [used])
        self._files: dict[str, tuple[set[Section], list[bool]]] = {}
        self._lock = threading.Lock()

    def track(self, path: str, sections: Iterable[Section]) -> None:
        """``path`` was written holding ``sections``; each is released on its own (a log may
        have two sections in one file: a pre-emptive upload and the checkpoint's)."""
        with self._lock:
            self._files[path] = (set(sections), [False])

    def release(self, path: str, section: Section, used: bool) -> bool:
        """``section`` of ``path`` is no longer needed (``used``: it went out in a handle).
        True when the file just became unused: every section released, none used; the caller
        deletes it then. An unknown path (released already, or not ours) is False."""
        with self._lock:
            entry = self._files.get(path)
            if entry is None:
                return False
            logs, kept = entry
            logs.discard(section)
            kept[0] = kept[0] or used
            if logs:
                return False
            del self._files[path]
            return not kept[0]

    def __len__(self) -> int:
        return len(self._files)

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._files))

    def any_under(self, prefix: str) -> bool:
        """Whether a tracked file's path starts with ``prefix`` (a job's directory)."""
        with self._lock:
            return any(p.startswith(prefix) for p in self._files)
