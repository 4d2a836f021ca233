"""The Ray transport: a writer process's persist calls, marks, retains and releases go to
its nearest node actor (FLIP-158 "Future directions"; docs/architecture.md "Write path")."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from typing import Any

from ..config import ChangelogConfig
from ..errors import (
    DstlError,
    FencedError,
    NamespaceError,
    NodeUnavailableError,
    PersistError,
)
from ..format.segment import Segment
from ..observability import tracing
from ..storage.base import join
from ..storage.deleter import background_deleter
from .auth import AUTH_MODE_ENV, use_cluster_auth_mode
from .base import PersistRequest
from .discovery import find_nearest_node
from .lane import Lane, LaneClosedError
from .lane_holder import WriterLane
from .sender import current_caller

log = logging.getLogger(__name__)


_Batch = list[tuple[PersistRequest, concurrent.futures.Future]]


def _fail_future(fut: concurrent.futures.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)


def get_while_restarting(call: Any, timeout: float = 60.0) -> Any:
    """``ray.get(call())``, calling again while the actor is restarting (Ray's
    ``ActorUnavailableError``: a node actor killed a moment ago comes back), until
    ``timeout``; then the last error."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(call(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def ensure_ray(namespace: str, address: str | None = None) -> None:
    """Connect this process to the Ray cluster if it is not connected yet: ``address``, else
    ``RAY_ADDRESS``, else a cluster started with ``ray start`` on this machine, else a new
    local Ray (as ``ray.init()`` does)."""
    import ray

    if not ray.is_initialized():
        target = address or os.environ.get("RAY_ADDRESS")
        use_cluster_auth_mode(target)  # the cluster's mode, or it cannot call us back
        ray.init(address=target, namespace=namespace, log_to_driver=False,
                 logging_level=logging.WARNING)


