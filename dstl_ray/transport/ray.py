"""The Ray transport: a writer process's persist calls, marks, retains and releases go to
its nearest node actor (FLIP-158 "Future directions"; docs/architecture.md "Write path").

:class:`RayNodeTransport` is the :class:`~.base.Transport` writers use; it composes one
object per concern and keeps only what is its own, the client-side batching (everything a
process queued goes as ONE ``persist_many`` call, FLIP-158 batching levels 2-3) and the
delivery of answers off Ray's event thread:

* :mod:`.node_lookup`: which node actor, found again by name after it died or restarted,
  with this process's writers registered again;
* :mod:`.node_channel`: persist calls and marks over the node's local lane, else by Ray;
* :mod:`.retention`: retains and releases of uploaded segments at the nodes that wrote them;
* :mod:`.ray_errors`: what a Ray error means (the node is gone; Ray's owner-died error on a
  live process);
* :mod:`.deadlines`: the persist deadline of each call and awaited mark.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..config import ChangelogConfig
from ..errors import DstlError, PersistError
from ..format.segment import Segment
from ..observability import tracing
from ..storage.base import join
from .auth import use_cluster_auth_mode
from .base import PersistRequest
from .deadlines import Deadlines
from .lane import Lane
from .node_channel import NodeChannel
from .node_lookup import NodeLookup, get_while_restarting, ray_resolver
from .ray_errors import explained, node_gone
from .retention import Retention
from .sender import current_caller

log = logging.getLogger(__name__)

__all__ = ["RayNodeTransport", "ensure_ray", "get_while_restarting"]

_Batch = list[tuple[PersistRequest, concurrent.futures.Future]]
_Mark = tuple[concurrent.futures.Future, str]  # an awaited mark's future, and what it was


@dataclasses.dataclass(frozen=True)
class _QueuedMark:
    """A mark waiting for the sender thread (:meth:`RayNodeTransport.mark`); ``number`` is
    its entry in the awaited marks' deadlines (-1: not awaited)."""

    log_id: str
    checkpoint_id: int
    named: int | None
    deadline: float
    done: concurrent.futures.Future
    what: str
    number: int


CLOSE_JOIN_S = 5.0  # how long close waits for the sender thread to end


def _fail_future(fut: concurrent.futures.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)


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


def _process_id() -> str:
    """This process, as its node actor tells its writers' processes apart: Ray's worker id
    (a driver's, a Spark Python worker's, an actor's or a task's process)."""
    import ray

    if not ray.is_initialized():  # (the runtime context would start a local Ray)
        return ""
    try:
        return ray.get_runtime_context().get_worker_id() or ""
    except Exception as e:  # noqa: BLE001 - unknown: its writers are waited for as before
        log.debug("no worker id: %s", e)
        return ""


