"""Telling the node actor that wrote a file which logs name it: retain and release
(docs/architecture.md "Write path" 2, "Many jobs, one tree" and "File merging"; FLIP-306
"Cleanup": a shared file is deleted once nothing names it any more).

A node actor counts, per file it uploaded, the logs whose sections are in it, and deletes
the file once every one of them released its section unused or the checkpoints that used it
are subsumed. Two messages change that count, both sent to the actor that wrote the file
(``Segment.flushed_by``), which is not always this process's own node:

* **retain**: a restored writer names a section of a dead writer's file too. Synchronous,
  and before any request of this process can carry a watermark that would free the file. A
  node that is alive but unreachable fails the restore (to be retried): it still tracks the
  file and could free it under the restored writer. A node that is gone or restarted forgot
  its files and never deletes them: nothing to tell.
* **release**: a log is done with a section (used by a checkpoint or not). In the background
  (callers hold a backend's lock or are the transport's delivery thread, and finding an
  actor is a call to Ray's GCS), best effort: a lost release leaves an orphan that the
  cleanup after recovery removes (FLIP-158 "Cleanup after recovery").

A persist call answered after the writers stopped waiting for it (its deadline passed, or its
lane failed it) reports segments nobody will name: they are released unused
(:meth:`Retention.release_unused`), so their node deletes the files.

The Ray calls are injected (``find_actor``, ``get``), so the logic is tested without a cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import NamespaceError, NodeUnavailableError
from ..storage.deleter import Deleter, background_deleter
from .node_lookup import Get, ray_get

if TYPE_CHECKING:
    from ..format.segment import Segment

log = logging.getLogger(__name__)

# the handle of the node actor named so (raises ValueError if there is none)
FindActor = Callable[[str], Any]


def ray_find_actor(namespace: str) -> FindActor:
    """``ray.get_actor`` in ``namespace`` (looked up at call time: tests replace it)."""

    def find(name: str) -> Any:
        import ray

        return ray.get_actor(name, namespace=namespace)

    return find


class Retention:
    """Retains and releases of one job's segments at the node actors that wrote them.
    ``caller`` (the process's :class:`dstl_ray.transport.sender.Caller`) is passed as is."""

    def __init__(self, namespace: str, job_id: str, caller: object, *,
                 find_actor: FindActor | None = None, get: Get = ray_get,
                 deleter: Deleter | None = None) -> None:
        self.job_id = job_id
        self._caller = caller
        self._find = find_actor or ray_find_actor(namespace)
        self._get = get
        self._deleter = deleter or background_deleter()  # releases run off callers' locks
        self.released_unused = 0  # segments of late answers released unused

    def retain(self, segment: Segment, log_id: str, incarnation: str = "") -> None:
        """Tell the node actor that wrote ``segment`` that ``log_id`` names it too; raises
        :class:`NodeUnavailableError` when that node may still free it without knowing."""
        import ray

        what = f"node {segment.flushed_by} that log {log_id} names {segment.path}"
        try:
            node = self._find(segment.flushed_by)
        except ValueError:
            return  # no actor of that name: the node is gone, it forgot its files
        except Exception as e:  # noqa: BLE001 - GCS unreachable: it may hold the file
            raise NodeUnavailableError(f"cannot tell {what}: {e}") from e
        try:
            self._get(node.retain.remote(self.job_id, segment.path, segment.offset, log_id,
                                         self._caller, incarnation), 30.0)
        except ray.exceptions.ActorUnavailableError as e:  # (a RayActorError too)
            # alive but not reachable now: it still tracks the file and would free it
            raise NodeUnavailableError(f"cannot tell {what}: {e}") from e
        except ray.exceptions.RayActorError:
            pass  # that node actor died or restarted: it forgot its files, never deletes
        except NamespaceError:
            raise
        except Exception as e:  # noqa: BLE001 - unsure whether it holds the file for us
            # the node raised (a ValueError among them: Ray's RayTaskError is also an
            # instance of its cause's class), so it is alive and did not take the retain
            raise NodeUnavailableError(f"cannot tell {what}: {e}") from e

    def release(self, segment: Segment, log_id: str, used: bool,
                last_checkpoint: int = -1) -> None:
        """Tell the node that wrote ``segment`` that ``log_id`` is done with it, in the
        background."""
        self._deleter.submit(lambda: self.release_now(segment, log_id, used, last_checkpoint),
                             f"{segment.path} (release by log {log_id})")

    def release_now(self, segment: Segment, log_id: str, used: bool,
                    last_checkpoint: int = -1) -> None:
        """:meth:`release`, on this thread (best effort: a failure is logged)."""
        try:
            node = self._find(segment.flushed_by)
            node.release.remote(self.job_id, segment.path, log_id, used, self._caller,
                                segment.offset, last_checkpoint)
        except Exception as e:  # noqa: BLE001 - orphan cleanup after recovery covers it
            log.debug("release of %s failed: %s", segment.path, e)

    def release_unused(self, node: str, segments: list[tuple[str, Segment]]) -> None:
        """The segments (with the log each is for) of an answer that came after its writers
        stopped waiting: they re-sent (or will re-send) those changes, so release them
        unused and their node deletes the files once nothing else is in them."""
        for log_id, segment in segments:
            self.released_unused += 1
            log.info("late answer from %s: releasing %s of log %s unused",
                     node, segment.path, log_id)
            self.release(segment, log_id, False)

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Wait until the releases handed over so far reached their nodes' actor queues."""
        return self._deleter.flush(timeout)
