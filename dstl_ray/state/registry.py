"""The shared state registry (Flink's SharedStateRegistry; FLIP-158 "Cleanup").

Several handles, of several backends and checkpoints, may refer to one changelog file
(FLIP-158 "StateChangelog", point 4). Reference counts are keyed by the file's full,
normalized URL, not by its name as in FLIP-158: names are unique within one job directory,
but a restore may name a copy of the job's directory (a backup), whose files have the job's
own names at other paths. Keyed by name, protecting the copy (NO_CLAIM) kept the job's own
files forever, and the job's files and the copy's shared one count and one URL (the other
never deleted). A file is deleted only when

* no retained or pending checkpoint references it (per checkpoint, a file counts once),
* no live backend pins it: changelog segments its writer may still put into the next handle
  (sqn after the last materialization) and its current materialized state,
* no checkpoint that was already pending when the count dropped to zero is still pending
  (its handles may resolve later and name the file), and
* it is not protected (files of a checkpoint restored in NO_CLAIM mode are never deleted),
* it does not lie in a claimed directory: a subtask's directory of merged files (FLIP-306
  4.3) belongs to the subtask while it lives or while the newest checkpoint names it; the
  subtask deletes those files itself, by segment use and subsumed watermark. Once nobody
  claims a directory (its subtask rescaled away), its files go by reference count here.

Thread-safe. Deletes run outside the lock, on a background :class:`~dstl_ray.storage.deleter.Deleter`:
pins change under a backend's lock and on a client's delivery thread, which a slow object
store delete must not hold up (a file decided dead stays dead, so deleting it later is safe
as long as the driver that decided it still holds the job: each delete carries the registry's
``guard``, checked again right before it runs, and a fenced driver's queued deletes are
skipped, leaving the files to the next recovery's orphan cleanup).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterable, Mapping

from ..errors import DstlError
from ..storage.base import normalize_url
from ..storage.deleter import Deleter, background_deleter
from ..storage.registry import get_storage
from ..transport.direct import DIRECT_PREFIX

log = logging.getLogger(__name__)


def _delete_url(url: str) -> None:
    get_storage(url).delete(url)


def file_key(url: str) -> str:
    """The registry's key of the file at ``url``: its normalized URL, the one spelling its
    storage lists it under (:func:`~dstl_ray.storage.base.normalize_url`): one file, one
    key, whether a checkpoint named it or a listing found it (``memory:///m/f`` and a
    listing's ``memory://m/f`` are one key; two files of one name at two paths, two keys).
    Every key of the registry, claimed directories' included, is made here."""
    return normalize_url(url)


CheckpointRef = int | str  # what a checkpoint's references are held under: id or metadata URL


def shared_changelog_file(url: str) -> bool:
    """A node actor's changelog file (``{job}/dstl/<node>/<uuid>.dstl``): it holds the
    sections of many logs, and may hold two of one. DirectTransport's files
    (``dstl/direct-<pid>/``) hold one section each."""
    parts = url.rsplit("/", 3)
    return (len(parts) == 4 and parts[1] == "dstl" and parts[3].endswith(".dstl")
            and not parts[2].startswith(DIRECT_PREFIX))


def _ref(checkpoint: CheckpointRef) -> CheckpointRef:
    return checkpoint if isinstance(checkpoint, int) else file_key(checkpoint)


class SharedStateRegistry:
    """Reference counts of shared state files, by normalized URL (:func:`file_key`).

    The methods take files as mappings name -> URL (a checkpoint's ``files``); only the URLs
    count, the names are the callers' labels."""

    def __init__(self, delete: Callable[[str], None] = _delete_url,
                 list_files: Callable[[str], list[str]] | None = None,
                 deleter: Deleter | None = None) -> None:
        """``delete`` deletes one URL; it runs on ``deleter`` (default: the process's
        background deleter)."""
        self._delete = delete
        self._deleter = deleter
        # lists a directory that nobody claims any more: its files the registry forgot
        # (their owner was to delete them, and may have died first) become candidates
        self._list_files = list_files
        self._lock = threading.Lock()
        self._refs: dict[str, int] = {}
        self._urls: dict[str, str] = {}
        self._by_checkpoint: dict[CheckpointRef, set[str]] = {}
        self._pins: dict[str, set[str]] = {}
        self._pending: set[int] = set()
        self._last_started = 0
        # keys (file_key) below; _urls maps a key to the URL to delete
        self._candidates: dict[str, int] = {}  # key -> last started checkpoint when it hit 0
        # a node actor's changelog file may hold sections no handle named yet (other logs',
        # a pre-emptive one): such a candidate waits for a checkpoint started after it to
        # *complete* (it names every section still needed), or for the job's close
        self._last_completed = -1
        self._closing = False
        self._protected: set[str] = set()
        self._claims: dict[str, frozenset[str]] = {}  # owner -> directory URL prefixes
        # the most recent deletions (bounded: a long run deletes without end)
        self.deleted: collections.deque[str] = collections.deque(maxlen=1000)
        self.deleted_count = 0
        # raises a DstlError when this registry may no longer delete (a fenced driver)
        self.guard: Callable[[], None] | None = None

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_started(self, checkpoint_id: int) -> None:
        with self._lock:
            self._pending.add(checkpoint_id)
            self._last_started = max(self._last_started, checkpoint_id)

    def register(self, checkpoint: CheckpointRef, files: Mapping[str, str]) -> None:
        """Add ``files`` (name -> URL) to the references of ``checkpoint``: its metadata
        URL (the coordinator's: two retained checkpoints of one id, the job's own and a
        claimed one of another job, hold their references apart) or its id."""
        with self._lock:
            names = self._by_checkpoint.setdefault(_ref(checkpoint), set())
            for url in files.values():
                name = file_key(url)
                self._urls.setdefault(name, url)
                if name not in names:
                    names.add(name)
                    self._refs[name] = self._refs.get(name, 0) + 1
                    self._candidates.pop(name, None)

    def checkpoint_finished(self, checkpoint_id: int, completed: bool = False) -> None:
        """``checkpoint_id`` ``completed`` or was declined: it is no longer pending."""
        with self._lock:
            self._pending.discard(checkpoint_id)
            if completed:
                self._last_completed = max(self._last_completed, checkpoint_id)
        self.collect()

    def release(self, checkpoint: CheckpointRef) -> None:
        """Drop every reference of ``checkpoint`` (subsumed, declined or discarded); an id
        is no longer pending either."""
        with self._lock:
            if isinstance(checkpoint, int):
                self._pending.discard(checkpoint)
            for name in self._by_checkpoint.pop(_ref(checkpoint), set()):
                self._refs[name] -= 1
                if self._refs[name] == 0:
                    del self._refs[name]
                    self._maybe_candidate(name)
        self.collect()

    # ------------------------------------------------------------------ backend pins

    def set_pins(self, owner: str, files: Mapping[str, str]) -> None:
        """Replace the files ``owner`` (a live backend) may still reference."""
        with self._lock:
            old = self._pins.get(owner, set())
            new = {file_key(url) for url in files.values()}
            for url in files.values():
                name = file_key(url)
                self._urls.setdefault(name, url)
                self._candidates.pop(name, None)
            if new:
                self._pins[owner] = new
            else:
                self._pins.pop(owner, None)
            for name in old - new:
                self._maybe_candidate(name)
        self.collect()

    def unpin_all(self, owner: str) -> None:
        self.set_pins(owner, {})

    def consider(self, files: Mapping[str, str]) -> None:
        """``files`` (name -> URL) were given out in a handle that its backend will never
        name again, and perhaps nobody else does: a declined checkpoint's late snapshot,
        whose changes a materialization truncated before its upload landed (or that landed
        after the backend closed). Such a file was never pinned, so no unpin makes it a
        candidate; this does, as if it had been pinned and unpinned just now. The usual
        rules keep it while a checkpoint references it, a backend pins it, it is protected
        or claimed, or a checkpoint pending now is still pending (its handles may name it)."""
        with self._lock:
            for url in files.values():
                name = file_key(url)
                if name in self._refs or self._pinned(name) or name in self._protected:
                    continue  # known and kept: whatever drops its last use decides
                self._urls.setdefault(name, url)
                self._maybe_candidate(name)
        self.collect()

    def protect(self, urls: Mapping[str, str] | Iterable[str]) -> None:
        """Never delete the files at ``urls`` (a mapping name -> URL, or URLs): files this
        job does not own, e.g. of a NO_CLAIM restore. Files of the same names elsewhere (the
        job's own, when it restores from a copy of its directory) are not protected."""
        found = urls.values() if isinstance(urls, Mapping) else urls
        with self._lock:
            self._protected.update(file_key(u) for u in found)
            for n in self._protected:
                self._candidates.pop(n, None)

    # ------------------------------------------------------------------ claimed directories

    def set_claims(self, owner: str, directories: Iterable[str]) -> None:
        """Replace the directories ``owner`` claims (URLs); files there are not ours to
        delete. Files of directories no longer claimed become candidates if unreferenced.
        A claimed file nothing references any more is forgotten: its owner deletes it (a
        long run names ever new files). Should the owner die first, the directory is listed
        once nobody claims it, and its unreferenced files go like any other (without a
        lister, the orphan cleanup of the next recovery gets them)."""
        with self._lock:
            before = {p for ps in self._claims.values() for p in ps}
            new = frozenset(file_key(d) + "/" for d in directories)
            if new:
                self._claims[owner] = new
            else:
                self._claims.pop(owner, None)
            released = before - {p for ps in self._claims.values() for p in ps}
        listed = [u for p in sorted(released) if self._list_files is not None
                  for u in self._listing(p)]
        with self._lock:
            for url in listed:  # files the registry forgot, of a directory nobody claims
                key = file_key(url)
                self._urls.setdefault(key, key)
            for name in list(self._urls):
                if name in self._candidates:
                    if self._claimed(name):
                        del self._candidates[name]
                else:
                    self._maybe_candidate(name)
        self.collect()

    def _listing(self, prefix: str) -> list[str]:
        assert self._list_files is not None
        try:
            return self._list_files(prefix.rstrip("/"))
        except DstlError as e:  # the next recovery's orphan cleanup gets them
            log.warning("cannot list %s: %s", prefix, e)
            return []

    def _claimed(self, name: str) -> bool:
        """The file of key ``name`` lies in a claimed directory (keys and claims are both
        normalized: no spelling of either hides a claim)."""
        return name in self._urls and any(name.startswith(p) for ps in self._claims.values()
                                          for p in ps)

    # ------------------------------------------------------------------ queries

    def _pinned(self, name: str) -> bool:
        return any(name in p for p in self._pins.values())

    def _maybe_candidate(self, name: str) -> None:
        if (name not in self._refs and not self._pinned(name)
                and name not in self._protected and name in self._urls):
            if not self._claimed(name):
                self._candidates[name] = self._last_started
            else:
                del self._urls[name]  # its owner deletes it; nothing here needs the name

    def size(self) -> dict[str, int]:
        """Sizes of its tables (a long run must not grow them without bound)."""
        with self._lock:
            return {"refs": len(self._refs), "urls": len(self._urls),
                    "checkpoints": len(self._by_checkpoint),
                    "pins": sum(len(p) for p in self._pins.values()),
                    "pending": len(self._pending), "candidates": len(self._candidates),
                    "protected": len(self._protected), "claims": len(self._claims),
                    "deleted": len(self.deleted)}

    def reference_count(self, url: str) -> int:
        with self._lock:
            return self._refs.get(file_key(url), 0)

    def referenced(self) -> dict[str, str]:
        """Key (:func:`file_key`) -> URL of every file a checkpoint references or a backend
        pins."""
        with self._lock:
            names = set(self._refs).union(*self._pins.values()) if self._pins else set(
                self._refs)
            return {n: self._urls[n] for n in names}

    def checkpoint_files(self, checkpoint: CheckpointRef) -> set[str]:
        with self._lock:
            return set(self._by_checkpoint.get(_ref(checkpoint), set()))

    # ------------------------------------------------------------------ deletion

    @property
    def deleter(self) -> Deleter:
        """The deleter this registry's deletes run on."""
        return self._deleter or background_deleter()

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Wait for the deletes handed over so far (close paths, tests)."""
        return (self._deleter or background_deleter()).flush(timeout)

    def close(self, timeout: float | None = 60.0) -> bool:
        """The job stops (its backends closed, no checkpoint to come): candidates that wait
        for a completed checkpoint go now too; then :meth:`flush`."""
        with self._lock:
            self._closing = True
        self.collect()
        return self.flush(timeout)

    def collect(self) -> list[str]:
        """Delete every candidate no pending checkpoint can still name (in the background);
        returns their URLs. ``deleted`` and ``deleted_count`` count a file once its delete
        ran, not when it was handed over: one skipped because the driver was fenced
        meanwhile (or that failed, or was dropped) stays on storage and is not counted."""
        if self.guard is not None:
            try:
                self.guard()
            except DstlError as e:
                log.warning("not deleting unreferenced files: %s", e)
                return []
        with self._lock:
            oldest_pending = min(self._pending) if self._pending else None
            due = [n for n, epoch in self._candidates.items()
                   if (oldest_pending is None or oldest_pending > epoch)
                   and (self._closing or self._last_completed > epoch
                        or not shared_changelog_file(self._urls[n]))]
            urls = []
            for n in due:
                del self._candidates[n]
                if n in self._refs or self._pinned(n) or n in self._protected:
                    continue
                if self._claimed(n):  # its subtask deletes it
                    continue
                urls.append(self._urls.pop(n))
        deleter = self._deleter or background_deleter()
        for url in urls:  # a failed, lost or fenced delete: orphan cleanup after recovery
            deleter.submit(lambda url=url: self._delete_counted(url),
                           f"unreferenced state file {url}",
                           guard=self.guard)  # checked again right before it runs
        return urls

    def _delete_counted(self, url: str) -> None:
        self._delete(url)
        with self._lock:
            self.deleted.append(url)
            self.deleted_count += 1
