"""The node actor: one ``ChangelogNode`` per Ray node (design.md "Write path" 3-6).

It batches the persist requests it receives exactly as FLIP-158 "Implementation notes" say:
a batch is sent ``persist_delay`` after its first request, at once when every registered
source (local writer or child node) has a pending request, or when the buffered bytes pass
``persist_size_threshold``. Then forward-or-flush (FLIP-158 "Future directions"): the root, or
a node holding at least ``flush_bytes``, writes ONE file per job for the whole batch; any other
node forwards the batch to its parent as ONE request. If the parent is unreachable the node
flushes itself: slower, never lost, never stuck. Handles (segments) travel back to every writer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .config import ChangelogConfig
from .errors import DstlError, StorageError
from .format import FILE_SUFFIX, assemble_file
from .handle import Segment, check_relative_path
from .messages import PersistRequest
from .storage import get_storage, join, normalize_url
from .upload import Uploader

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    requests: list[PersistRequest]
    future: asyncio.Future
    source: str
    size: int
    arrived: float = field(default_factory=time.monotonic)


class _ByteBudget:
    """Bounded in-flight upload bytes (Flink: max-in-flight): acquirers wait when exceeded.
    A single batch larger than the limit is admitted alone, so nothing can deadlock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.waiting = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            self.waiting += 1
            try:
                await self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            finally:
                self.waiting -= 1
            self.used += n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


@dataclass
class NodeCounters:
    requests: int = 0  # persist requests received (writer or child batches)
    requests_from_children: int = 0
    batches: int = 0
    files_flushed: int = 0
    bytes_flushed: int = 0
    forwards: int = 0
    bytes_forwarded: int = 0
    forward_failures: int = 0
    flush_failures: int = 0
    files_deleted: int = 0


