"""The local lane: a writer's persist and mark calls to a node actor on the SAME machine over
a Unix socket, not through Ray (docs/architecture.md "Write path" 2); node actors use it the
same way for a child's batches and marks to a parent on their machine ("Write path" 4,
:meth:`Lane.submit`), and, as the host lane, to a parent on another host over TCP (the same
frames on a TCP connection to the node's Ray IP: a Ray call between two hosts cost 1.1 ms at
the median and 4.8 ms for a 256 KiB batch, the host lane 0.13 and 0.35 ms;
``experiments.host_hops``).

A Ray actor call from a writer to its node actor cost 3.3 ms to arrive and 2.2 ms to answer
at the median while a checkpoint's processes all woke at once (Ray's per-call work is what the
burst queues behind). The lane carries the same calls as length-prefixed frames (JSON and raw
bytes, :mod:`.lane_codec`, never pickle) straight into the same coroutines, so a request's
semantics (vetting, admission, batching, deadlines) are those of the Ray call; only the
carrier changes. Everything else (registration, releases, retains, status) stays on Ray.

Trust: the socket lives in a directory only the node actor's user can enter, and a
connection must first present the node's token as raw bytes (compared in constant time),
which writers get from the node's ``lane()`` method over Ray. Frames are never unpickled:
each field of a call is decoded and type-checked into its dataclass.

Failure: a lane that breaks (the node actor died, or the socket did) fails every call in
flight on it with :class:`~dstl_ray.errors.NodeUnavailableError`, as a dead actor fails its
Ray calls; the transport then finds its node again (over Ray) and opens a new lane.

A stalled receiver (a GC pause, SIGSTOP, a blocking call) is not a broken lane: there is no
send timeout. Frames go out without blocking the caller (the rest of a frame the socket did
not take goes from the lane's sender thread), a call fails when ITS deadline passes, and a
frame not begun by then is dropped unsent (:class:`~dstl_ray.errors.DeadlineError`).

Closing never drops an answer: the writer side shuts its write direction and reads on until
the node, having answered every call it read, closes its own; the read direction is shut
last, and only then are the calls left failed. An answer written before that line is read,
one after it fails at the node, which releases it (:mod:`dstl_ray.node.lane_server`); one
whose caller stopped waiting goes to the lane's ``late`` hook. Each answer's segments are
released exactly once. A host lane (TCP) never shuts its read side (the node would not
learn of it): it fails its calls and reads on, every later answer going to ``late``; its
token crosses the network in clear, as Ray's traffic does. docs/architecture.md "Write
path" 2 and 4.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import DeadlineError, DstlError, NodeUnavailableError
from .lane_codec import (  # noqa: F401 - the protocol's names, used here and by lane users
    _LEN,
    Sent,
    decode_answer,
    encode_call,
    frame,
    frame_length,
    hello_bytes,
    machine_id,
    sent_of,
)

log = logging.getLogger(__name__)

POLL_S = 1.0  # a sender waiting for a stalled node looks at the queued deadlines this often


class LaneClosedError(NodeUnavailableError):
    """The lane to a node actor broke: the calls in flight on it failed; the node may be
    alive (find it again over Ray) or dead (as with a Ray call to a dead actor)."""


# an answer whose caller stopped waiting (its future failed or was cancelled): (method, the
# call's requests, its results); runs on the lane's reader thread, so keep it short
LateHook = Callable[[str, tuple[Sent, ...], list[Any]], None]


@dataclass(eq=False)
class _Out:
    """A frame not yet wholly sent (mutable: ``sent`` grows as the socket takes it)."""

    call_id: int
    data: memoryview
    deadline: float | None  # time.monotonic(): not begun by then, it is never sent
    sent: int = 0


@dataclass(frozen=True)
class _Call:
    """A call sent (or queued) and not answered yet."""

    future: concurrent.futures.Future[Any]
    method: str
    sent: tuple[Sent, ...]  # its requests, for releasing a late answer
    deadline: float | None


class Lane:
    """The writer side of one lane: calls return concurrent futures, answered by a reader
    thread (their callbacks run there: keep them short, as the transport does by handing
    results to its delivery thread). ``peer_pid``: the node actor's process (the lane is
    tied to it: :mod:`.lane_watch` cuts a lane whose actor Ray has restarted or declared
    dead). ``late``: where an answer goes whose caller stopped waiting (its future failed or
    was cancelled), so the segments it names are released exactly once."""

    def __init__(self, path: str, token: str, node: str, timeout_s: float = 10.0,
                 peer_pid: int | None = None, late: LateHook | None = None,
                 peer_node: str | None = None) -> None:
        self.node = node
        self.path = path
        self.tcp = path.startswith(TCP)  # a host lane (another host), else a Unix lane
        self.token = token
        self.peer_pid = peer_pid
        self.peer_node = peer_node  # the Ray node the peer ran on when it answered lane()
        self.late = late
        self.calls = 0
        self._sock = _connect(path, timeout_s)
        try:
            self._sock.sendall(hello_bytes(token))
            answer = self._recv_exact(2)
            if answer != b"OK":
                raise DstlError(f"node {node} refused the lane: {answer!r}")
            # blocking reads (the reader thread); sends never block (MSG_DONTWAIT + poll)
            self._sock.settimeout(None)
        except BaseException:
            self._sock.close()
            raise
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)  # the sender's and closer's waits
        self._queue: collections.deque[_Out] = collections.deque()  # in sending order
        self._writing = False  # a thread is sending from the queue (one at a time)
        self._sender: threading.Thread | None = None
        self._pending: dict[int, _Call] = {}
        self._ids = itertools.count()
        # no new calls once set (closing, or broken); the reason
        self.closed: BaseException | None = None
        self._aborted = False  # both directions shut: nothing more is sent or can arrive
        self._done = threading.Event()  # every call resolved and the socket closed
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"dstl-lane-{node}")
        self._reader.start()

    @property
    def done(self) -> bool:
        """Whether the lane has ended: every call resolved, the socket closed."""
        return self._done.is_set()

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self._sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionError("the node closed the lane")
            got += k
        return bytes(buf)

    def _recv(self) -> bytes:
        return self._recv_exact(frame_length(self._recv_exact(_LEN.size)))

    def _register(self, method: str, args: tuple[Any, ...], deadline: float | None,
                  inline: bool) -> tuple[_Out, concurrent.futures.Future[Any], bool]:
        """Encode a call (an error raises before anything is registered), register its
        future and queue its frame. Returns whether the caller is to send it (``inline``
        and no other thread is sending); otherwise the sender thread will. Raises
        :class:`LaneClosedError` if the lane is closed or broken."""
        call_id = next(self._ids)
        out = _Out(call_id, memoryview(frame(encode_call(call_id, method, args))), deadline)
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call = _Call(fut, method, sent_of(method, args), deadline)
        with self._lock:
            if self.closed is not None:
                raise LaneClosedError(f"lane to node {self.node} is closed: {self.closed}")
            self._pending[call_id] = call
            self._queue.append(out)
            mine = inline and not self._writing
            if mine:
                self._writing = True
            else:
                self._wake_sender()
        return out, fut, mine

    def _wake_sender(self) -> None:
        """(caller holds ``_lock``) The sender thread (started on first use) takes over."""
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                            name=f"dstl-lane-send-{self.node}")
            self._sender.start()
        self._queued.notify_all()

    def call(self, method: str, *args: Any, deadline: float | None = None
             ) -> concurrent.futures.Future[Any]:
        """Send one call; raises :class:`LaneClosedError` (nothing sent) if the lane is
        closed or broken, so the caller can go by Ray instead. A call that does not encode
        (an unknown method, a bad argument) raises and leaves the lane as it was. The frame
        goes out from this thread as far as the socket takes it without waiting, the rest
        from the sender thread: a stalled node never blocks the caller. ``deadline``
        (``time.monotonic()``): a frame not begun by then is dropped and its call fails with
        :class:`~dstl_ray.errors.DeadlineError`; the lane itself never times out."""
        out, fut, mine = self._register(method, args, deadline, inline=True)
        if mine:
            try:
                self._send_queued(block=False)
            except BaseException as e:  # noqa: BLE001 - the stream is unusable: end it
                self._stop_writing()
                self._abort(e)
                if not isinstance(e, OSError):
                    raise
                if out.sent == 0:  # nothing of it went out: the caller goes by Ray
                    with self._lock:
                        self._pending.pop(out.call_id, None)
                    raise LaneClosedError(f"lane to node {self.node} broke while sending: "
                                          f"{e}") from e
            else:
                self._stop_writing()
        return fut

    def _stop_writing(self) -> None:
        """An inline sender is done: the sender thread takes what is left (and, on a closed
        lane, shuts the write side once everything went out)."""
        with self._lock:
            self._writing = False
            if (self._queue or self.closed is not None) and not self._aborted:
                self._wake_sender()
            self._queued.notify_all()

    def submit(self, method: str, *args: Any, deadline: float | None = None
               ) -> concurrent.futures.Future[Any]:
        """As :meth:`call`, but the frame goes out from this lane's sender thread, in
        submission order, so the caller never touches the socket (a node actor's event loop
        calls this). Raises :class:`LaneClosedError` if the lane is closed or broken, or the
        encoding error, before anything is queued; a lane that breaks later fails the queued
        calls with the ones in flight."""
        return self._register(method, args, deadline, inline=False)[1]

    def _drop_expired(self) -> None:
        """Fail and forget the queued frames not begun whose deadline passed: nothing of
        them reached the node, so nothing is done there for a call nobody waits for."""
        now = time.monotonic()
        gone: list[tuple[int, _Call | None]] = []
        with self._lock:
            if any(o.sent == 0 and o.deadline is not None and o.deadline <= now
                   for o in self._queue):
                keep: collections.deque[_Out] = collections.deque()
                for o in self._queue:
                    if o.sent == 0 and o.deadline is not None and o.deadline <= now:
                        gone.append((o.call_id, self._pending.pop(o.call_id, None)))
                    else:
                        keep.append(o)
                self._queue = keep
        for call_id, call in gone:
            if call is not None and not call.future.done():
                call.future.set_exception(DeadlineError(
                    f"call {call_id} to node {self.node} passed its deadline before the "
                    f"node took it (not sent)"))

    def _send_queued(self, block: bool) -> None:
        """(holds the writer role) Send the queued frames in order: until the queue is empty
        (``block``, waiting for a stalled node as long as it takes), or as far as the socket
        takes them now. Raises the socket's error."""
        poller: select.poll | None = None
        while True:
            self._drop_expired()
            with self._lock:
                if self._aborted or not self._queue:
                    return
                head = self._queue[0]
            try:
                n = self._sock.send(head.data[head.sent:], socket.MSG_DONTWAIT)
            except BlockingIOError:
                if not block:
                    return
                if poller is None:
                    poller = select.poll()
                    poller.register(self._sock.fileno(), select.POLLOUT)
                poller.poll(int(self._poll_s() * 1000))
                continue
            head.sent += n
            if head.sent == len(head.data):
                with self._lock:
                    if self._queue and self._queue[0] is head:
                        self._queue.popleft()
                self.calls += 1

    def _poll_s(self) -> float:
        """How long a sender waits for the socket: until the nearest deadline of a queued
        frame not begun (to drop it then), at most POLL_S."""
        now = time.monotonic()
        with self._lock:
            nearest = min((o.deadline for o in self._queue
                           if o.sent == 0 and o.deadline is not None), default=None)
        return POLL_S if nearest is None else max(0.001, min(POLL_S, nearest - now))

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                while not (self._aborted or (not self._writing and (
                        self._queue or self.closed is not None))):
                    self._queued.wait()
                if self._aborted:
                    return
                if not self._queue:
                    # closed, and every frame went out: the node reads to the end of the
                    # stream, answers what it read, then closes its side (our reader's EOF)
                    try:
                        self._sock.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                self._writing = True
            try:
                self._send_queued(block=True)
            except BaseException as e:  # noqa: BLE001 - every queued call learns it
                self._stop_writing()
                self._abort(e)
                return
            self._stop_writing()

    def _read_loop(self) -> None:
        why: BaseException
        try:
            while True:
                self._answer(*decode_answer(self._recv()))
        except BaseException as e:  # noqa: BLE001 - the end of the stream, or a broken one
            why = e
        self._end(why)

    def _answer(self, call_id: int, ok: bool, value: Any) -> None:
        with self._lock:
            call = self._pending.pop(call_id, None)
        if call is None:
            return
        try:
            if ok:
                call.future.set_result(value)
            else:
                call.future.set_exception(value)
            return
        except concurrent.futures.InvalidStateError:
            pass  # its caller cancelled (or failed) it: it stopped waiting
        if ok and isinstance(value, list) and call.sent and self.late is not None:
            try:
                self.late(call.method, call.sent, value)
            except Exception as e:  # noqa: BLE001 - recovery's orphan cleanup covers it
                log.warning("lane to %s: a late answer could not be released: %s",
                            self.node, e)

    def _abort(self, why: BaseException) -> None:
        """Shut both directions now. The read side is the line: an answer the node wrote
        before it is read (the reader drains what is buffered), one after it fails at the
        node, which releases it (:mod:`dstl_ray.node.lane_server`); none is lost between.

        Over TCP (a host lane) shutting the read side tells the node nothing: its answer
        would land in this host's kernel and be dropped, while the node counts it delivered.
        So a host lane shuts its write side only and fails its calls in flight now; the
        reader reads on until the node closes its side (it answers what it read, then
        closes) or the connection dies (keepalive), and each answer still arriving goes to
        ``late``, which releases it."""
        failed: list[_Call] = []
        with self._lock:
            if self.closed is None:
                self.closed = why
            if self._aborted:
                return
            self._aborted = True
            self._queued.notify_all()
            if self.tcp:
                self._queue = collections.deque()
                failed = list(self._pending.values())  # kept: their answers go to ``late``
            try:
                self._sock.shutdown(socket.SHUT_WR if self.tcp else socket.SHUT_RDWR)
            except OSError:
                pass
        self._fail(failed, why)

    def _fail(self, calls: Iterable[_Call], why: BaseException | None) -> None:
        """Fail each of ``calls`` not answered yet: the lane ended with it in flight."""
        for call in calls:
            if not call.future.done():
                call.future.set_exception(LaneClosedError(
                    f"lane to node {self.node} closed with this call in flight: "
                    f"{type(why).__name__}: {why}"))

    def _end(self, why: BaseException) -> None:
        """(the reader, at the end of the stream) Fail what is left, close the socket."""
        self._abort(why)
        with self._lock:
            while self._writing:  # an inline sender finishing its (non-blocking) send
                self._queued.wait()
            pending, self._pending = self._pending, {}
            self._queue = collections.deque()
            self._sock.close()
            reason = self.closed
        self._fail(pending.values(), reason)
        self._done.set()

    def in_flight_until(self, default_s: float = 5.0) -> float:
        """The latest deadline (``time.monotonic()``) of the calls in flight (``default_s``
        from now for one without a deadline); now when there is none."""
        now = time.monotonic()
        with self._lock:
            return max((now + default_s if c.deadline is None else c.deadline
                        for c in self._pending.values()), default=now)

    def cut(self, why: str) -> None:
        """End the lane now, without waiting (its process is no longer the node actor):
        the answers already written to it are still read and delivered, the rest fail at
        the node, which releases them; calls without an answer fail."""
        self._abort(ConnectionAbortedError(f"cut: {why}"))

    def close(self, drain_s: float = 5.0) -> None:
        """Close from the writer side: no new calls; the frames queued still go out (each
        until its deadline), then the write side is shut and the node answers every call it
        read before it closes its side. Waits up to ``drain_s`` for that, then shuts the read
        side (:meth:`_abort`): answers read by then reach their callers (or ``late``), later
        ones are released at the node. Their segments are thus released exactly once, never
        dropped in a socket buffer. ``drain_s`` 0: as :meth:`cut`, without waiting."""
        with self._lock:
            if self.closed is None:
                self.closed = ConnectionAbortedError("closed by the writer side")
            if not self._aborted:
                self._wake_sender()
        if drain_s > 0 and self._done.wait(drain_s):
            return
        self._abort(ConnectionAbortedError(f"closed by the writer side after {drain_s:g} s"))
        if drain_s > 0:
            self._done.wait(POLL_S + 1.0)  # the reader drains what is buffered


