"""Values that travel between writers and node actors, and the transport a writer uses."""

from __future__ import annotations

import concurrent.futures
import re
from dataclasses import dataclass
from typing import Protocol

from ..config import ChangelogConfig
from ..errors import ConfigError
from ..format.changelog import EncodedSection
from ..format.segment import Segment
from .sender import Caller


@dataclass(frozen=True)
class PersistRequest:
    """ONE request of one writer: its encoded changesets not yet uploaded (docs/architecture.md "Write path" 2)."""

    job_id: str
    section: EncodedSection
    source: str  # the sender as its node counts it: a log id (hex) or a child node's name
    trace: tuple[tuple[str, str], ...] = ()  # W3C trace context of the sender's span
    # the checkpoint this request makes durable (Flink: persist(from, checkpointId)); -1 for a
    # pre-emptive upload. Nodes use it to keep one checkpoint's requests in one batch.
    checkpoint_id: int = -1
    # who sent it (stamped by the transport): node actors accept a job's requests only from
    # the job's own Ray namespace (dstl_ray.node.namespaces)
    caller: Caller | None = None
    # the job's subsumed watermark as the writer knows it (FLIP-306 4.4): nodes free merged
    # changelog files once no retained checkpoint can name them
    subsumed: int = -1
    # the run of the job it belongs to (dstl_ray.transport.sender.Incarnation; "" outside a
    # coordinated job): nodes keep a job's state per incarnation and refuse older ones
    incarnation: str = ""
    # the newest checkpoint id its log made a handle for (dstl_ray.log.writer: ``named``), so
    # its node knows how far a dead writer's sections may be named
    named: int = -1
    # the process that holds the writer (stamped by the transport; "" unknown): a node does
    # not wait for a late writer whose process has a request of its own unanswered there,
    # since a process whose writers persist in turn sends nothing until that answer
    # (dstl_ray.node.batching)
    process: str = ""

    @property
    def size(self) -> int:
        return len(self.section.data)

    @property
    def log_id(self) -> str:
        return self.section.log_id.hex()


class Transport(Protocol):
    """How a writer reaches DFS: a node actor of the tree, or direct uploads."""

    job_path: str
    config: ChangelogConfig

    def register(self, log_id: str) -> None: ...

    def unregister(self, log_id: str) -> None: ...

    def send(self, request: PersistRequest) -> concurrent.futures.Future[Segment]: ...

    def release(self, segment: Segment, log_id: str, used: bool,
                last_checkpoint: int = -1) -> None:
        """``log_id`` is done with ``segment``. Callers may hold a backend's lock, so the
        delete (or the call to its node) may run in the background; a transport that does
        so also has ``flush_releases(timeout) -> bool`` to wait for it."""


_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_job_id(job_id: object) -> str:
    """A job id names the job's directory: a plain name, checked where it enters."""
    if not isinstance(job_id, str) or not _JOB_ID.match(job_id):
        raise ConfigError(f"job id must match {_JOB_ID.pattern} (it names a directory), "
                          f"got {job_id!r}")
    return job_id
