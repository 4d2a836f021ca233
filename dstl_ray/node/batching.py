"""FLIP-158 "Implementation notes": when a node sends its batch (Flink's
``BatchingStateChangeUploadScheduler``). docs/architecture.md "Write path" 3.

A batch goes out ``persist_delay`` after its first request (once per level below this node),
at once when every registered source (local writer or child node) has a request pending or
marked the pending checkpoint, or when the buffered bytes pass ``persist_size_threshold``.
When the delay is over but sources that sent the job's previous checkpoint have not sent this
one yet (or, for a job's first checkpoint here, the sources registered for the job), the batch
waits for them, never longer than ``persist_max_wait_s`` after its first request. It never
waits for a writer whose process persists its writers one after the other and has a
checkpoint request unanswered here (in the batch, or sent on): that process sends nothing
until the answer. A job's first checkpoint here is held until sources of the
job stopped registering for a while (writers that start with the job register while its first
requests are on their way). A source silent for ``source_idle_s`` is dropped when a batch had
to wait for the delay.

Time comes from an injected :class:`Clock`, so every trigger is unit-tested with a manual
clock, without Ray or an event loop (Flink injects a ``ScheduledExecutorService``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..config import ChangelogConfig
from ..transport.base import PersistRequest
from .peers import Place
from .sources import Sources
from .stats import NodeCounters

log = logging.getLogger(__name__)


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic time and a timer: all the scheduler needs of the world."""

    def now(self) -> float: ...

    def call_later(self, delay: float, fn: Callable[[], None]) -> Cancellable: ...


class LoopClock:
    """The actor's clock: ``time.monotonic`` and timers on the running asyncio loop."""

    def now(self) -> float:
        return time.monotonic()

    def call_later(self, delay: float, fn: Callable[[], None]) -> Cancellable:
        return asyncio.get_running_loop().call_later(delay, fn)


@dataclass
class Pending:
    """One persist call waiting in the batch: a writer's request or a child's whole batch."""

    requests: list[PersistRequest]
    future: Any  # resolved with one result per request by whoever sends the batch
    source: str
    size: int
    spans: list[Any] | None = None  # one "dstl.node" span per request (tracing on)
    arrived: float = 0.0  # clock time it arrived
    # clock time after which the sender no longer waits for the answer: its segments are
    # useless to it then (it flushed them itself, or failed its checkpoint)
    deadline: float = float("inf")


def _nothing() -> None:
    pass


