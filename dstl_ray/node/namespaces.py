"""Which Ray namespace may send requests for which job (issue "security rules": node actors
accept a job's requests only from the job's own namespace).

A node actor serves every job of its tree, and job directories are named by job id under one
base path. Two applications in different Ray namespaces that both call their job "orders"
would otherwise append to, release and delete each other's changelog files. So each node
binds a job to the Ray namespace of the first process that registers a writer for it (or
sends a request), and refuses the job's requests from any other namespace with
:class:`~dstl_ray.errors.NamespaceError`.

A job restarted by a new driver in another (e.g. anonymous) namespace takes the job over once
every Ray job that used the old binding is dead (Ray's job table), so recovery after a driver
crash is not refused. While one of them lives, the job stays with its namespace.

Limits: Ray does not authenticate callers, so the caller's namespace is what the calling
process reports (:func:`current_caller`); the rule keeps well-behaved jobs apart, it is no
defence against code that lies about its namespace. Anyone who can reach the cluster can run
code in any namespace (see Ray's security documentation); protect the cluster itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import NamespaceError
from ..transport.sender import Caller

log = logging.getLogger(__name__)


def dead_ray_jobs(job_ids: Iterable[str]) -> bool:
    """True if Ray's job table marks every one of ``job_ids`` dead (unknown ids count as
    alive, and so does a table that cannot be read: never take a job over on doubt)."""
    ids = set(job_ids)
    if not ids:
        return True
    dead = dead_ray_job_ids(ids)
    return dead is not None and ids <= dead


def dead_ray_job_ids(job_ids: Iterable[str]) -> set[str] | None:
    """Those of ``job_ids`` that Ray's job table marks dead (unknown ids count as alive);
    None when the table could not be read."""
    try:
        from ray._private.state import state

        table = {e["JobID"]: e.get("IsDead", False) for e in state.job_table()}
    except Exception as e:  # noqa: BLE001 - no answer: nobody is taken for dead
        log.debug("job table lookup failed: %s", e)
        return None
    return {j for j in job_ids if table.get(j, False)}


@dataclass
class _Binding:
    namespace: str
    ray_jobs: set[str] = field(default_factory=set)


class JobNamespaces:
    """Job id -> the Ray namespace its requests must come from (one per node actor)."""

    def __init__(self, all_dead: Callable[[Iterable[str]], bool] = dead_ray_jobs) -> None:
        self._all_dead = all_dead
        self._bindings: dict[str, _Binding] = {}
        self.refused = 0
        self.taken_over = 0

    def namespace_of(self, job_id: str) -> str | None:
        b = self._bindings.get(job_id)
        return b.namespace if b else None

    def size(self) -> int:
        return len(self._bindings) + sum(len(b.ray_jobs) for b in self._bindings.values())

    def forget(self, job_id: str) -> None:
        """The job is gone from this node (idle for long): its next caller binds it anew."""
        self._bindings.pop(job_id, None)

    def admit(self, job_id: str, caller: object) -> None:
        """Bind ``job_id`` to ``caller``'s namespace, or check it is the bound one."""
        if not isinstance(caller, Caller) or not isinstance(caller.namespace, str):
            self.refused += 1
            raise NamespaceError(f"request for job {job_id!r} names no caller namespace "
                                 f"(got {type(caller).__name__}); send it through "
                                 f"dstl_ray's client")
        b = self._bindings.get(job_id)
        if b is None:
            self._bindings[job_id] = _Binding(caller.namespace, {caller.ray_job} - {""})
            return
        if b.namespace == caller.namespace:
            if caller.ray_job:
                b.ray_jobs.add(caller.ray_job)
            return
        if b.ray_jobs and self._all_dead(b.ray_jobs):
            log.info("job %s moves from Ray namespace %r to %r: every Ray job of the old "
                     "namespace ended", job_id, b.namespace, caller.namespace)
            self.taken_over += 1
            self._bindings[job_id] = _Binding(caller.namespace, {caller.ray_job} - {""})
            return
        self.refused += 1
        raise NamespaceError(f"job {job_id!r} belongs to Ray namespace {b.namespace!r}; "
                             f"refused a request from namespace {caller.namespace!r}")
