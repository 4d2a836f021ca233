"""What a node takes in (FLIP-158 "API", the node side of ``persist`` and ``mark``;
docs/architecture.md "Write path" 3): each request-taking endpoint vets its caller (dead
writers), admits its job (namespace, incarnation), records its source and hands the request to
the batch scheduler; the sender's future resolves when its batch was sent."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ..errors import DstlError
from ..format.segment import Segment, check_relative_path
from ..observability import tracing
from ..observability.metrics import NodeMetrics
from ..transport.base import PersistRequest
from ..transport.sender import Caller
from .batching import BatchScheduler, Clock, Pending
from .dead_writer_check import DeadWriterCheck
from .flush import Flusher, Result
from .jobs import Jobs
from .peers import Peers, Place
from .routing import Router
from .sources import Sources
from .stats import NodeCounters

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, Any]], Any]  # runs a coroutine in the background


class Intake:
    """The node's request-taking endpoints, in the order each must check things."""

    def __init__(self, place: Place, peers: Peers, jobs: Jobs, dead: DeadWriterCheck,
                 sources: Sources, batching: BatchScheduler, router: Router,
                 flusher: Flusher, counters: NodeCounters, metrics: NodeMetrics,
                 clock: Clock, spawn: Spawn) -> None:
        self.place = place
        self.peers = peers
        self.jobs = jobs
        self.dead = dead
        self.sources = sources
        self.batching = batching
        self.router = router
        self.flusher = flusher
        self.counters = counters
        self.metrics = metrics
        self.clock = clock
        self._spawn = spawn

    # ------------------------------------------------------------------ sources

    async def register_writer(self, log_id: str, job_id: str, caller: Caller | None,
                              named: int | None) -> bool:
        await self.dead.vet(caller)
        self.jobs.admit(job_id, caller)
        self.sources.add_writer(log_id, job_id, self.clock.now())  # seen, registered now
        self.dead.registered(log_id, job_id, caller, named)
        await self.sources.sync_registration()
        return self.dead.on

    async def unregister_writer(self, log_id: str, caller: Caller | None) -> None:
        job_id = self.sources.writers.get(log_id)
        if job_id is None:
            self.dead.unregistered(log_id, caller, known=False)
            return
        self.jobs.admit(job_id, caller)
        self.sources.remove_writer(log_id)
        self.dead.unregistered(log_id, caller, known=True)
        self.batching.forget_source(log_id)
        self.batching.maybe_send_now()
        await self.sources.sync_registration()

    async def register_source(self, child: str, jobs: list[str] | None) -> None:
        self.sources.add_child(child, jobs, self.clock.now())
        await self.sources.sync_registration()

    async def unregister_source(self, child: str) -> None:
        self.sources.remove_child(child)
        self.batching.maybe_send_now()
        await self.sources.sync_registration()

    # ------------------------------------------------------------------ persist

    async def persist(self, request: PersistRequest) -> Segment:
        if not isinstance(request, PersistRequest):
            raise DstlError(f"bad persist request {type(request).__name__}")
        await self.dead.vet(request.caller)
        self.jobs.admit(request.job_id, request.caller, request.incarnation)
        self.dead.reported(request.source, request.job_id, request.caller, request.named)
        if request.source not in self.sources.writers:
            # registered with an earlier incarnation of this actor (Ray restarted it):
            # count it as a source again, so batches wait for it; the upstream learns of
            # us in the background (the request does not wait for that)
            self.sources.add_writer(request.source, request.job_id, None)
            self._spawn(self.sources.sync_registration())
        res = (await self.enqueue([request], request.source,
                                  self.router.request_budget()))[0]
        if isinstance(res, BaseException):
            raise res
        return res

    async def persist_batch(self, requests: list[PersistRequest], source: str,
                            budget_s: float | None, sent_at: float | None) -> list[Result]:
        self.counters.requests_from_children += 1
        if budget_s is not None and sent_at is not None:
            budget_s = min(budget_s, sent_at + budget_s - time.time())
        out: list[Result | None] = [None] * len(requests)
        admitted: list[int] = []
        for i, r in enumerate(requests):  # each request still names its first sender
            try:
                if not isinstance(r, PersistRequest):
                    raise DstlError(f"bad persist request {type(r).__name__}")
                # a node that missed a round's fence (restarted, joined since) refuses a
                # dead writer's forwarded requests too: nobody would release their sections
                await self.dead.vet(r.caller)
                self.jobs.admit(r.job_id, r.caller, r.incarnation)
                admitted.append(i)
            except DstlError as e:
                out[i] = e
        if source not in self.sources.children:  # registered before this actor restarted
            self.sources.add_child(source, None, None)
            self._spawn(self.sources.sync_registration())
        # the jobs it has sources of, should its registration (and job list) be lost
        self.sources.child_sent(source, (requests[i].job_id for i in admitted))
        if admitted:
            res = await self.enqueue([requests[i] for i in admitted], source,
                                     self.router.request_budget() if budget_s is None
                                     else budget_s)
            for i, x in zip(admitted, res, strict=True):
                out[i] = x
        return [x for x in out if x is not None]

    async def enqueue(self, requests: list[PersistRequest], source: str,
                      budget_s: float) -> list[Result]:
        """Into the pending batch; resolves to one result per request when it was sent."""
        for r in requests:
            if not isinstance(r, PersistRequest):
                raise DstlError(f"bad persist request {type(r).__name__}")
            check_relative_path(r.job_id)
        loop = asyncio.get_running_loop()
        spans = [tracing.start_span("dstl.node", dict(r.trace), node=self.place.name,
                                    level=self.place.level, bytes=r.size, log=r.log_id,
                                    source=source)
                 for r in requests] if tracing.enabled() else None
        now = self.clock.now()
        item = Pending(requests, loop.create_future(), source,
                       sum(r.size for r in requests), spans, arrived=now,
                       deadline=now + budget_s)
        for r in requests:
            if r.subsumed >= 0:
                self.flusher.subsumed(r.job_id, r.subsumed)
            if r.checkpoint_id >= 0:
                self.dead.saw(r.job_id, r.checkpoint_id)
        self.counters.requests += 1
        self.metrics.request()
        self.batching.add(item)
        try:
            segs = await item.future
        except BaseException as e:
            for sp in spans or ():
                tracing.end_span(sp, error=e)
            raise
        finally:  # its process may send its next writer's request now
            self.batching.answered(item)
        for sp, x in zip(spans or (), segs, strict=False):
            tracing.end_span(sp, error=x if isinstance(x, BaseException) else None)
        return segs

    async def mark(self, job_id: str, source: str, checkpoint_id: int,
                   caller: Caller | None, named: int | None) -> None:
        await self.dead.vet(caller)
        self.jobs.admit(job_id, caller)
        if type(checkpoint_id) is not int or checkpoint_id < (-1 if named is not None else 0):
            raise DstlError(f"bad checkpoint id {checkpoint_id!r}")
        if named is not None:
            self.dead.reported(source, job_id, caller, named)
        if checkpoint_id < 0:
            return
        self.dead.saw(job_id, checkpoint_id)
        self.batching.mark(job_id, source, checkpoint_id)
        upstream = self.router.upstream()
        if upstream is not None and self.batching.pass_mark_up(job_id, checkpoint_id):
            try:  # behind a stalled upstream, dropped unsent once a request would be late
                _, by_lane = self.peers.send(upstream, "mark", job_id, self.place.name,
                                             checkpoint_id, caller, None,
                                             timeout_s=self.router.request_budget())
                self.counters.marks_by_lane += by_lane
            except Exception as e:  # noqa: BLE001 - only batching suffers
                log.debug("%s: mark to %s failed: %s", self.place.name, upstream, e)

    # ------------------------------------------------------------------ references

    async def retain(self, job_id: str, rel_path: str, offset: int, log_id: str,
                     caller: Caller | None, incarnation: str) -> bool:
        await self.dead.vet(caller)
        self.jobs.admit(job_id, caller, incarnation)
        return await self.flusher.retain(job_id, rel_path, offset, log_id)

    async def release(self, job_id: str, rel_path: str, log_id: str, used: bool,
                      caller: Caller | None, offset: int = 0,
                      last_checkpoint: int = -1) -> bool:
        self.jobs.admit(job_id, caller)
        return await self.flusher.release(job_id, rel_path, log_id, used, offset,
                                          last_checkpoint)
