"""The jobs a node serves (docs/architecture.md "Many jobs, one tree"): each request-taking
endpoint admits a job through its namespace (dstl_ray.node.namespaces), the fence of dead writers
(dstl_ray.node.dead_writers) and its incarnation (dstl_ray.checkpoint.lease); idle jobs are forgotten."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..errors import StaleIncarnationError
from ..format.segment import check_relative_path
from ..transport.base import PersistRequest
from ..transport.sender import Caller, Incarnation
from .dead_writers import DeadWriters
from .namespaces import JobNamespaces
from .peers import Place
from .stats import NodeCounters

log = logging.getLogger(__name__)

JOB_IDLE_S = 3600.0  # a job unheard of for this long (and without writers) is forgotten
JOB_CHECK_S = 60.0  # how often (at most) idle jobs are looked for, when a batch is sent


class Jobs:
    """Job id -> its newest incarnation and when it was last heard of.

    ``on_reset(job_id)`` drops a job's node-side state elsewhere (batching knowledge, merged
    changelog files, dead-writer bounds); ``active()`` names the jobs with writers or pending
    requests here and ``holds(job_id)`` whether files of a job are tracked here: neither kind
    is forgotten."""

    def __init__(self, place: Place, counters: NodeCounters, dead: DeadWriters,
                 namespaces: JobNamespaces, now: Callable[[], float],
                 on_reset: Callable[[str], None], active: Callable[[], set[str]],
                 holds: Callable[[str], bool]) -> None:
        self.place = place
        self.counters = counters
        self.dead = dead
        self.namespaces = namespaces
        self._now = now
        self._on_reset = on_reset
        self._active = active
        self._holds = holds
        # job -> its newest incarnation seen here (dstl_ray.checkpoint.lease): a job's node-side state
        # belongs to one incarnation and starts clean when a newer one appears
        self.incarnations: dict[str, Incarnation] = {}
        self.seen: dict[str, float] = {}  # job -> last time it was heard of
        self._checked = now()

    def admit(self, job_id: str, caller: Caller | None, incarnation: str = "") -> None:
        """Every request-taking endpoint: the job's namespace (dstl_ray.node.namespaces), then its
        incarnation. A newer incarnation resets the job's node-side state (batching
        knowledge, merged changelog files, the subsumed watermark): the job was restarted
        under the same id, and nothing the old run taught us may touch the new run's files.
        The old run's merged files are left alone (the new run's registry counts references
        to them like any shared file). Requests of an older incarnation are refused.
        Incarnations are ordered by their epoch, a counter the job keeps in storage (never
        a clock: dstl_ray.checkpoint.lease_record), so a restart from a host whose clock is
        behind is newer here, also after DELETE_ON_CANCELLATION or a deleted job directory."""
        check_relative_path(job_id)
        self.dead.check(caller)
        self.namespaces.admit(job_id, caller)
        self.seen[job_id] = self._now()
        inc = Incarnation.parse(incarnation)
        if inc is None:
            return  # a writer outside any coordinated job: whatever runs now
        cur = self.incarnations.get(job_id)
        if cur is None or (inc.epoch, inc.holder) > (cur.epoch, cur.holder):
            if cur is not None:
                log.info("%s: job %s restarted as incarnation %s (was %s): its node "
                         "state starts clean", self.place.name, job_id, inc, cur)
                self.counters.incarnations += 1
            self.incarnations[job_id] = inc
            self._on_reset(job_id)
        elif inc != cur:
            self.counters.stale_refused += 1
            raise StaleIncarnationError(
                f"job {job_id!r}: request of incarnation {inc} refused, node "
                f"{self.place.name} serves its newer incarnation {cur} (the job was started "
                f"again)")

    def stale(self, r: PersistRequest) -> StaleIncarnationError | None:
        """``r`` was admitted, but a newer incarnation of its job arrived since."""
        inc, cur = Incarnation.parse(r.incarnation), self.incarnations.get(r.job_id)
        if inc is None or cur is None or inc == cur:
            return None
        self.counters.stale_refused += 1
        return StaleIncarnationError(f"job {r.job_id!r}: request of incarnation {inc} "
                                     f"dropped, the job runs as incarnation {cur} now")

    def tick(self) -> None:
        """A batch goes out: look for idle jobs, at most every ``JOB_CHECK_S``."""
        now = self._now()
        if now - self._checked > JOB_CHECK_S:
            self._checked = now
            self.forget_idle()

    def forget_idle(self) -> None:
        """Nothing grows without bound on a long-lived tree: a job not heard of for
        ``JOB_IDLE_S``, with no writer registered here and no file of it tracked here (a
        job checkpointing rarely keeps its merged files and its namespace binding), loses
        its node-side state; a later request of it starts clean."""
        now = self._now()
        active = self._active()
        for job_id, seen in list(self.seen.items()):
            if now - seen > JOB_IDLE_S and job_id not in active and not self._holds(job_id):
                del self.seen[job_id]
                self.incarnations.pop(job_id, None)
                self._on_reset(job_id)
                self.namespaces.forget(job_id)
                self.counters.jobs_forgotten += 1
        for job_id in set(self.dead.dead_logs) | set(self.dead.newest):
            # bounds a release round sent for a job this node never served
            if job_id not in self.seen and not self._holds(job_id):
                self.dead.reset(job_id)