class BatchScheduler:
    """The pending batch, what each source sent per checkpoint, and the send triggers.

    ``send(batch)`` receives each batch sent (never empty); ``before_send()`` runs first,
    while the batch is still pending; ``sources_changed()`` runs after idle sources were
    dropped (the node re-registers with its upstream).
    """

    def __init__(self, config: ChangelogConfig, place: Place, sources: Sources,
                 counters: NodeCounters, clock: Clock,
                 send: Callable[[list[Pending]], None],
                 before_send: Callable[[], None] = _nothing,
                 sources_changed: Callable[[], None] = _nothing) -> None:
        self.config = config
        self.place = place
        self.sources = sources
        self.counters = counters
        self.clock = clock
        self._send = send
        self._before_send = before_send
        self._sources_changed = sources_changed
        self.pending: list[Pending] = []
        self.pending_bytes = 0
        self.timer: Cancellable | None = None
        self.timer_at = 0.0  # clock time the timer fires
        self.extended = False  # the delay is over; waiting for late sources of a checkpoint
        self.waited_late = False  # this batch counted in ``waits_for_late`` already
        # process -> its checkpoint requests taken here and not answered yet (pending, or
        # sent on); processes seen persisting their writers one after the other (their
        # other writers cannot send before those answers), and the newest checkpoint
        # (job, id) of each process with a request answered here
        self.unanswered: dict[str, int] = {}
        self.in_turn: set[str] = set()
        self.answered_ckpt: dict[str, tuple[str, int]] = {}
        # job -> source -> the newest checkpoint id it sent a request (or a mark) for
        self.ckpt_seen: dict[str, dict[str, int]] = {}
        self.sent_for: dict[str, int] = {}  # job -> newest checkpoint id with a request here
        self.first_ckpt: dict[str, int] = {}  # job -> first checkpoint id seen here
        self.marked_up: dict[str, int] = {}  # job -> newest checkpoint id marked upstream

    # ------------------------------------------------------------------ input

    def add(self, item: Pending) -> None:
        """A request (or a child's batch) arrived: learn its checkpoints, then send the
        batch if a trigger fires, else make sure the delay timer runs."""
        self.sources.seen(item.source, item.arrived)
        for r in item.requests:
            if r.source == item.source:  # a writer's own request (a child's name differs)
                self.sources.writer_process(r.source, r.process)
            if r.checkpoint_id >= 0 and r.process:
                self.learn_turns(r)
            if r.checkpoint_id >= 0:
                self.first_ckpt.setdefault(r.job_id, r.checkpoint_id)
                seen = self.ckpt_seen.setdefault(r.job_id, {})
                seen[item.source] = max(seen.get(item.source, -1), r.checkpoint_id)
                self.sent_for[r.job_id] = max(self.sent_for.get(r.job_id, -1),
                                              r.checkpoint_id)
        self.pending.append(item)
        self.pending_bytes += item.size
        if not self.maybe_send_now() and self.timer is None:
            self.arm(self.delay())

    def learn_turns(self, r: PersistRequest) -> None:
        """A checkpoint request of process ``r.process`` arrived. If the process has another
        one unanswered here, it persists its writers at once; if its request for the same
        checkpoint was answered already, one after the other (it waited for that answer)."""
        p = r.process
        if self.unanswered.get(p, 0) > 0:
            self.in_turn.discard(p)
        elif self.answered_ckpt.get(p) == (r.job_id, r.checkpoint_id):
            self.in_turn.add(p)
        self.unanswered[p] = self.unanswered.get(p, 0) + 1

    def answered(self, item: Pending) -> None:
        """``item`` was answered (its batch was sent, and written or failed): its process may
        send again."""
        for r in item.requests:
            if r.checkpoint_id >= 0 and r.process:
                self.answered_ckpt[r.process] = (r.job_id, r.checkpoint_id)
                left = self.unanswered.get(r.process, 0) - 1
                if left > 0:
                    self.unanswered[r.process] = left
                else:
                    self.unanswered.pop(r.process, None)
                    if r.process not in self.sources.process.values():
                        self.forget_process(r.process)

    def blocked(self) -> set[str]:
        """Processes that persist their writers in turn and wait for an answer here now."""
        return {p for p in self.unanswered if p in self.in_turn}

    def forget_process(self, process: str) -> None:
        """No writer of ``process`` is left here (requests forwarded by a child only pass)."""
        self.in_turn.discard(process)
        self.answered_ckpt.pop(process, None)

    def mark(self, job_id: str, source: str, checkpoint_id: int) -> None:
        """``source`` has nothing (more) to send for ``checkpoint_id``: a batch waiting for
        it stops waiting."""
        seen = self.ckpt_seen.setdefault(job_id, {})
        self.first_ckpt.setdefault(job_id, checkpoint_id)
        if source in self.sources.all():
            seen[source] = max(seen.get(source, -1), checkpoint_id)
        self.sources.marked(source, job_id, self.clock.now())
        self.maybe_send_now()

    def pass_mark_up(self, job_id: str, checkpoint_id: int) -> bool:
        """Whether the upstream should get the mark (once per checkpoint): nothing of this
        checkpoint was sent or is pending here, and no source of it is late."""
        if (self.sent_for.get(job_id, -1) < checkpoint_id
                and self.marked_up.get(job_id, -1) < checkpoint_id
                and not self.late_for(job_id, checkpoint_id)
                and not any(r.job_id == job_id and r.checkpoint_id == checkpoint_id
                            for p in self.pending for r in p.requests)):
            self.marked_up[job_id] = checkpoint_id
            return True
        return False

    def forget_source(self, source: str) -> None:
        """``source`` unregistered or was dropped: no batch waits for it any more."""
        for seen in self.ckpt_seen.values():
            seen.pop(source, None)
        live = set(self.sources.process.values()) | set(self.unanswered)
        for p in [p for p in self.answered_ckpt if p not in live]:
            self.forget_process(p)

    def forget_job(self, job_id: str) -> None:
        """The job restarted (a newer incarnation) or was forgotten: its knowledge goes."""
        self.ckpt_seen.pop(job_id, None)
        self.first_ckpt.pop(job_id, None)
        self.sent_for.pop(job_id, None)
        self.marked_up.pop(job_id, None)
        self.sources.registered_at.pop(job_id, None)

    def pending_jobs(self) -> set[str]:
        return {r.job_id for p in self.pending for r in p.requests}

    # ------------------------------------------------------------------ triggers

    def delay(self) -> float:
        """``persist_delay`` after the first pending request (FLIP-158 "Implementation
        notes"), once per level below us: a child's batch cannot arrive before the child's
        own delay, so a parent that waited only ``persist_delay`` would split checkpoints
        into several files whenever some source is late."""
        return self.config.persist_delay_s * (1 + self.place.height)

    def maybe_send_now(self) -> bool:
        if not self.pending:
            return False
        sources = self.sources.all()
        pending_sources = {p.source for p in self.pending}
        if self.pending_bytes >= self.config.persist_size_threshold:
            self.counters.sent_size += 1
        elif (hold := self.hold_left(self.clock.now())) > 0:
            self.wake_within(hold)  # then every source pending may send it
            return False
        elif sources and sources <= pending_sources | self.done_sources():
            self.counters.sent_all_pending += 1
        elif self.extended and not self.late_sources():
            self.counters.sent_late_arrived += 1
        else:
            return False
        self.send_batch()
        return True

    def on_timer(self) -> None:
        self.timer = None
        if self.pending:
            now = self.clock.now()
            due = self.pending[0].arrived + self.delay()
            if now < due - 1e-9:  # a first checkpoint's hold ended before the delay
                if not self.maybe_send_now() and self.timer is None:
                    self.arm(due - now)
                return
            left = self.config.persist_max_wait_s - (now - self.pending[0].arrived)
            hold = self.hold_left(now)
            late = self.late_sources() if left > 0 else set()
            if left > 0 and (hold > 0 or late):
                self.extended = True
                if late and not self.waited_late:
                    self.waited_late = True
                    self.counters.waits_for_late += 1
                self.arm(hold if hold > 0 else left)
                return
            self.counters.sent_delay += 1
            self.drop_idle_sources()
        self.send_batch()

    def arm(self, after: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer_at = self.clock.now() + after
        self.timer = self.clock.call_later(after, self.on_timer)

    def wake_within(self, after: float) -> None:
        """The timer fires ``after`` from now at the latest."""
        if self.timer is None or self.timer_at > self.clock.now() + after:
            self.arm(after)

    def late_sources(self) -> set[str]:
        """Sources that sent a request for a job's previous checkpoint but not yet for the
        one pending here: their request is on its way, and the checkpoint cannot complete
        without it, so waiting keeps the checkpoint in one file at no cost to its duration.
        Not a writer whose process persists its writers one after the other (writers in one
        Ray actor, an executor running more subtasks than it has cores) and has a
        checkpoint request unanswered here: its next writer's request comes only after that
        answer, so waiting for it would only delay both by ``persist_max_wait_s``. A
        process seen persisting its writers at once is waited for as before, so they share
        one batch even when one of them is late (:meth:`learn_turns`)."""
        late: set[str] = set()
        for job, cid in self.newest_checkpoints().items():
            late |= self.late_for(job, cid)
        return late

    def newest_checkpoints(self) -> dict[str, int]:
        newest: dict[str, int] = {}
        for p in self.pending:
            for r in p.requests:
                if r.checkpoint_id >= 0:
                    newest[r.job_id] = max(newest.get(r.job_id, -1), r.checkpoint_id)
        return newest

    def done_sources(self) -> set[str]:
        """Sources that already sent (or marked) the newest pending checkpoint of a job:
        the "every source is pending" trigger need not wait for them."""
        done: set[str] = set()
        for job, cid in self.newest_checkpoints().items():
            done |= {s for s, c in self.ckpt_seen.get(job, {}).items() if c >= cid}
        return done

    def late_for(self, job_id: str, checkpoint_id: int) -> set[str]:
        seen = self.ckpt_seen.get(job_id, {})
        previous = max((c for c in seen.values() if c < checkpoint_id), default=None)
        blocked = self.blocked()
        sources = {s for s in self.sources.all() if self.sources.process_of(s) not in blocked}
        if previous is None:
            if self.first_ckpt.get(job_id) != checkpoint_id:
                return set()
            # the job's first checkpoint here (after a deploy, a restart of this actor): the
            # sources that registered for the job and have not sent it yet. A child's first
            # forward comes after its own delay and its first calls, later than ours times
            # out. Only the first: a registered source that never sends costs one wait
            return {s for s in sources
                    if self.sources.of_job(s, job_id) and seen.get(s, -1) < checkpoint_id}
        return {s for s, c in seen.items() if c == previous and s in sources}

    def hold_left(self, now: float) -> float:
        """How much longer a job's first checkpoint here is held (0: not held). Writers that
        start with the job register while its first requests are on their way, and a node
        sent its first batch as soon as the sources it knew of were pending: one file per
        node that learned of the job too late. So the batch waits until no source of the
        job registered here (a writer, a child naming the job) for ``persist_max_wait_s`` / 4,
        never longer than ``persist_max_wait_s`` after its first request; the sources that
        registered meanwhile are then waited for as late ones (:meth:`late_for`)."""
        if not self.pending:
            return 0.0
        quiet = self.config.persist_max_wait_s / 4
        held = [self.sources.registered_at[job] + quiet
                for job, cid in self.newest_checkpoints().items()
                if job in self.sources.registered_at and self.is_first(job, cid)]
        if not held:
            return 0.0
        until = max(held)
        until = min(until, self.pending[0].arrived + self.config.persist_max_wait_s)
        return max(0.0, until - now)

    def is_first(self, job_id: str, checkpoint_id: int) -> bool:
        """Whether ``checkpoint_id`` is the job's first checkpoint here (after a deploy, a
        restart of this actor, a new run of the job)."""
        seen = self.ckpt_seen.get(job_id, {})
        return (self.first_ckpt.get(job_id) == checkpoint_id
                and not any(c < checkpoint_id for c in seen.values()))

    def drop_idle_sources(self) -> None:
        """A batch had to wait for the delay: forget sources silent for ``source_idle_s``
        (a killed writer process or a vanished child never unregisters), so later batches go
        out as soon as every live source is pending again. A dropped source that sends
        again is counted again (``persist`` / ``persist_batch``)."""
        if self.config.source_idle_s <= 0:
            return
        # never sooner than a few batching delays: a live source that is merely late
        # (checkpoints taken one writer after another) is still waited for
        idle_s = max(self.config.source_idle_s, 4 * self.delay())
        idle = self.sources.drop_idle(self.clock.now(), idle_s,
                                      {p.source for p in self.pending})
        for s in idle:
            self.forget_source(s)
        if idle:
            self.counters.idle_sources_dropped += len(idle)
            log.info("%s: %d idle source(s) no longer waited for", self.place.name, len(idle))
            self._sources_changed()

    def send_batch(self) -> None:
        self._before_send()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.extended = self.waited_late = False
        batch, self.pending, self.pending_bytes = self.pending, [], 0
        if batch:
            self.counters.batches += 1
            self._send(batch)

    def entries(self) -> dict[str, int]:
        return {"ckpt_seen": sum(len(v) for v in self.ckpt_seen.values()),
                "sent_for": len(self.sent_for), "marked_up": len(self.marked_up),
                "first_ckpt": len(self.first_ckpt), "unanswered": len(self.unanswered),
                "processes_answered": len(self.answered_ckpt)}
