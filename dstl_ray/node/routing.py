"""Where a batch goes (FLIP-158 "Future directions"; docs/architecture.md "Write path" 4):
forward-or-flush, up-front routing over a horizon, forwarding with deadlines, and answers that
come after this node stopped waiting. If the parent is unreachable the node flushes itself:
slower, never lost, never stuck."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..config import ChangelogConfig
from ..errors import DeadlineError, DstlError, StorageError
from ..format.segment import Segment
from ..observability import tracing
from ..observability.metrics import NodeMetrics
from ..transport.base import PersistRequest
from ..transport.lane import Sent
from ..transport.sender import Caller
from .batching import Clock, Pending
from .flush import Flusher, Result
from .peers import LATE_ANSWER_WAIT_S, Peers, Place
from .sources import Sources
from .stats import NodeCounters
from .throttle import ByteBudget

log = logging.getLogger(__name__)

REPLY_GRACE_S = 2.0  # a parent's answer in transit after its deadline, at most
# (peers.LATE_ANSWER_WAIT_S: how long a child listens for an answer it stopped waiting for,
# to release it unused; a later one stays until the job's next recovery deletes what no
# checkpoint names)


def should_flush(has_parent: bool, batch_bytes: int, flush_bytes: int) -> bool:
    """A node writes the batch itself if it is the root or holds at least ``flush_bytes``;
    otherwise it forwards the whole batch to its parent (FLIP-158 "Future directions": each
    node proxies requests up to the root unless it has gathered enough data)."""
    return not has_parent or batch_bytes >= flush_bytes


# what releasing a request's segment needs (not its bytes): the lane's record of a request
Released = Sent

# releases a segment written here: (job, path, log, used, caller, offset) -> deleted?
ReleaseHere = Callable[[str, str, str, bool, Caller | None, int], Awaitable[bool]]


class Router:
    """Sends each batch: forwarded as ONE request to the upstream, or flushed here."""

    def __init__(self, place: Place, config: ChangelogConfig, peers: Peers, sources: Sources,
                 flusher: Flusher, counters: NodeCounters, metrics: NodeMetrics,
                 release_here: ReleaseHere, clock: Clock | None = None) -> None:
        self.place = place
        # the batches' clock: their arrival and deadlines are its times
        self._now = clock.now if clock is not None else time.monotonic
        self.config = config
        self.peers = peers
        self.sources = sources
        self.flusher = flusher
        self.counters = counters
        self.metrics = metrics
        self._release_here = release_here
        # up-front routing: the ancestor that flushed our last batch, used directly for
        # the next ``routing_horizon`` batches
        self.route: str | None = None
        self.route_left = 0
        self.budget: ByteBudget | None = None  # in-flight upload bytes, made on first use
        self.late_answers: set[asyncio.Task] = set()  # forwards we stopped waiting for
        # an answer that comes over a lane after we stopped waiting (its future cancelled)
        peers.late = self.release_late

    def upstream(self) -> str | None:
        return self.route if self.route_left > 0 else self.place.parent

    def drop_route(self) -> None:
        self.route, self.route_left = None, 0

    def request_budget(self) -> float:
        """How long a writer's request may take here, all levels above included: each
        level may wait for its batch and need a full upload (all attempts) to flush itself
        should its parent fail; the root is ``level`` hops away."""
        c, p = self.config, self.place
        per_level = (self.flush_reserve() + c.persist_max_wait_s
                     + c.persist_delay_s * (2 + p.level + p.height))
        return per_level * (p.level + 2)

    def flush_reserve(self) -> float:
        c = self.config
        return c.max_attempts * (c.upload_timeout_s + c.retry_delay_s) + 1.0

    def expired(self, r: PersistRequest) -> DeadlineError:
        return DeadlineError(f"persist request of log {r.log_id} (job {r.job_id}) passed its "
                             f"deadline at node {self.place.name}")

    # ------------------------------------------------------------------ a batch

    async def dispatch(self, batch: list[Pending]) -> None:
        """Send ``batch`` within the in-flight byte budget; resolve every sender's future."""
        if self.budget is None:
            self.budget = ByteBudget(self.config.in_flight_limit)
        now = self._now()
        for p in batch:  # their senders gave up already: write nothing for them
            if now > p.deadline and not p.future.done():
                self.counters.deadline_expired += len(p.requests)
                p.future.set_result([self.expired(r) for r in p.requests])
        batch = [p for p in batch if not p.future.done()]
        if not batch:
            return
        requests = [r for p in batch for r in p.requests]
        total = sum(p.size for p in batch)
        spans: list[Any] = []
        for p in batch:
            wait_ms = (now - p.arrived) * 1000
            self.metrics.batch_wait(wait_ms)
            for sp in p.spans or ():
                sp.set_attribute("dstl.batch_wait_ms", wait_ms)
                sp.set_attribute("dstl.batch_bytes", total)
                sp.set_attribute("dstl.batch_requests", len(requests))
                spans.append(sp)
        await self.budget.acquire(total)
        self.metrics.in_flight(self.budget.used)
        try:
            try:
                results = await self.forward_or_flush(requests, total, spans,
                                                      min(p.deadline for p in batch))
            except Exception as e:  # noqa: BLE001 - every waiter learns the cause
                results = [e] * len(requests)
            pos = 0
            for p in batch:
                mine = results[pos:pos + len(p.requests)]
                pos += len(p.requests)
                if self._now() > p.deadline:
                    # its sender stopped waiting: what we wrote for it is nobody's
                    self.counters.deadline_expired += len(p.requests)
                    await self.release_late(p.requests, mine)
                    mine = [self.expired(r) for r in p.requests]
                if not p.future.done():
                    p.future.set_result(mine)
        finally:
            await self.budget.release(total)
            self.metrics.in_flight(self.budget.used)

    async def forward_or_flush(self, requests: list[PersistRequest], total: int,
                               spans: list[Any] | None = None,
                               deadline: float = float("inf")) -> list[Result]:
        name, parent = self.place.name, self.place.parent
        flush = should_flush(parent is not None, total, self.config.flush_bytes)
        if parent is not None and flush != self.sources.flushes_self:
            self.sources.flushes_self = flush
            await self.sources.sync_registration()
        # the parent gets what is left of our deadline, less what we need to flush ourselves
        # should it fail: then no level's timeout expires together with its parent's
        budget = deadline - self._now() - self.flush_reserve() - REPLY_GRACE_S
        if flush or budget <= 0:
            return await self.flusher.flush(requests, spans)
        target = self.upstream()
        assert target is not None
        for sp in spans or ():
            sp.set_attribute("dstl.action", "forward")
            sp.set_attribute("dstl.target", target)
            sp.set_attribute("dstl.bypass", target != parent)
        if spans:  # the next level's spans become children of ours
            requests = [dataclasses.replace(r, trace=tuple(tracing.carrier(sp).items()))
                        for r, sp in zip(requests, spans, strict=True)]
        try:
            segs = await self.forward(target, requests, budget)
        except Exception as e:  # noqa: BLE001 - upstream unreachable
            if not (isinstance(e, TimeoutError) and self.peers.alive(target)):
                # (a deadline that passed at a stalled peer still ALIVE in Ray, its frame
                # perhaps never sent, keeps its lane: the next batch goes on it)
                self.peers.drop(target)
            if target != parent:
                # any failure drops the routing decision; go the normal way once more
                self.counters.route_failures += 1
                log.warning("%s: routed send to %s failed (%s); back to parent %s",
                            name, target, e, parent)
                self.drop_route()
                await self.sources.sync_registration()
                self.metrics.error("route")
                return await self.forward_or_flush(requests, total, spans, deadline)
            self.counters.forward_failures += 1
            self.metrics.error("forward")
            self.sources.forget_registration()
            log.warning("%s: forwarding to %s failed (%s); flushing to DFS myself",
                        name, parent, e)
            for sp in spans or ():
                sp.add_event("parent unreachable, flushing myself", {"error": str(e)})
            return await self.flusher.flush(requests, spans)
        self.counters.forwards += 1
        self.counters.bytes_forwarded += total
        self.metrics.forwarded(total, bypass=target != parent)
        if target != parent:
            self.counters.routed_direct += 1
            self.route_left -= 1
            if self.route_left <= 0:
                self.drop_route()  # horizon used up: next batch goes via the parent
                await self.sources.sync_registration()
        else:
            await self.learn_route([x for x in segs if isinstance(x, Segment)])
        return await self.flush_failed(requests, segs, spans)

    async def flush_failed(self, requests: list[PersistRequest], results: list[Result],
                           spans: list[Any] | None) -> list[Result]:
        """Requests the upstream could not write (its DFS failed, or it was too late) are
        flushed here: slower, never lost. Refusals (namespace, incarnation) stand."""
        redo = [i for i, x in enumerate(results)
                if isinstance(x, (StorageError, DeadlineError))]
        if not redo:
            return results
        for i in redo:
            log.warning("%s: upstream failed request of job %s (%s); flushing it myself",
                        self.place.name, requests[i].job_id, results[i])
        again = await self.flusher.flush([requests[i] for i in redo],
                                         [spans[i] for i in redo] if spans else None)
        out = list(results)
        for i, x in zip(redo, again, strict=True):
            out[i] = x
        return out

    async def learn_route(self, segs: list[Segment]) -> None:
        """Up-front routing: if an ancestor above our parent flushed this batch, send the
        next ``routing_horizon`` batches straight to it; when the horizon is used up, go
        through the parent again and decide anew."""
        horizon = self.config.routing_horizon
        flusher = segs[0].flushed_by if segs else None
        if horizon > 0 and flusher and flusher not in (self.place.name, self.place.parent):
            self.route, self.route_left = flusher, horizon
            await self.sources.sync_registration()

    # ------------------------------------------------------------------ forwarding

    async def forward(self, target: str, requests: list[PersistRequest], budget_s: float
                      ) -> list[Result]:
        """``target`` writes nothing for us after ``budget_s`` and releases what it wrote
        late; we wait a little longer for an answer already on its way. An answer later
        still (a parent paused past its deadline and the grace) is released unused when it
        comes: we flushed those requests ourselves, nobody will name its segments."""
        # over a lane, the batch's frame is dropped unsent if a stalled target took none of
        # it within the budget; a stall never breaks the lane (no leak, no early failure)
        sent, by_lane = self.peers.send(target, "persist_batch", requests, self.place.name,
                                        budget_s, time.time(), timeout_s=budget_s)
        self.counters.forwards_by_lane += by_lane
        answer = asyncio.wrap_future(sent)
        try:
            segs = await asyncio.wait_for(asyncio.shield(answer), budget_s + REPLY_GRACE_S)
        except TimeoutError:
            keys = [Released(r.job_id, r.log_id, r.caller) for r in requests]
            task = asyncio.get_running_loop().create_task(self._late_answer(answer, keys))
            self.late_answers.add(task)
            task.add_done_callback(self.late_answers.discard)
            raise
        if len(segs) != len(requests):
            raise DstlError(f"{target} returned {len(segs)} results for "
                            f"{len(requests)} requests")
        return segs

    async def _late_answer(self, answer: asyncio.Future, requests: list[Released]) -> None:
        try:
            results = await asyncio.wait_for(answer, LATE_ANSWER_WAIT_S)
        except BaseException:  # noqa: BLE001 - no answer (or too late: recovery cleans up)
            return
        if isinstance(results, list) and len(results) == len(requests):
            self.counters.late_answers_released += 1
            await self.release_late(requests, results)

    async def release_late(self, requests: list[PersistRequest] | list[Released],
                           results: list[Result]) -> None:
        """Segments written for a sender that gave up: release them unused, so the file
        goes once nobody else in it needs it (at whichever node flushed it)."""
        for r, x in zip(requests, results, strict=True):
            if isinstance(x, BaseException):
                continue
            try:
                if x.flushed_by == self.place.name:
                    await self._release_here(r.job_id, x.path, r.log_id, False, r.caller,
                                             x.offset)
                else:
                    self.peers.actor(x.flushed_by).release.remote(
                        r.job_id, x.path, r.log_id, False, r.caller, x.offset)
            except Exception as e:  # noqa: BLE001 - recovery's orphan cleanup covers it
                log.debug("%s: cannot release late segment %s: %s", self.place.name, x.path,
                          e)
