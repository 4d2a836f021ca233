"""The direct transport: no node actors, each request written to DFS by the writer's own
process (tests, one-process jobs)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import uuid
from typing import Any

from ..config import ChangelogConfig
from ..format.changelog import FILE_SUFFIX, assemble_file
from ..format.segment import Segment
from ..observability import tracing
from ..storage.base import join, normalize_url
from ..storage.deleter import background_deleter
from ..storage.registry import get_storage, storage_for
from ..upload.release import UploadRegistry
from ..upload.uploader import Uploader
from .base import PersistRequest, check_job_id

log = logging.getLogger(__name__)

# its files' directory under {job}/dstl/ (and its segments' flushed_by): direct-<pid>; a
# file there holds one section (state/registry.py shared_changelog_file)
DIRECT_PREFIX = "direct-"


class DirectTransport:
    """No tree: every persist request becomes its own file, written from this process.

    Used by unit tests (with ``memory://``) and as the ``direct`` baseline of experiments.
    """

    def __init__(self, job_id: str, base_path: str, config: ChangelogConfig | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.job_id = check_job_id(job_id)
        self.config = config or ChangelogConfig()
        tracing.configure(self.config.tracing)
        self.base_path = normalize_url(base_path)
        self.job_path = join(self.base_path, job_id)
        self.storage = (get_storage(self.base_path, storage_options)
                        if storage_options is not None
                        else storage_for(self.base_path, self.config))
        self.uploader = Uploader(self.storage, self.config)
        self._deleter = background_deleter()  # release runs under a backend's lock
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)
        self.node_key = f"{DIRECT_PREFIX}{os.getpid()}"
        self.files = UploadRegistry()  # one file per request: its one section

    def register(self, log_id: str) -> None:
        pass

    def unregister(self, log_id: str) -> None:
        pass

    def send(self, request: PersistRequest) -> concurrent.futures.Future[Segment]:
        def write() -> Segment:
            data, (off,) = assemble_file([request.section])
            rel = f"dstl/{self.node_key}/{uuid.uuid4().hex}{FILE_SUFFIX}"
            written = self.uploader.write(join(self.job_path, rel), data)
            rel = written[len(self.job_path) + 1:]  # a retry or hedge may win under its name
            self.files.track(rel, [(request.log_id, off)])
            s = request.section
            return Segment(rel, off, len(s.data), s.sqn_min, s.sqn_max, self.node_key)

        return self._pool.submit(write)

    def release(self, segment: Segment, log_id: str, used: bool,
                last_checkpoint: int = -1) -> None:
        if self.files.release(segment.path, (log_id, segment.offset), used):
            self._deleter.delete(self.storage, join(self.job_path, segment.path))

    def flush_releases(self, timeout: float | None = 60.0) -> bool:
        """Wait until the deletes of released files handed over so far ran."""
        return self._deleter.flush(timeout)