TCP = "tcp://"  # a lane address on another host: tcp://<the node's IP>:<port>
# a host lane whose peer stopped answering TCP keepalives for this long is broken (its host
# lost, or cut off past Ray's health check): its reader ends, as a Unix lane's ends with its
# peer's process. A partitioned peer costs lateness until then, as a stalled one does.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 6


def keepalive(sock: socket.socket) -> None:
    """TCP keepalive on a host lane's socket (either end): a peer silent for
    ~``KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_COUNT`` s ends the connection."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                       ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, opt):  # (Linux; elsewhere the system's defaults)
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def _connect(path: str, timeout_s: float) -> socket.socket:
    """A socket connected to ``path``: a Unix socket's path, or ``tcp://ip:port`` (no
    Nagle delay: a call is one frame, sent whole)."""
    if path.startswith(TCP):
        host, _, port = path[len(TCP):].rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keepalive(sock)
        except BaseException:
            sock.close()
            raise
        return sock
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def open_lane(lane: dict[str, Any], node: str, late: LateHook | None = None,
              tcp: bool = False) -> Lane | None:
    """A lane to node actor ``node`` that offers ``lane`` (its ``lane()`` answer): over its
    Unix socket if the node is on this machine, else, with ``tcp``, over its TCP address
    (the host lane); None if neither, or if it cannot be opened: use Ray."""
    if lane.get("machine") == machine_id() and os.path.exists(lane.get("path") or ""):
        path = lane["path"]
    elif tcp and isinstance(lane.get("tcp"), str) and lane["tcp"].startswith(TCP):
        path = lane["tcp"]
    else:
        return None
    try:
        pid, peer_node = lane.get("pid"), lane.get("node_id")
        return Lane(path, lane["token"], node,
                    peer_pid=pid if isinstance(pid, int) else None, late=late,
                    peer_node=peer_node if isinstance(peer_node, str) else None)
    except Exception as e:  # noqa: BLE001 - Ray still works
        log.info("no lane to node %s (%s): using Ray calls", node, e)
        return None
