"""The local lane: a writer's persist and mark calls to a node actor on the SAME machine over
a Unix socket, not through Ray (docs/architecture.md "Write path" 2); node actors use it the
same way for a child's batches and marks to a parent on their machine ("Write path" 4,
:meth:`Lane.submit`).

Measured on the checkpoint path (issue "checkpoint latency"), a Ray actor call from a writer
process to its node actor cost 3.3 ms to arrive and 2.2 ms to answer at the median while
the checkpoint's processes all woke at once, against about 0.6 ms each way on an idle
machine: Ray's per-call work (task submission, gRPC, scheduling on the actor) is what the
burst queues behind. The lane carries the same two calls as length-prefixed frames (JSON and
raw bytes, :mod:`.lane_codec`, never pickle) on a socket the node actor listens on, straight
into the same coroutines, so a request's semantics (vetting, admission, batching, deadlines)
are exactly those of the Ray call; only the carrier changes. Everything else
(registration, releases, retains, status) stays on Ray.

Trust: the socket lives in a directory only the node actor's user can enter, and a
connection must first present the node's token as raw bytes (compared in constant time),
which writers get from the node's ``lane()`` method over Ray. Frames are never unpickled:
each field of a call is decoded and type-checked into its dataclass.

Failure: a lane that breaks (the node actor died, or the socket did) fails every call in
flight on it with :class:`~dstl_ray.errors.NodeUnavailableError`, as a dead actor fails its
Ray calls; the transport then finds its node again (over Ray) and opens a new lane.

A stalled receiver (a GC pause, SIGSTOP, a blocking call) is not a broken lane: there is no
send timeout. Frames go out without blocking the caller (the rest of a frame the socket did
not take goes from the lane's sender thread), a call fails when ITS deadline passes (the
deadline its caller gives; the caller's own timer fails it, a Ray call would be late the same
way), and a frame not sent by then is dropped unsent (:class:`~dstl_ray.errors.DeadlineError`)
so nothing reaches the node for a call nobody waits for. A frame begun is always finished: the
stream stays whole, and the node answers (or releases, :mod:`dstl_ray.node.lane_server`) what
it did for the call. docs/architecture.md "Write path" 2.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import DeadlineError, DstlError, NodeUnavailableError
from .lane_codec import decode_answer, encode_call

log = logging.getLogger(__name__)

HELLO = b"DSTL-LANE/1"
TOKEN_BYTES = 32  # the token's length in hex characters
POLL_S = 1.0  # a sender waiting for a stalled node looks at the queued deadlines this often
_LEN = struct.Struct(">Q")
MAX_FRAME = 1 << 36  # 64 GiB: a length beyond it is a corrupt frame, not a request


def machine_id() -> str:
    """Names this machine (host name and boot id): a lane is used only between processes
    that share it, where a Unix socket path means the same socket."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def frame(body: bytes) -> bytes:
    """One frame: an 8-byte length, then the body (:mod:`.lane_codec`)."""
    return _LEN.pack(len(body)) + body


def hello_bytes(token: str) -> bytes:
    """The first bytes of a connection: the protocol and the node's token, raw (the node
    compares them before it reads anything else)."""
    raw = token.encode("ascii")
    if len(raw) != TOKEN_BYTES:
        raise DstlError(f"a lane token has {TOKEN_BYTES} characters, got {len(raw)}")
    return HELLO + raw


def frame_length(header: bytes) -> int:
    (n,) = _LEN.unpack(header)
    if n > MAX_FRAME:
        raise DstlError(f"lane frame of {n} bytes: not a frame of this protocol")
    return n


class LaneClosedError(NodeUnavailableError):
    """The lane to a node actor broke: the calls in flight on it failed; the node may be
    alive (find it again over Ray) or dead (as with a Ray call to a dead actor)."""


@dataclass(eq=False)
class _Out:
    """A frame not yet wholly sent (mutable: ``sent`` grows as the socket takes it)."""

    call_id: int
    data: memoryview
    deadline: float | None  # time.monotonic(): not begun by then, it is never sent
    sent: int = 0