class ChangelogNode:
    """Body of the node actor; :func:`dstl_ray.topology.placement` wraps it with ``ray.remote``.

    All methods run on the actor's asyncio loop; file writes run in worker threads.
    """

    def __init__(self, node_id: str, name: str, base_path: str, config: ChangelogConfig,
                 parent: str | None = None, level: int = 0) -> None:
        self.node_id = node_id
        self.name = name
        self.node_key = check_relative_path(name)
        self.base_path = normalize_url(base_path)
        self.config = config
        self.parent = parent
        self.level = level
        self.raylet_pid = os.environ.get("RAY_RAYLET_PID", "")
        self.started = time.time()
        self.counters = NodeCounters()
        self._storage = get_storage(self.base_path)
        self._uploader = Uploader(self._storage, config)
        self._writers: dict[str, str] = {}  # log id -> job id
        self._children: set[str] = set()  # child nodes that forward to this one
        self._pending: list[_Pending] = []
        self._pending_bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self._budget: _ByteBudget | None = None
        self._registered_with_parent = False
        self._parent_handle: Any = None
        self._files: dict[str, tuple[set[str], list[bool]]] = {}  # path -> (logs, [kept])

    # ------------------------------------------------------------------ info

    async def info(self) -> dict[str, Any]:
        return {"name": self.name, "node_id": self.node_id, "base_path": self.base_path,
                "config": self.config.to_dict(), "raylet_pid": self.raylet_pid,
                "level": self.level, "parent": self.parent}

    async def ping(self) -> str:
        return self.name

    async def status(self) -> dict[str, Any]:
        c = self.counters
        return {
            "name": self.name, "node_id": self.node_id, "level": self.level,
            "parent": self.parent, "root": self.parent is None,
            "writers": len(self._writers), "children": sorted(self._children),
            "buffered_bytes": self._pending_bytes, "pending_requests": len(self._pending),
            "in_flight_bytes": self._budget.used if self._budget else 0,
            "requests": c.requests, "requests_from_children": c.requests_from_children,
            "batches": c.batches, "files_flushed": c.files_flushed,
            "bytes_flushed": c.bytes_flushed, "forwards": c.forwards,
            "bytes_forwarded": c.bytes_forwarded, "forward_failures": c.forward_failures,
            "flush_failures": c.flush_failures, "files_deleted": c.files_deleted,
            "upload_attempts": self._uploader.stats.attempts,
            "upload_retries": self._uploader.stats.retries,
            "raylet_pid": self.raylet_pid, "uptime_s": round(time.time() - self.started, 1),
        }

    async def set_parent(self, parent: str | None, level: int) -> None:
        """Re-attach (tree changes): later batches go to ``parent``."""
        if parent != self.parent:
            self._registered_with_parent = False
            self._parent_handle = None
        self.parent, self.level = parent, level
        await self._sync_parent_registration()

    # ------------------------------------------------------------------ sources

    async def register_writer(self, log_id: str, job_id: str) -> None:
        self._writers[log_id] = job_id
        await self._sync_parent_registration()

    async def unregister_writer(self, log_id: str) -> None:
        self._writers.pop(log_id, None)
        self._maybe_send_now()
        await self._sync_parent_registration()

    async def register_source(self, child: str) -> None:
        self._children.add(child)

    async def unregister_source(self, child: str) -> None:
        self._children.discard(child)
        self._maybe_send_now()

    def _sources(self) -> set[str]:
        return set(self._writers) | self._children

    async def _sync_parent_registration(self) -> None:
        want = bool(self._sources()) and self.parent is not None
        if want == self._registered_with_parent:
            return
        try:
            parent = self._parent_actor()
            if want:
                await parent.register_source.remote(self.name)
            else:
                await parent.unregister_source.remote(self.name)
            self._registered_with_parent = want
        except Exception as e:  # noqa: BLE001 - a missing parent only costs batching delay
            log.warning("%s: cannot (un)register with parent %s: %s", self.name, self.parent, e)

    def _parent_actor(self) -> Any:
        if self._parent_handle is None:
            import ray

            self._parent_handle = ray.get_actor(self.parent, namespace=self.config.namespace)
        return self._parent_handle

    # ------------------------------------------------------------------ persist

    async def persist(self, request: PersistRequest) -> Segment:
        """One writer's request; resolves to the segment holding it once durable."""
        segs = await self._enqueue([request], request.source)
        return segs[0]

    async def persist_batch(self, requests: list[PersistRequest], source: str) -> list[Segment]:
        """A child's whole batch, as ONE request; resolves to one segment per request."""
        self.counters.requests_from_children += 1
        return await self._enqueue(list(requests), source)

    async def _enqueue(self, requests: list[PersistRequest], source: str) -> list[Segment]:
        if self._budget is None:
            self._budget = _ByteBudget(self.config.in_flight_limit)
        for r in requests:
            if not isinstance(r, PersistRequest):
                raise DstlError(f"bad persist request {type(r).__name__}")
            check_relative_path(r.job_id)
        loop = asyncio.get_running_loop()
        item = _Pending(requests, loop.create_future(), source, sum(r.size for r in requests))
        self.counters.requests += 1
        self._pending.append(item)
        self._pending_bytes += item.size
        if not self._maybe_send_now() and self._timer is None:
            self._timer = loop.call_later(self.config.persist_delay_s, self._send_batch)
        return await item.future

    def _maybe_send_now(self) -> bool:
        if not self._pending:
            return False
        sources = self._sources()
        pending_sources = {p.source for p in self._pending}
        if (self._pending_bytes >= self.config.persist_size_threshold
                or (sources and sources <= pending_sources)):
            self._send_batch()
            return True
        return False

    def _send_batch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        if batch:
            self.counters.batches += 1
            asyncio.get_running_loop().create_task(self._dispatch(batch))

    async def _dispatch(self, batch: list[_Pending]) -> None:
        requests = [r for p in batch for r in p.requests]
        total = sum(p.size for p in batch)
        assert self._budget is not None
        await self._budget.acquire(total)
        try:
            segments = await self._forward_or_flush(requests, total)
            pos = 0
            for p in batch:
                n = len(p.requests)
                if not p.future.done():
                    p.future.set_result(segments[pos:pos + n])
                pos += n
        except Exception as e:  # noqa: BLE001 - every waiter learns the cause
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(e)
        finally:
            await self._budget.release(total)

    async def _forward_or_flush(self, requests: list[PersistRequest], total: int
                                ) -> list[Segment]:
        if self.parent is not None and total < self.config.flush_bytes:
            try:
                segs = await self._forward(requests)
                self.counters.forwards += 1
                self.counters.bytes_forwarded += total
                return segs
            except Exception as e:  # noqa: BLE001 - parent unreachable: flush ourselves
                self.counters.forward_failures += 1
                self._parent_handle = None
                self._registered_with_parent = False
                log.warning("%s: forwarding to %s failed (%s); flushing to DFS myself",
                            self.name, self.parent, e)
        return await self._flush(requests)

    async def _forward(self, requests: list[PersistRequest]) -> list[Segment]:
        parent = self._parent_actor()
        timeout = self.config.max_attempts * (self.config.upload_timeout_s
                                              + self.config.retry_delay_s) + 30.0
        segs = await asyncio.wait_for(parent.persist_batch.remote(requests, self.name), timeout)
        if len(segs) != len(requests):
            raise DstlError(f"parent {self.parent} returned {len(segs)} segments for "
                            f"{len(requests)} requests")
        return segs

    async def _flush(self, requests: list[PersistRequest]) -> list[Segment]:
        """Write ONE file per job holding every request of the batch."""
        by_job: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            by_job.setdefault(r.job_id, []).append(i)
        out: list[Segment | None] = [None] * len(requests)

        async def one_job(job_id: str, idx: list[int]) -> None:
            sections = [requests[i].section for i in idx]
            data, offsets = assemble_file(sections)
            rel = f"dstl/{self.node_key}/{uuid.uuid4().hex}{FILE_SUFFIX}"
            path = join(self.base_path, job_id, rel)
            try:
                await asyncio.to_thread(self._uploader.write, path, data)
            except StorageError:
                self.counters.flush_failures += 1
                raise
            self.counters.files_flushed += 1
            self.counters.bytes_flushed += len(data)
            self._files[path] = ({requests[i].log_id for i in idx}, [False])
            for i, off in zip(idx, offsets, strict=True):
                s = requests[i].section
                out[i] = Segment(rel, off, len(s.data), s.sqn_min, s.sqn_max, self.name)

        await asyncio.gather(*(one_job(j, idx) for j, idx in by_job.items()))
        return [s for s in out if s is not None]

    # ------------------------------------------------------------------ release

    async def release(self, job_id: str, rel_path: str, log_id: str, used: bool) -> bool:
        """A writer no longer needs its segment of ``rel_path``. Once every log in the file
        released it and none of them gave it out in a handle, the file is deleted (a
        pre-emptive upload that no checkpoint used). Returns True if the file was deleted."""
        check_relative_path(job_id)
        path = join(self.base_path, job_id, check_relative_path(rel_path))
        entry = self._files.get(path)
        if entry is None:
            return False
        logs, kept = entry
        logs.discard(log_id)
        kept[0] = kept[0] or used
        if logs:
            return False
        del self._files[path]
        if kept[0]:
            return False
        await asyncio.to_thread(self._storage.delete, path)
        self.counters.files_deleted += 1
        return True

    async def shutdown(self) -> None:
        self._uploader.close()
