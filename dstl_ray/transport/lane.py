"""The local lane: a writer's persist and mark calls to a node actor on the SAME machine over
a Unix socket, not through Ray (docs/architecture.md "Write path" 2).

Measured on the checkpoint path (issue "checkpoint latency"), a Ray actor call from a writer
process to its node actor cost 3.3 ms to arrive and 2.2 ms to answer at the median while
the checkpoint's processes all woke at once, against about 0.6 ms each way on an idle
machine: Ray's per-call work (task submission, gRPC, scheduling on the actor) is what the
burst queues behind. The lane carries the same two calls as length-prefixed pickled frames
on a socket the node actor listens on, straight into the same coroutines, so a request's
semantics (vetting, admission, batching, deadlines) are exactly those of the Ray call; only
the carrier changes. Everything else (registration, releases, retains, status) stays on Ray.

Trust: the socket lives in a directory only the node actor's user can enter, and a
connection must first present the node's token, which writers get from the node's ``info``
over Ray; frames are unpickled only after that (as Ray's own calls carry pickled values).

Failure: a lane that breaks (the node actor died, or the socket did) fails every call in
flight on it with :class:`~dstl_ray.errors.NodeUnavailableError`, as a dead actor fails its
Ray calls; the transport then finds its node again (over Ray) and opens a new lane.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import pickle
import socket
import struct
import threading
from typing import Any

from ..errors import DstlError, NodeUnavailableError

log = logging.getLogger(__name__)

HELLO = b"DSTL-LANE/1"
METHODS = ("persist_many", "mark")  # what a lane carries; everything else goes by Ray
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


def encode(value: Any) -> bytes:
    """One frame: an 8-byte length, then the pickled value."""
    data = pickle.dumps(value, protocol=5)
    return _LEN.pack(len(data)) + data


def dump_answer(value: Any) -> bytes:
    """A call's answer, pickled on its own inside the answer frame, so a value the caller
    cannot read fails that call only. An exception that does not pickle (a library's error
    holding a lock, say) travels as a :class:`DstlError` naming it."""
    try:
        return pickle.dumps(value, protocol=5)
    except Exception:  # noqa: BLE001 - only exceptions can be unpicklable here
        return pickle.dumps(_picklable(value), protocol=5)


def load_answer(ok: bool, data: bytes) -> tuple[bool, Any]:
    """(ok, value) of an answer :func:`dump_answer` made; one that cannot be unpickled here
    (an exception class whose constructor takes other arguments) fails its call with a
    :class:`DstlError` saying so."""
    try:
        return ok, pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - the call learns it failed, the lane lives on
        return False, DstlError(f"the node's answer could not be read here: "
                                f"{type(e).__name__}: {e}")


def _picklable(value: Any) -> Any:
    if isinstance(value, BaseException):
        return DstlError(f"{type(value).__name__}: {value}")
    if isinstance(value, tuple):
        return tuple(_picklable(v) for v in value)
    if isinstance(value, list):
        return [_picklable(v) for v in value]
    return value


def frame_length(header: bytes) -> int:
    (n,) = _LEN.unpack(header)
    if n > MAX_FRAME:
        raise DstlError(f"lane frame of {n} bytes: not a frame of this protocol")
    return n


class LaneClosedError(NodeUnavailableError):
    """The lane to a node actor broke: the calls in flight on it failed; the node may be
    alive (find it again over Ray) or dead (as with a Ray call to a dead actor)."""


class Lane:
    """The writer side of one lane: calls return concurrent futures, answered by a reader
    thread (their callbacks run there: keep them short, as the transport does by handing
    results to its delivery thread)."""

    def __init__(self, path: str, token: str, node: str, timeout_s: float = 10.0) -> None:
        self.node = node
        self.path = path
        self.calls = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout_s)
            self._sock.connect(path)
            self._sock.sendall(encode((HELLO, token)))
            answer = self._recv()
            if answer != ("ok", node):
                raise DstlError(f"node {node} refused the lane: {answer!r}")
            self._sock.settimeout(None)
        except BaseException:
            self._sock.close()
            raise
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
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

    def _recv(self) -> Any:
        n = frame_length(self._recv_exact(_LEN.size))
        return pickle.loads(self._recv_exact(n))

    def call(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        """Send one call; raises :class:`LaneClosedError` (nothing sent) if the lane is
        broken, so the caller can go by Ray instead."""
        if method not in METHODS:
            raise DstlError(f"the lane carries {', '.join(METHODS)}, not {method!r}")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self.closed is not None:
                raise LaneClosedError(f"lane to node {self.node} is closed: {self.closed}")
            call_id = next(self._ids)
            self._pending[call_id] = fut
        frame = encode((call_id, method, args))
        try:
            with self._send_lock:
                self._sock.sendall(frame)
        except OSError as e:
            with self._lock:
                self._pending.pop(call_id, None)
            self._close(e)
            raise LaneClosedError(f"lane to node {self.node} broke while sending: {e}") from e
        self.calls += 1
        return fut

    def _read_loop(self) -> None:
        try:
            while True:
                call_id, ok, data = self._recv()
                with self._lock:
                    fut = self._pending.pop(call_id, None)
                if fut is None:
                    continue
                ok, value = load_answer(ok, data)
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
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(LaneClosedError(
                    f"lane to node {self.node} closed with this call in flight: "
                    f"{type(why).__name__}: {why}"))

    def close(self) -> None:
        self._close(ConnectionAbortedError("closed by the writer side"))
        self._sock.close()


def open_lane(lane: dict[str, Any], node: str) -> Lane | None:
    """A lane to node actor ``node`` that offers ``lane`` (its ``lane()`` answer), if the
    node is on this machine (None otherwise, or if it cannot be opened: use Ray)."""
    if lane.get("machine") != machine_id() or not os.path.exists(lane.get("path", "")):
        return None
    try:
        return Lane(lane["path"], lane["token"], node)
    except Exception as e:  # noqa: BLE001 - Ray still works
        log.info("no lane to node %s (%s): using Ray calls", node, e)
        return None