class RayNodeTransport:
    """Writers of one client talk to the nearest ``ChangelogNode`` actor. If that actor dies
    (Ray restarts it), the transport finds it again and re-registers its writers.

    Every persist call has a deadline (``persist_timeout_s``): a node actor that does not
    answer in time (hung, overloaded, its upstream stuck) fails the call's requests with
    :class:`PersistError`, so the writers send their changes again with their next request
    instead of waiting forever. When such a call answers after all, the segments it reports
    are released unused, so the node deletes files nobody will name.
    """

    def __init__(self, job_id: str, namespace: str, node_name: str | None = None,
                 caller_namespace: str | None = None) -> None:
        self.job_id = job_id
        self.namespace = namespace
        self._pinned = node_name
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._queue: list[tuple[PersistRequest, concurrent.futures.Future]] = []
        # calls sent and not answered: call number -> (deadline, its requests)
        self._inflight: dict[int, tuple[float, _Batch]] = {}
        self._calls = 0
        # awaited marks not taken yet: mark number -> (deadline, its future, what it was)
        self._marks: dict[int, tuple[float, concurrent.futures.Future, str]] = {}
        self.timeouts = 0  # persist calls (and awaited marks) failed by the deadline
        self.late_released = 0  # segments of late answers released unused
        self._deleter = background_deleter()  # releases run off the caller's locks
        self._sender: threading.Thread | None = None
        self._deliveries = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="dstl-deliver")
        self._logs: set[str] = set()
        self.acked_marks = False  # the tree merges changelog files: marks are awaited
        self._stale = True
        self.node_name = ""
        self.chosen_by = ""
        self._handle: Any = None
        # the node's local lane (dstl_ray.transport.lane) when it is on this machine: persist
        # calls and marks go there instead of through Ray
        self._lanes = WriterLane(lambda method, sent, results: self._deliveries.submit(
            self._release_late, [s.log_id for s in sent], results), self._note_cut)
        # node actors admit a job only from its own namespace (dstl_ray.node.namespaces)
        self._caller = current_caller(caller_namespace)
        self._process = _process_id()  # stamped on requests (PersistRequest.process)
        self._connect()
        info = get_while_restarting(self._handle.info.remote)  # first: it waits for a restart
        self._refresh_lane(self._handle)
        self.base_path: str = info["base_path"]
        self.config = ChangelogConfig.from_dict(info["config"])
        self.job_path = join(self.base_path, job_id)
        tracing.configure(self.config.tracing)

    @staticmethod
    def _call(ref: Any, timeout: float = 60.0) -> Any:
        import ray

        return ray.get(ref, timeout=timeout)

    def _connect(self) -> None:
        import ray

        if self._pinned:
            self.node_name, self.chosen_by = self._pinned, "pinned"
            try:
                self._handle = ray.get_actor(self._pinned, namespace=self.namespace)
            except ValueError:
                raise NodeUnavailableError(f"no node actor {self._pinned!r}") from None
        else:
            self.node_name, self._handle, self.chosen_by = find_nearest_node(self.namespace)
        self._stale = False

    def _refresh_lane(self, handle: Any) -> None:
        """(holding no lock: it asks the node) A lane to the node just found, if it offers
        one on this machine; the one we have if it still leads to that process."""
        self._lanes.refresh(self.node_name, handle,
                            lambda: self._call(handle.lane.remote(), timeout=30))

    @property
    def lane(self) -> Lane | None:
        """The open local lane to the node actor (None: Ray calls)."""
        return self._lanes.lane

    def _note_cut(self) -> None:
        """The lane's process is no longer our node actor: find the node again."""
        with self._lock:
            self._stale = True

    def _node_call(self, method: str, *args: Any, deadline: float | None = None) -> Any:
        """``method`` of the node actor (a future), over the lane when there is one, else by
        Ray. A lane found closed sent nothing: the call goes by Ray, and the node is found
        again (and a new lane opened) before the next one. ``deadline``: Lane.call's."""
        handle, lane = self._ensure(), self._lanes.lane
        if lane is not None:
            try:
                return lane.call(method, *args, deadline=deadline)
            except LaneClosedError:
                self._lanes.discard(lane)  # (not a lane another thread opened since)
                with self._lock:
                    self._stale = True
        return getattr(handle, method).remote(*args).future()

    def close(self) -> None:
        """Close the lane (the writers of this transport are closed already)."""
        self._lanes.close()

    def _ensure(self) -> Any:
        with self._lock:
            if not self._stale:
                return self._handle
            self._connect()
            for lg in self._logs:
                self._call(self._handle.register_writer.remote(lg, self.job_id,
                                                              self._caller))
            handle = self._handle
        self._refresh_lane(handle)
        return handle

    def register(self, log_id: str) -> None:
        for attempt in (1, 2):
            try:  # a new writer: it made no handle yet (named -1)
                merged = self._call(self._ensure().register_writer.remote(
                    log_id, self.job_id, self._caller, -1))
                if merged:  # the tree merges changelog files: the node keeps our records
                    self.acked_marks = True
                break
            except (NamespaceError, FencedError):
                raise  # the node refuses this job from us: no retry helps
            except Exception as e:  # noqa: BLE001 - the node died: find it (or another) again
                with self._lock:
                    self._stale = True
                if attempt == 2:
                    raise NodeUnavailableError(
                        f"cannot register writer {log_id} with node actor {self.node_name}: "
                        f"{type(e).__name__}: {e}") from e
        with self._lock:
            self._logs.add(log_id)

    def unregister(self, log_id: str) -> None:
        with self._lock:
            self._logs.discard(log_id)
        try:
            self._ensure().unregister_writer.remote(log_id, self._caller)
        except Exception as e:  # noqa: BLE001 - best effort on close
            log.debug("unregister of %s failed: %s", log_id, e)

    def send(self, request: PersistRequest) -> concurrent.futures.Future[Segment]:
        """Queue ``request``; a sender thread ships everything queued as ONE actor call
        (FLIP-158 batching levels 2-3: all backends of this process), so many writers that
        persist at once cost a few actor calls, not one each."""
        fut: concurrent.futures.Future[Segment] = concurrent.futures.Future()
        request = dataclasses.replace(request, caller=self._caller, process=self._process)
        with self._cond:
            self._queue.append((request, fut))
            self._start_sender()
            self._cond.notify()
        return fut

    def _start_sender(self) -> None:
        """(caller holds ``_cond``)"""
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                            name="dstl-sender")
            self._sender.start()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    expired = self._take_expired(time.monotonic())
                    marks = self._take_expired_marks(time.monotonic())
                    if self._queue or expired or marks:
                        break
                    nearest = min([d for d, _ in self._inflight.values()]
                                  + [d for d, _, _ in self._marks.values()], default=None)
                    self._cond.wait(None if nearest is None
                                    else max(0.0, nearest - time.monotonic()))
                batch, self._queue = self._queue, []
                if batch:
                    self._calls += 1
                    call = self._calls
                    deadline = time.monotonic() + self.config.effective_persist_timeout_s
                    self._inflight[call] = (deadline, batch)
            for fut, what in marks:
                self._deliveries.submit(_fail_future, fut, PersistError(
                    f"node actor {self.node_name} did not take {what} within "
                    f"persist_timeout_s={self.config.effective_persist_timeout_s:g}s"))
            for b in expired:  # off this thread: failing a future runs writers' callbacks
                self._deliveries.submit(self._fail, b, PersistError(
                    f"node actor {self.node_name} did not answer {len(b)} persist "
                    f"request(s) within persist_timeout_s="
                    f"{self.config.effective_persist_timeout_s:g}s; the changes are "
                    f"kept and go again with the next request"))
            if not batch:
                continue
            try:
                answer = self._node_call("persist_many", [r for r, _ in batch], deadline=deadline)
                # Ray (or the lane's reader) runs this callback on its own thread: hand the
                # results to ours, since what they trigger (writers, backends, users'
                # callbacks, releases) may call Ray, and a Ray call from Ray's event thread
                # never returns
                answer.add_done_callback(lambda f, c=call, b=batch: self._answered(c, b, f))
            except Exception as e:  # noqa: BLE001 - every request of the batch learns it
                with self._cond:
                    self._inflight.pop(call, None)
                self._fail(batch, e)

    def _take_expired(self, now: float) -> list[_Batch]:
        """Calls past their deadline, no longer in flight (caller holds ``_cond``)."""
        gone = [c for c, (d, _) in self._inflight.items() if d <= now]
        self.timeouts += len(gone)
        return [self._inflight.pop(c)[1] for c in gone]

    def _take_expired_marks(self, now: float) -> list[tuple[concurrent.futures.Future, str]]:
        """Awaited marks past their deadline, no longer waited for (caller holds ``_cond``)."""
        gone = [m for m, (d, _, _) in self._marks.items() if d <= now]
        self.timeouts += len(gone)
        return [self._marks.pop(m)[1:] for m in gone]

    def _answered(self, call: int, batch: _Batch, f: concurrent.futures.Future) -> None:
        """On Ray's event thread: the answer is in time if its call is still in flight now
        (not when our delivery thread gets to it)."""
        with self._cond:
            late = self._inflight.pop(call, None) is None
        self._deliveries.submit(self._deliver, batch, f, late)

    def _deliver(self, batch: _Batch, f: concurrent.futures.Future, late: bool) -> None:
        if late:
            if not f.cancelled() and f.exception() is None:
                self._release_late([r.log_id for r, _ in batch], f.result())
            return
        try:
            e = f.exception()
            if e is not None:
                self._fail(batch, e)
                return
            results = f.result()
            if len(results) != len(batch):
                raise DstlError(f"node actor {self.node_name} answered {len(results)} of "
                                f"{len(batch)} persist requests")
            for (_, fut), result in zip(batch, results, strict=True):
                if isinstance(result, BaseException):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)
        except BaseException as e:  # noqa: BLE001 - never leave a writer's future pending
            self._fail(batch, e)

    def _release_late(self, log_ids: list[str], results: Any) -> None:
        """A call answered after its deadline (or the lane's ``late`` hook: after its future
        failed) failed its requests: the writers re-sent (or will re-send) those changes, so
        the segments it reports are nobody's; release them unused and their node deletes the
        files once nothing else is in them."""
        if not isinstance(results, list) or len(results) != len(log_ids):
            return
        for log_id, result in zip(log_ids, results, strict=True):
            if isinstance(result, Segment):
                self.late_released += 1
                log.info("late answer from %s: releasing %s of log %s unused",
                         self.node_name, result.path, log_id)
                self.release(result, log_id, False)

    def _note_unavailable(self, e: BaseException) -> None:
        """A call failed because the node actor is gone: find it (restarted) again next time."""
        import ray

        if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                          NodeUnavailableError)):
            with self._lock:
                self._stale = True

    def _fail(self, batch: _Batch, e: BaseException) -> None:
        self._note_unavailable(e)
        e = _explained(e, self.node_name)
        for _, fut in batch:
            if not fut.done():
                fut.set_exception(e)

    def mark(self, log_id: str, checkpoint_id: int, named: int | None = None
             ) -> concurrent.futures.Future[None]:
        """This writer has nothing to send for ``checkpoint_id``. The future resolves when
        the node took it: writers wait for that when the node must know ``named`` (the
        newest checkpoint a handle of theirs is for) before they give a handle out
        (dstl_ray.node.dead_writers); for batching alone a lost mark costs only a delay."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        try:
            # the same channel and deadline as the writer's persist calls: behind a stopped
            # node, dropped unsent once a persist call would have failed
            answer = self._node_call(
                "mark", self.job_id, log_id, checkpoint_id, self._caller, named,
                deadline=time.monotonic() + self.config.effective_persist_timeout_s)
        except Exception as e:  # noqa: BLE001 - the node is gone
            log.debug("mark of %s failed: %s", log_id, e)
            done.set_exception(PersistError(f"mark of log {log_id} for checkpoint "
                                            f"{checkpoint_id} not sent: {e}"))
            return done

        number = -1
        if named is not None:  # awaited by a handle: it has the persist deadline too
            with self._cond:
                self._calls += 1
                number = self._calls
                self._marks[number] = (
                    time.monotonic() + self.config.effective_persist_timeout_s, done,
                    f"the mark of log {log_id} for checkpoint {checkpoint_id}")
                self._start_sender()
                self._cond.notify()

        def taken(f: concurrent.futures.Future) -> None:
            if number >= 0:
                with self._cond:
                    if self._marks.pop(number, None) is None:
                        return  # failed by its deadline already
            e = f.exception()
            if e is None:
                done.set_result(None)
            else:
                self._note_unavailable(e)
                done.set_exception(PersistError(
                    f"node actor {self.node_name} did not take the mark of log {log_id} for "
                    f"checkpoint {checkpoint_id}: {type(e).__name__}: {e}"))

        # off Ray's event thread: what the future triggers may call Ray
        answer.add_done_callback(lambda f: self._deliveries.submit(taken, f))
        return done

    def retain(self, segment: Segment, log_id: str, incarnation: str = "") -> None:
        """``log_id`` names ``segment`` (restored) too; synchronous, before any request of
        this process can carry a watermark that would free it."""
        retain_at_node(self.namespace, self.job_id, self._caller, segment, log_id,
                       incarnation)

    def release(self, segment: Segment, log_id: str, used: bool,
                last_checkpoint: int = -1) -> None:
        """Tell the node that wrote ``segment`` that ``log_id`` is done with it. In the
        background: callers hold a backend's lock or are the delivery thread, and finding
        the actor is a call to Ray's GCS."""
        self._deleter.submit(lambda: self._release_now(segment, log_id, used,
                                                       last_checkpoint),
                             f"{segment.path} (release by log {log_id})")

    def flush_releases(self, timeout: float | None = 60.0) -> bool:
        """Wait until the releases handed over so far reached their nodes' actor queues."""
        return self._deleter.flush(timeout)

    def _release_now(self, segment: Segment, log_id: str, used: bool,
                     last_checkpoint: int) -> None:
        release_at_node(self.namespace, self.job_id, self._caller, segment, log_id, used,
                        last_checkpoint)