class RayNodeTransport:
    """Writers of one client talk to the nearest ``ChangelogNode`` actor. If that actor dies
    (Ray restarts it), the transport finds it again and re-registers its writers.

    Every persist call has a deadline (``persist_timeout_s``): a node actor that does not
    answer in time (hung, overloaded, its upstream stuck) fails the call's requests with
    :class:`PersistError`, so the writers send their changes again with their next request
    instead of waiting forever. When such a call answers after all, the segments it reports
    are released unused, so the node deletes files nobody will name.

    :meth:`close` stops what the transport started: its sender and delivery threads, its
    lane and the lane's watch thread.
    """

    def __init__(self, job_id: str, namespace: str, node_name: str | None = None,
                 caller_namespace: str | None = None) -> None:
        self.job_id = job_id
        self.namespace = namespace
        # node actors admit a job only from its own namespace (dstl_ray.node.namespaces)
        self._caller = current_caller(caller_namespace)
        self._process = _process_id()  # stamped on requests (PersistRequest.process)
        self._cond = threading.Condition()  # the queue, the deadlines, closing
        self._queue: _Batch = []
        self._inflight: Deadlines[_Batch] = Deadlines()  # persist calls sent, not answered
        self._marks: Deadlines[_Mark] = Deadlines()  # awaited marks not taken yet
        self._queued_marks: list[_QueuedMark] = []  # marks for the sender to send
        self._closed = False
        self.timeouts = 0  # persist calls (and awaited marks) failed by the deadline
        self._sender: threading.Thread | None = None
        self._delivery_thread: int | None = None
        self._deliveries = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="dstl-deliver", initializer=self._note_delivery_thread)
        self._retention = Retention(namespace, job_id, self._caller)
        self._lookup = NodeLookup(job_id, self._caller, ray_resolver(namespace, node_name),
                                  found=lambda handle: self._channel.refresh(handle))
        # a lane's answer whose call failed already: its segments are released unused
        self._channel = NodeChannel(self._lookup, lambda method, sent, results: self._submit(
            self._release_late, [s.log_id for s in sent], results))
        handle = self._lookup.connect()
        info = get_while_restarting(handle.info.remote)  # first: it waits for a restart
        self._channel.refresh(handle)
        self.base_path: str = info["base_path"]
        self.config = ChangelogConfig.from_dict(info["config"])
        self.job_path = join(self.base_path, job_id)
        tracing.configure(self.config.tracing)

    @property
    def node_name(self) -> str:
        """The node actor this transport talks to (found again after a restart)."""
        return self._lookup.node_name

    @property
    def chosen_by(self) -> str:
        """How that node actor was chosen (``dstl_ray.transport.discovery``; "pinned")."""
        return self._lookup.chosen_by

    @property
    def stale(self) -> bool:
        """Whether the node actor is to be found again before the next call."""
        return self._lookup.stale

    @property
    def acked_marks(self) -> bool:
        """Whether the tree merges changelog files: marks are awaited."""
        return self._lookup.merges

    @property
    def late_released(self) -> int:
        """Segments of late answers released unused."""
        return self._retention.released_unused

    @property
    def lane(self) -> Lane | None:
        """The open local lane to the node actor (None: Ray calls)."""
        return self._channel.lane

    def register(self, log_id: str) -> None:
        self._lookup.register(log_id)

    def unregister(self, log_id: str) -> None:
        """The node forgets ``log_id``; its marks not sent yet never go (one arriving after
        would make the node hold a record of a writer that is gone: :meth:`_send_mark`
        fails them), so a snapshot whose writer closes before its mark went out fails too."""
        self._lookup.unregister(log_id)

    def close(self) -> None:
        """Close the lane and stop this transport's threads (its writers are closed already).
        What is still queued or waited for fails as its deadline would: an answer that comes
        later is late, its segments released unused."""
        with self._cond:
            self._closed = True
            queued, self._queue = self._queue, []
            expired = self._inflight.take_all() + ([queued] if queued else [])
            marks = self._marks.take_all()
            unsent, self._queued_marks = self._queued_marks, []
            sender, self._sender = self._sender, None
            self._cond.notify_all()
        why = PersistError(f"the transport to node actor {self.node_name} is closed")
        for b in expired:
            self._submit(self._fail, b, why)
        # (an awaited mark is in ``marks`` too: each future once)
        for fut in [fut for fut, _ in marks] + [m.done for m in unsent if m.number < 0]:
            self._submit(_fail_future, fut, why)
        self._channel.close()
        if sender is not None and sender is not threading.current_thread():
            sender.join(CLOSE_JOIN_S)
        # (a delivery closing its own transport cannot wait for itself)
        self._deliveries.shutdown(wait=threading.get_ident() != self._delivery_thread)

    def _note_delivery_thread(self) -> None:
        self._delivery_thread = threading.get_ident()

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the delivery thread (off Ray's event thread and off the
        sender); after :meth:`close`, on a thread of its own (an answer arriving late)."""
        try:
            self._deliveries.submit(fn, *args)
        except RuntimeError:  # shut down: the transport is closed
            threading.Thread(target=fn, args=args, daemon=True,
                             name="dstl-deliver-after-close").start()

    def send(self, request: PersistRequest) -> concurrent.futures.Future[Segment]:
        """Queue ``request``; a sender thread ships everything queued as ONE actor call
        (FLIP-158 batching levels 2-3: all backends of this process), so many writers that
        persist at once cost a few actor calls, not one each."""
        fut: concurrent.futures.Future[Segment] = concurrent.futures.Future()
        request = dataclasses.replace(request, caller=self._caller, process=self._process)
        with self._cond:
            if self._closed:
                fut.set_exception(PersistError(
                    f"the transport to node actor {self.node_name} is closed"))
                return fut
            self._queue.append((request, fut))
            self._start_sender()
            self._cond.notify()
        return fut

    def _start_sender(self) -> None:
        """(caller holds ``_cond``)"""
        if self._sender is None and not self._closed:
            self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                            name="dstl-sender")
            self._sender.start()

    def _next_batch(self) -> tuple[_Batch, int, float, list[_Batch], list[_Mark],
                                   list[_QueuedMark]] | None:
        """(on the sender) Wait for requests or marks to send or deadlines to pass: (the
        batch, its call number, its deadline, calls expired, marks expired, marks to send);
        None once closed."""
        timeout_s = self.config.effective_persist_timeout_s
        with self._cond:
            while True:
                if self._closed:
                    return None
                now = time.monotonic()
                expired = self._inflight.take_expired(now)
                marks = self._marks.take_expired(now)
                self.timeouts += len(expired) + len(marks)
                if self._queue or expired or marks or self._queued_marks:
                    break
                nearest = min((d for d in (self._inflight.nearest(), self._marks.nearest())
                               if d is not None), default=None)
                self._cond.wait(None if nearest is None else max(0.0, nearest - now))
            batch, self._queue = self._queue, []
            to_mark, self._queued_marks = self._queued_marks, []
            deadline = time.monotonic() + timeout_s
            call = self._inflight.add(deadline, batch) if batch else 0
        return batch, call, deadline, expired, marks, to_mark

    def _send_loop(self) -> None:
        timeout_s = self.config.effective_persist_timeout_s
        while (got := self._next_batch()) is not None:
            batch, call, deadline, expired, marks, to_mark = got
            for fut, what in marks:
                self._submit(_fail_future, fut, PersistError(
                    f"node actor {self.node_name} did not take {what} within "
                    f"persist_timeout_s={timeout_s:g}s"))
            for b in expired:  # off this thread: failing a future runs writers' callbacks
                self._submit(self._fail, b, PersistError(
                    f"node actor {self.node_name} did not answer {len(b)} persist "
                    f"request(s) within persist_timeout_s={timeout_s:g}s; the changes are "
                    f"kept and go again with the next request"))
            if batch:  # the changes first: a node's batch waits for them; then the marks
                self._send_batch(batch, call, deadline)
            for m in to_mark:
                self._send_mark(m)

    def _send_batch(self, batch: _Batch, call: int, deadline: float) -> None:
        """(on the sender) Everything queued as ONE ``persist_many`` call."""
        try:
            answer = self._channel.call("persist_many", [r for r, _ in batch],
                                        deadline=deadline)
            # Ray (or the lane's reader) runs this callback on its own thread: hand the
            # results to ours, since what they trigger (writers, backends, users'
            # callbacks, releases) may call Ray, and a Ray call from Ray's event thread
            # never returns
            answer.add_done_callback(lambda f, c=call, b=batch: self._answered(c, b, f))
        except Exception as e:  # noqa: BLE001 - every request of the batch learns it
            with self._cond:
                self._inflight.pop(call)
            self._submit(self._fail, batch, e)  # (writers' callbacks: not on the sender)

    def _answered(self, call: int, batch: _Batch, f: concurrent.futures.Future) -> None:
        """On Ray's event thread: the answer is in time if its call is still in flight now
        (not when our delivery thread gets to it)."""
        with self._cond:
            late = self._inflight.pop(call) is None
        self._submit(self._deliver, batch, f, late)

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
        failed) failed its requests: the segments it reports are nobody's."""
        if isinstance(results, list) and len(results) == len(log_ids):
            self._retention.release_unused(self.node_name, [
                (lg, r) for lg, r in zip(log_ids, results, strict=True)
                if isinstance(r, Segment)])

    def _fail(self, batch: _Batch, e: BaseException) -> None:
        if node_gone(e):
            self._lookup.mark_stale()
        e = explained(e, self.node_name)
        for _, fut in batch:
            _fail_future(fut, e)

    def mark(self, log_id: str, checkpoint_id: int, named: int | None = None
             ) -> concurrent.futures.Future[None]:
        """This writer has nothing to send for ``checkpoint_id``. The future resolves when
        the node took it: writers wait for that when the node must know ``named`` (the
        newest checkpoint a handle of theirs is for) before they give a handle out
        (dstl_ray.node.dead_writers); for batching alone a lost mark costs only a delay.

        Queued for the sender thread, as persist requests are: a checkpoint barrier with
        nothing to send (most barriers, between bursts) returns without writing to the
        node's socket (0.35 ms a mark, quiet), so it answers its checkpoint sooner. The
        sender sends what it took in one round: the persist requests first, then the
        marks."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        what = f"the mark of log {log_id} for checkpoint {checkpoint_id}"
        deadline = time.monotonic() + self.config.effective_persist_timeout_s
        with self._cond:
            if self._closed:
                done.set_exception(PersistError(f"{what} not sent: the transport to node "
                                                f"actor {self.node_name} is closed"))
                return done
            # awaited by a handle: it has the persist deadline too, from now (queued or sent)
            number = self._marks.add(deadline, (done, what)) if named is not None else -1
            self._queued_marks.append(_QueuedMark(log_id, checkpoint_id, named, deadline,
                                                  done, what, number))
            self._start_sender()
            self._cond.notify()
        return done

    def _send_mark(self, m: _QueuedMark) -> None:
        """(on the sender) One queued mark to the node, by the same channel as the writer's
        persist calls (over the lane, with their deadline: behind a stopped node it is
        dropped unsent once a persist call would have failed). Its outcome is handed to the
        delivery thread: failing its future runs writers' callbacks."""
        try:
            if self._closed:  # (taken by this thread just before close)
                raise PersistError(f"the transport to node actor {self.node_name} is closed")
            if not self._lookup.registered(m.log_id):  # its writer closed since it queued
                raise PersistError(f"log {m.log_id} was closed")
            answer = self._channel.call("mark", self.job_id, m.log_id, m.checkpoint_id,
                                        self._caller, m.named, deadline=m.deadline)
        except Exception as e:  # noqa: BLE001 - the node is gone
            log.debug("mark of %s failed: %s", m.log_id, e)
            self._submit(self._mark_taken, m, e, False)
            return
        # off Ray's event thread: what the future triggers may call Ray
        answer.add_done_callback(lambda f: self._submit(self._mark_taken, m, f.exception()))

    def _mark_taken(self, m: _QueuedMark, e: BaseException | None, sent: bool = True) -> None:
        """(on the delivery thread) ``m``'s outcome; ``sent``: whether it went out."""
        if m.number >= 0:
            with self._cond:
                if self._marks.pop(m.number) is None:
                    return  # failed by its deadline already
        if e is None:
            _set_result(m.done)
            return
        if not sent:
            _fail_future(m.done, PersistError(f"{m.what} not sent: {e}"))
            return
        if node_gone(e):
            self._lookup.mark_stale()
        _fail_future(m.done, PersistError(f"node actor {self.node_name} did not take "
                                          f"{m.what}: {type(e).__name__}: {e}"))

    def retain(self, segment: Segment, log_id: str, incarnation: str = "") -> None:
        """``log_id`` names ``segment`` (restored) too; synchronous, before any request of
        this process can carry a watermark that would free it."""
        self._retention.retain(segment, log_id, incarnation)

    def release(self, segment: Segment, log_id: str, used: bool,
                last_checkpoint: int = -1) -> None:
        """Tell the node that wrote ``segment`` that ``log_id`` is done with it. In the
        background: callers hold a backend's lock or are the delivery thread, and finding
        the actor is a call to Ray's GCS."""
        self._retention.release(segment, log_id, used, last_checkpoint)

    def flush_releases(self, timeout: float | None = 60.0) -> bool:
        """Wait until the releases handed over so far reached their nodes' actor queues."""
        return self._retention.flush(timeout)


def _set_result(fut: concurrent.futures.Future) -> None:
    if not fut.done():
        fut.set_result(None)