class Lane:
    """The writer side of one lane: calls return concurrent futures, answered by a reader
    thread (their callbacks run there: keep them short, as the transport does by handing
    results to its delivery thread). ``peer_pid``: the node actor's process (the lane is
    tied to it: :mod:`dstl_ray.node.peers` drops a lane whose actor Ray has restarted or
    declared dead)."""

    def __init__(self, path: str, token: str, node: str, timeout_s: float = 10.0,
                 peer_pid: int | None = None) -> None:
        self.node = node
        self.path = path
        self.token = token
        self.peer_pid = peer_pid
        self.calls = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout_s)
            self._sock.connect(path)
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
        self._queued = threading.Condition(self._lock)  # frames for the sender thread
        self._queue: collections.deque[_Out] = collections.deque()  # in sending order
        self._writing = False  # a thread is sending from the queue (one at a time)
        self._sender: threading.Thread | None = None
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._ids = itertools.count()
        self.closed: BaseException | None = None
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"dstl-lane-{node}")
        self._reader.start()

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
        :class:`LaneClosedError` if the lane is broken."""
        call_id = next(self._ids)
        out = _Out(call_id, memoryview(frame(encode_call(call_id, method, args))), deadline)
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self.closed is not None:
                raise LaneClosedError(f"lane to node {self.node} is closed: {self.closed}")
            self._pending[call_id] = fut
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
        self._queued.notify()

    def call(self, method: str, *args: Any, deadline: float | None = None
             ) -> concurrent.futures.Future[Any]:
        """Send one call; raises :class:`LaneClosedError` (nothing sent) if the lane is
        broken, so the caller can go by Ray instead. A call that does not encode (an unknown
        method, a bad argument) raises and leaves the lane as it was. The frame goes out from
        this thread as far as the socket takes it without waiting, the rest from the sender
        thread: a stalled node never blocks the caller. ``deadline`` (``time.monotonic()``):
        a frame not begun by then is dropped and its call fails with
        :class:`~dstl_ray.errors.DeadlineError`; the lane itself never times out."""
        out, fut, mine = self._register(method, args, deadline, inline=True)
        if mine:
            try:
                self._send_queued(block=False)
            except BaseException as e:  # noqa: BLE001 - the stream is unusable: close it
                self._close(e)
                if out.sent == 0 and isinstance(e, OSError):
                    raise LaneClosedError(f"lane to node {self.node} broke while sending: "
                                          f"{e}") from e
                if not isinstance(e, OSError):
                    raise
            finally:
                with self._lock:
                    self._writing = False
                    if self._queue and self.closed is None:
                        self._wake_sender()
        return fut

    def submit(self, method: str, *args: Any, deadline: float | None = None
               ) -> concurrent.futures.Future[Any]:
        """As :meth:`call`, but the frame goes out from this lane's sender thread, in
        submission order, so the caller never touches the socket (a node actor's event loop
        calls this). Raises :class:`LaneClosedError` if the lane is broken, or the encoding
        error, before anything is queued; a lane that breaks later fails the queued calls
        with the ones in flight."""
        return self._register(method, args, deadline, inline=False)[1]

    def _drop_expired(self) -> None:
        """Fail and forget the queued frames not begun whose deadline passed: nothing of
        them reached the node, so nothing is done there for a call nobody waits for."""
        now = time.monotonic()
        gone: list[tuple[int, concurrent.futures.Future[Any] | None]] = []
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
        for call_id, fut in gone:
            if fut is not None and not fut.done():
                fut.set_exception(DeadlineError(
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
                if self.closed is not None or not self._queue:
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
                while (not self._queue or self._writing) and self.closed is None:
                    self._queued.wait()
                if self.closed is not None:
                    return
                self._writing = True
            try:
                self._send_queued(block=True)
            except BaseException as e:  # noqa: BLE001 - every queued call learns it
                self._close(e)
                return
            finally:
                with self._lock:
                    self._writing = False

    def _read_loop(self) -> None:
        try:
            while True:
                call_id, ok, value = decode_answer(self._recv())
                with self._lock:
                    fut = self._pending.pop(call_id, None)
                if fut is None:
                    continue
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
        except BaseException as e:  # noqa: BLE001 - every pending call learns it
            self._close(e)

    def _close(self, why: BaseException) -> None:
        with self._lock:
            if self.closed is None:
                self.closed = why
            pending, self._pending = self._pending, {}
            self._queue = collections.deque()
            self._queued.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(LaneClosedError(
                    f"lane to node {self.node} closed with this call in flight: "
                    f"{type(why).__name__}: {why}"))

    def close(self, drain_s: float = 5.0) -> None:
        """Close, after waiting up to ``drain_s`` for the calls in flight: their answers
        name segments the node made durable, which the writers then release (failed here,
        those segments would stay until the job's next recovery cleaned them up)."""
        with self._lock:
            waiting = list(self._pending.values())
        if waiting and self.closed is None:
            concurrent.futures.wait(waiting, timeout=drain_s)
        self._close(ConnectionAbortedError("closed by the writer side"))
        self._sock.close()


def open_lane(lane: dict[str, Any], node: str) -> Lane | None:
    """A lane to node actor ``node`` that offers ``lane`` (its ``lane()`` answer), if the
    node is on this machine (None otherwise, or if it cannot be opened: use Ray)."""
    if lane.get("machine") != machine_id() or not os.path.exists(lane.get("path", "")):
        return None
    try:
        pid = lane.get("pid")
        return Lane(lane["path"], lane["token"], node,
                    peer_pid=pid if isinstance(pid, int) else None)
    except Exception as e:  # noqa: BLE001 - Ray still works
        log.info("no lane to node %s (%s): using Ray calls", node, e)
        return None
