"""A node's sources (FLIP-158 "Implementation notes": the batch waits for every source): local
writers and child nodes, the jobs each has, when each was last heard of, and this node's own
registration as a source of its upstream. docs/architecture.md "Write path" 3.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from .peers import Peers, Place
from .stats import NodeCounters

log = logging.getLogger(__name__)

REGISTRATION_TIMEOUT_S = 5.0  # an upstream's (un)register_source call, at most


class Sources:
    """Who this node's batches wait for, and whom this node is a source of.

    ``upstream()`` names the node our batches go to (the parent, or a learned route)."""

    def __init__(self, place: Place, peers: Peers, counters: NodeCounters,
                 upstream: Callable[[], str | None]) -> None:
        self.place = place
        self.peers = peers
        self.counters = counters
        self._upstream = upstream
        self.writers: dict[str, str] = {}  # log id -> job id
        self.children: set[str] = set()  # child nodes that forward to this one
        # child -> the jobs it has sources of (told when it registers with us): before a
        # job's first checkpoint here, the sources a batch of that job waits for
        self.child_jobs: dict[str, frozenset[str]] = {}
        self.last_seen: dict[str, float] = {}  # source -> time of its last request
        # writer -> the process holding it (from its requests: PersistRequest.process), so a
        # batch does not wait for a writer queued behind its process's own request
        self.process: dict[str, str] = {}
        # job -> when a source of it last registered here (a writer, or a child newly
        # naming the job): a job's first checkpoint is held a little after that
        self.registered_at: dict[str, float] = {}
        # our last batch was big enough to flush ourselves: then our upstream should not
        # wait for us (it is re-registered as soon as we forward again)
        self.flushes_self = False
        self.registered_to: str | None = None  # upstream node we are a source of
        self.registered_jobs: frozenset[str] = frozenset()  # the jobs we told it of

    # ------------------------------------------------------------------ who

    def all(self) -> set[str]:
        return set(self.writers) | self.children

    def jobs(self) -> frozenset[str]:
        """The jobs this node has sources of: its writers' and its children's."""
        jobs = set(self.writers.values())
        for child in self.children:
            jobs |= self.child_jobs.get(child, frozenset())
        return frozenset(jobs)

    def writer_jobs(self) -> set[str]:
        return set(self.writers.values())

    def process_of(self, source: str) -> str:
        """The process holding writer ``source`` ("" for a child node, or not known yet)."""
        return self.process.get(source, "")

    def of_job(self, source: str, job_id: str) -> bool:
        return self.writers.get(source) == job_id or job_id in self.child_jobs.get(
            source, ())

    # ------------------------------------------------------------------ changes

    def add_writer(self, log_id: str, job_id: str, now: float | None) -> None:
        """A writer registered (``now``) or sent a request after this actor lost it (None:
        its request marks it seen)."""
        self.writers[log_id] = job_id
        if now is not None:
            self.last_seen[log_id] = now
            self.registered_at[job_id] = now

    def remove_writer(self, log_id: str) -> None:
        self.writers.pop(log_id, None)
        self.last_seen.pop(log_id, None)
        self.process.pop(log_id, None)

    def writer_process(self, log_id: str, process: str) -> None:
        """Writer ``log_id`` lives in ``process`` (told by its request)."""
        if process and log_id in self.writers:
            self.process[log_id] = process

    def add_child(self, child: str, jobs: Iterable[str] | None, now: float | None) -> None:
        """``child`` registered (``now``; with its jobs when it says), or sent a batch after
        this actor lost it (None)."""
        self.children.add(child)
        if now is not None:
            self.last_seen[child] = now
        if jobs is not None:
            new = frozenset(jobs)
            if now is not None:  # its subtree gained sources of these jobs just now
                for job in new - self.child_jobs.get(child, frozenset()):
                    self.registered_at[job] = now
            self.child_jobs[child] = new

    def remove_child(self, child: str) -> None:
        self.children.discard(child)
        self.child_jobs.pop(child, None)
        self.last_seen.pop(child, None)

    def child_sent(self, child: str, job_ids: Iterable[str]) -> None:
        """The jobs a child has sources of, should its registration (and job list) be lost."""
        self.child_jobs[child] = self.child_jobs.get(child, frozenset()) | set(job_ids)

    def seen(self, source: str, now: float) -> None:
        self.last_seen[source] = now

    def marked(self, source: str, job_id: str, now: float) -> None:
        """``source`` marked a checkpoint of ``job_id``."""
        if source in self.children:
            self.child_sent(source, (job_id,))
        self.last_seen[source] = now

    def drop_idle(self, now: float, idle_s: float, busy: set[str]) -> list[str]:
        """Forget the sources (not in ``busy``) silent for more than ``idle_s``; returns
        them."""
        idle = [s for s in self.all()
                if s not in busy and now - self.last_seen.get(s, now) > idle_s]
        for s in idle:
            self.writers.pop(s, None)
            self.children.discard(s)
            self.child_jobs.pop(s, None)
            self.last_seen.pop(s, None)
            self.process.pop(s, None)
        return idle

    # ------------------------------------------------------------------ upstream

    def forget_registration(self) -> None:
        """Our upstream failed: it will have forgotten us; register again next time."""
        self.registered_to, self.registered_jobs = None, frozenset()

    async def sync_registration(self) -> None:
        """Be a registered source of whichever node our batches go to, so that node's
        "every source is pending" trigger waits for us, and only for us while we send there."""
        want = self._upstream() if self.all() and not self.flushes_self else None
        have = self.registered_to
        jobs = self.jobs() if want is not None else frozenset()
        if want == have and jobs == self.registered_jobs:
            return
        self.registered_to, self.registered_jobs = want, jobs
        if want == have:
            have = None  # the same upstream: only tell it our jobs again
        # bounded: registration only helps batching, a persist request must never wait on
        # an upstream that is gone but not yet declared dead (a removed Ray node)
        limit = REGISTRATION_TIMEOUT_S
        name = self.place.name
        try:
            if have is not None:
                await asyncio.wait_for(self.peers.actor(have).unregister_source.remote(name),
                                       limit)
        except Exception as e:  # noqa: BLE001 - a dead upstream forgets us anyway
            log.debug("%s: cannot unregister from %s: %s", name, have, e)
        try:
            if want is not None:
                await asyncio.wait_for(self.peers.actor(want).register_source.remote(
                    name, sorted(jobs)), limit)
        except Exception as e:  # noqa: BLE001 - a missing upstream only costs batching delay
            self.counters.registration_failures += 1
            if self.registered_to == want:
                self.forget_registration()
            self.peers.drop(want)
            log.warning("%s: cannot register with %s: %s", name, want, e)

    def entries(self) -> dict[str, int]:
        return {"writers": len(self.writers), "children": len(self.children),
                "last_seen": len(self.last_seen), "child_jobs": len(self.child_jobs),
                "processes": len(self.process), "registered_at": len(self.registered_at)}
