"""Who a request comes from, as writers stamp it and node actors check it: the Ray namespace
and Ray job of the sending process (:class:`Caller`; a node admits a job's requests only from
its own namespace, ``dstl_ray.node.namespaces``), and the run of the job that sent it
(:class:`Incarnation`; the job lease hands it out, ``dstl_ray.checkpoint.lease``, and nodes keep a
job's state per incarnation, ``dstl_ray.node.jobs``). Both travel in every
:class:`~dstl_ray.transport.base.PersistRequest`, so they live with the request, below both
the writer and the node.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DstlError


@dataclass(frozen=True)
class Caller:
    """The Ray namespace and Ray job id of the process that sends a request, and whether
    that process is the Ray job's driver (a driver, a Spark Python worker): then the job's
    death is the process's (dstl_ray.node.dead_writers); an actor or task of a job may outlive it
    (detached actors) or die before it."""

    namespace: str
    ray_job: str = ""
    driver: bool = False


def current_caller(namespace: str | None = None) -> Caller:
    """This process's namespace (or ``namespace``: a process working for a job whose driver
    runs elsewhere, e.g. a Spark Python worker, speaks for the driver's namespace) and its
    Ray job id. Ray must be initialized."""
    import ray

    ctx = ray.get_runtime_context()
    worker = ray._private.worker.global_worker
    return Caller(namespace or ctx.namespace, ctx.get_job_id() or "",
                  worker.mode == ray._private.worker.SCRIPT_MODE)


@dataclass(frozen=True)
class Incarnation:
    """One run of a job: ``epoch`` orders incarnations, ``holder`` names the driver."""

    epoch: int
    holder: str

    def __str__(self) -> str:
        return f"{self.epoch}-{self.holder}"

    @classmethod
    def parse(cls, text: str) -> Incarnation | None:
        """``""`` (a writer outside any coordinated job) gives None."""
        if not text:
            return None
        epoch, sep, holder = text.partition("-")
        if not sep or not epoch.isdigit() or not holder.isalnum():
            raise DstlError(f"bad job incarnation {text!r} (want EPOCH-HOLDER)")
        return cls(int(epoch), holder)
