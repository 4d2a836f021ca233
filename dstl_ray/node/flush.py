"""Writing a batch to the DFS (docs/architecture.md "Write path" 5): ONE file per job for the
whole batch (FLIP-158 "Implementation notes"), or, with FLIP-306 file merging across
checkpoints, an append to this node's open file of the job (dstl_ray.merging.segments); and the
releases and retains of what was written (dstl_ray.upload.release)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from ..config import ChangelogConfig
from ..errors import DstlError, StorageError
from ..format.changelog import FILE_SUFFIX, assemble_file
from ..format.segment import Segment, check_relative_path
from ..merging.pool import FileMergingOptions
from ..merging.segments import SEGMENTS_DIR, UNMANAGED_DIR, FlushFiles
from ..observability import tracing
from ..observability.metrics import NodeMetrics
from ..storage.base import Storage, join
from ..transport.base import PersistRequest
from ..upload.release import UploadRegistry
from ..upload.uploader import Uploader
from .dead_writers import DeadWriters
from .jobs import Jobs
from .peers import Place
from .stats import NodeCounters

Result = Segment | BaseException  # per request: its segment, or why it failed


class Flusher:
    """This node's writes to the DFS and the reference counts of what it wrote."""

    def __init__(self, place: Place, node_key: str, base_path: str, config: ChangelogConfig,
                 storage: Storage, uploader: Uploader, merging: FileMergingOptions,
                 jobs: Jobs, dead: DeadWriters, counters: NodeCounters,
                 metrics: NodeMetrics) -> None:
        self.place = place
        self.node_key = node_key
        self.base_path = base_path
        self.config = config
        self.storage = storage
        self.uploader = uploader
        self.merging = merging
        self.jobs = jobs
        self.dead = dead
        self.counters = counters
        self.metrics = metrics
        self.uploads = UploadRegistry()  # one file per job and batch: path -> its sections
        # FLIP-306 across checkpoints: each job's flushes appended to this node's open file
        self.files: dict[str, FlushFiles] = {}

    def set_storage(self, storage: Storage) -> None:
        """Later uploads (and their cleanup) use ``storage``; in-flight ones keep theirs."""
        self.storage = storage
        self.uploader.storage = storage
        for ff in self.files.values():
            ff.storage = storage

    # ------------------------------------------------------------------ write

    async def flush(self, requests: list[PersistRequest], spans: list[Any] | None = None
                    ) -> list[Result]:
        """Write ONE file per job holding every request of the batch. Jobs are independent
        ("Many jobs, one tree"): a job whose write fails gets its error, the others their
        segments; a request of a job's older incarnation is not written at all."""
        by_job: dict[str, list[int]] = {}
        out: list[Result | None] = [None] * len(requests)
        for i, r in enumerate(requests):
            out[i] = self.jobs.stale(r)
            if out[i] is None:
                by_job.setdefault(r.job_id, []).append(i)
        errors = await asyncio.gather(
            *(self._flush_job(j, idx, requests, out, spans) for j, idx in by_job.items()),
            return_exceptions=True)
        for idx, e in zip(by_job.values(), errors, strict=True):
            if isinstance(e, BaseException):
                for i in idx:
                    out[i] = e if isinstance(e, DstlError) else StorageError(
                        f"flush of job {requests[i].job_id} failed at node {self.place.name}: "
                        f"{type(e).__name__}: {e}")
        assert all(x is not None for x in out)
        return out  # type: ignore[return-value]

    async def _flush_job(self, job_id: str, idx: list[int], requests: list[PersistRequest],
                         out: list[Result | None], spans: list[Any] | None) -> None:
        name, level = self.place.name, self.place.level
        sections = [requests[i].section for i in idx]
        data, offsets = assemble_file(sections)
        rel = f"dstl/{self.node_key}/{uuid.uuid4().hex}{FILE_SUFFIX}"
        path = join(self.base_path, job_id, rel)
        job_dir = join(self.base_path, job_id) + "/"
        job_spans = [spans[i] for i in idx] if spans else []
        for sp in job_spans:
            sp.set_attribute("dstl.action", "flush")
            sp.set_attribute("dstl.file", rel)
        if self.merging.across:
            await self._append(job_id, idx, requests, data, offsets, out, job_spans)
            return
        attempts0 = self.uploader.stats.attempts
        t0 = time.monotonic()
        with tracing.span("dstl.dfs.put",
                          tracing.carrier(job_spans[0]) if job_spans else None,
                          links=[tracing.link_to(tracing.carrier(sp))
                                 for sp in job_spans[1:]],
                          node=name, level=level, file=rel, bytes=len(data),
                          logs=len(idx)) as put:
            try:
                # a retry or hedge may win under its own name: use the name that landed
                path = await asyncio.to_thread(
                    self.uploader.write, path, data,
                    tracing.carrier(put) if put is not None else None)
                rel = check_relative_path(path[len(job_dir):])
            except StorageError as e:
                self.counters.flush_failures += 1
                self.metrics.error("dfs")
                if put is not None:
                    put.set_attribute("dstl.error", str(e))
                raise
            finally:
                if put is not None:
                    put.set_attribute("dstl.attempts", self.uploader.stats.attempts - attempts0)
        self.metrics.dfs_request(len(data), (time.monotonic() - t0) * 1000, len(idx))
        self.counters.files_flushed += 1
        self.counters.bytes_flushed += len(data)
        # one entry per section: a log may have two requests in one batch (a
        # pre-emptive upload and the checkpoint's); each is released on its own
        self.uploads.track(path, ((requests[i].log_id, off)
                                  for i, off in zip(idx, offsets, strict=True)))
        for i, off in zip(idx, offsets, strict=True):
            s = requests[i].section
            out[i] = Segment(rel, off, len(s.data), s.sqn_min, s.sqn_max, name)

    def job_files(self, job_id: str) -> FlushFiles:
        """The job's merged files of its current incarnation, in
        ``segments/{incarnation}/{node}/`` (``none`` for writers outside a coordinated job)."""
        ff = self.files.get(job_id)
        if ff is None:
            inc = self.jobs.incarnations.get(job_id)
            ff = self.files[job_id] = FlushFiles(
                self.storage, join(self.base_path, job_id),
                f"{SEGMENTS_DIR}/{inc or UNMANAGED_DIR}/{self.node_key}", self.merging)
            for log_id, bound in self.dead.bounds_for(job_id).items():
                ff.forget(log_id, bound)  # (no files yet: nothing written)
        return ff

    async def _append(self, job_id: str, idx: list[int], requests: list[PersistRequest],
                      data: bytes, offsets: list[int], out: list[Result | None],
                      spans: list[Any]) -> None:
        """FLIP-306 across checkpoints: the flush goes to the end of this node's open file
        for the job; section offsets shift by where it landed."""
        ff = self.job_files(job_id)
        t0 = time.monotonic()
        with tracing.span("dstl.dfs.append",
                          tracing.carrier(spans[0]) if spans else None,
                          node=self.place.name, level=self.place.level, bytes=len(data),
                          logs=len(idx)):
            parts = [(requests[i].log_id, off) for i, off in zip(idx, offsets, strict=True)]
            for attempt in range(1, self.config.max_attempts + 1):
                try:  # a failed append closes its file; the next attempt takes a new one
                    rel, base = await asyncio.to_thread(ff.append, data, parts)
                    break
                except DstlError as e:
                    self.counters.flush_failures += 1
                    self.metrics.error("dfs")
                    if attempt == self.config.max_attempts:
                        raise StorageError(f"cannot append to a merged file of {job_id} "
                                           f"after {attempt} attempts: {e}") from e
                    await asyncio.sleep(self.config.retry_delay_s)
        self.metrics.dfs_request(len(data), (time.monotonic() - t0) * 1000, len(idx))
        self.counters.files_flushed += 1
        self.counters.bytes_flushed += len(data)
        for sp in spans:
            sp.set_attribute("dstl.file", rel)
        for i, off in zip(idx, offsets, strict=True):
            s = requests[i].section
            out[i] = Segment(rel, base + off, len(s.data), s.sqn_min, s.sqn_max,
                             self.place.name)

    # ------------------------------------------------------------------ references

    def subsumed(self, job_id: str, checkpoint_id: int) -> None:
        """The job's checkpoints up to ``checkpoint_id`` are subsumed: merged files only
        they name may go (in a worker thread; never waited for)."""
        ff = self.files.get(job_id)
        if ff is not None:
            asyncio.get_running_loop().run_in_executor(None, ff.subsumed, checkpoint_id)

    async def retain(self, job_id: str, rel_path: str, offset: int, log_id: str) -> bool:
        """A restored writer's backend names an older section of a merged file (see
        :meth:`FlushFiles.retain`); it releases it like its own uploads."""
        ff = self.files.get(job_id)
        rel = check_relative_path(rel_path)
        if ff is None or not ff.owns(rel):
            return False
        return await asyncio.to_thread(ff.retain, rel, offset, log_id)

    async def release(self, job_id: str, rel_path: str, log_id: str, used: bool,
                      offset: int = 0, last_checkpoint: int = -1) -> bool:
        """A writer no longer needs its segment of ``rel_path``. Once every log in the file
        released it and none of them gave it out in a handle, the file is deleted (a
        pre-emptive upload that no checkpoint used). Returns True if the file was deleted."""
        path = join(self.base_path, job_id, check_relative_path(rel_path))
        ff = self.files.get(job_id)
        if ff is not None and ff.owns(rel_path):
            await asyncio.to_thread(ff.release, rel_path, offset, log_id, used,
                                    last_checkpoint)
            return False
        if not self.uploads.release(path, (log_id, offset), used):
            return False
        await asyncio.to_thread(self.storage.delete, path)
        self.counters.files_deleted += 1
        return True

    async def forget_logs(self, bounds: dict[str, dict[str, int]]) -> None:
        """Release these logs' sections of merged files up to their bounds (per job)."""
        for job_id, logs in bounds.items():
            ff = self.files.get(job_id)
            if ff is not None:
                for log_id, bound in logs.items():
                    await asyncio.to_thread(ff.forget, log_id, bound)

    def drop_job(self, job_id: str) -> None:
        """The job restarted or was forgotten: its open merged files are abandoned."""
        ff = self.files.pop(job_id, None)
        if ff is not None:
            ff.abandon()

    def holds(self, job_id: str) -> bool:
        """Whether files of the job are tracked here (the job is not forgotten then)."""
        ff = self.files.get(job_id)
        return ((ff is not None and ff.size() != 0)
                or self.uploads.any_under(join(self.base_path, job_id) + "/"))

    def merged_stats(self) -> dict[str, Any]:
        return {j: ff.stats_dict() for j, ff in self.files.items()}

    def entries(self) -> dict[str, int]:
        return {"files": len(self.uploads),
                "merged_files": sum(ff.size() for ff in self.files.values())}