def _process_id() -> str:
    """This process, as its node actor tells its writers' processes apart: Ray's worker id
    (a driver's, a Spark Python worker's, an actor's or a task's process)."""
    import ray

    try:
        return ray.get_runtime_context().get_worker_id() or ""
    except Exception as e:  # noqa: BLE001 - unknown: its writers are waited for as before
        log.debug("no worker id: %s", e)
        return ""


def _explained(e: BaseException, node: str) -> BaseException:
    """``e``, or what it means when Ray says this (alive) process died."""
    import ray

    if isinstance(e, ray.exceptions.OwnerDiedError):
        # the owner of the request is this very process, alive: the node's Ray node could
        # not call it back to fetch the request (dstl_ray.transport.auth)
        return PersistError(
            f"node actor {node} could not fetch this process's persist request: Ray took "
            f"this process for dead because the cluster cannot call it back (is "
            f"{AUTH_MODE_ENV}={os.environ.get(AUTH_MODE_ENV, '<unset>')!r} the cluster's "
            f"authentication mode?): {type(e).__name__}: {e}")
    return e


def retain_at_node(namespace: str, job_id: str, caller: Any, segment: Segment, log_id: str,
                   incarnation: str) -> None:
    """Tell the node actor that wrote ``segment`` that ``log_id`` names it too."""
    import ray

    try:
        node = ray.get_actor(segment.flushed_by, namespace=namespace)
        ray.get(node.retain.remote(job_id, segment.path, segment.offset, log_id, caller,
                                   incarnation), timeout=30)
    except ray.exceptions.ActorUnavailableError as e:  # (a RayActorError too)
        # alive but not reachable now: it still tracks the file and would free it
        raise NodeUnavailableError(f"cannot tell node {segment.flushed_by} that log "
                                   f"{log_id} names {segment.path}: {e}") from e
    except (ValueError, ray.exceptions.RayActorError):
        pass  # that node actor is gone or restarted: it forgot its files, never deletes
    except NamespaceError:
        raise
    except Exception as e:  # noqa: BLE001 - unsure whether it holds the file for us
        raise NodeUnavailableError(f"cannot tell node {segment.flushed_by} that log "
                                   f"{log_id} names {segment.path}: {e}") from e


def release_at_node(namespace: str, job_id: str, caller: Any, segment: Segment, log_id: str,
                    used: bool, last_checkpoint: int) -> None:
    """Tell the node actor that wrote ``segment`` that ``log_id`` is done with it (best
    effort: the orphan cleanup after recovery covers a lost one)."""
    import ray

    try:
        node = ray.get_actor(segment.flushed_by, namespace=namespace)
        node.release.remote(job_id, segment.path, log_id, used, caller, segment.offset,
                            last_checkpoint)
    except Exception as e:  # noqa: BLE001 - orphan cleanup after recovery covers it
        log.debug("release of %s failed: %s", segment.path, e)
