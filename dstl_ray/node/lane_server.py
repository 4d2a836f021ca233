"""The node side of the local lane (:mod:`dstl_ray.transport.lane`): a Unix socket server on
the node actor's event loop that hands each call to the same coroutine its Ray method runs.

Calls start in the order their frames arrive (each becomes a task on the loop, and tasks
start in creation order), as Ray starts an async actor's calls from one caller in order; a
slow call never holds up the next one on the same lane. Answers go back in the order the
calls finish.

An answer counts as delivered only once the kernel took all of it (no bytes left in the
loop's buffer), and a caller closing its lane shuts its write side first: the server then
answers every call it read before it closes its own side, so the caller reads them all. An
answer that cannot be delivered (the caller's process died, it shut its read side, or the
answer would not encode) names segments nobody will name: they are released unused
(``release``, the router's release of late answers), as the caller would have released a late
answer, so no file written for it stays until the job's next recovery. Every path that did
not deliver an answer releases it, a cancelled call included. docs/architecture.md "Write
path" 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import DstlError
from ..process_identity import ProcessId
from ..transport.lane import keepalive
from ..transport.lane_codec import (
    _LEN,
    HELLO,
    METHODS,
    PROTOCOL,
    TOKEN_BYTES,
    decode_call,
    encode_answer,
    frame,
    frame_length,
    hello_bytes,
    machine_id,
)

log = logging.getLogger(__name__)

Handler = Callable[..., Awaitable[Any]]
# releases the segments of an answer nobody got: (the call's requests, its results)
Release = Callable[[list[Any], list[Any]], Awaitable[None]]


DIR_PREFIX = "dstl-lane-"
HELLO_TIMEOUT_S = 10.0  # a connection that has not said the protocol and token by then goes
OWNER_FILE = "owner.json"  # who made a lane directory: machine, pid, start time


def owner_record() -> dict[str, Any]:
    """This process, as a lane directory records its maker (:mod:`dstl_ray.process_identity`)."""
    return ProcessId.current().to_dict()


def _owner_gone(path: str) -> bool:
    """Whether the process that made lane directory ``path`` is gone for sure
    (:meth:`~dstl_ray.process_identity.ProcessId.dead`: of this machine and pid namespace,
    and no process with its pid and start time exists). A directory without a readable
    record (being made this instant, or by an older version) is never judged."""
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            owner = ProcessId.from_dict(json.load(f))
    except (OSError, ValueError):
        return False  # unreadable (not ours, half written): keep it
    return owner is not None and owner.dead()


def remove_dead_lanes(root: str | None = None) -> int:
    """Remove the lane directories (``dstl-lane-*``) of this user's node actors whose process
    is gone (killed: no shutdown ran); returns how many. A process is judged only within its
    own process table and by pid AND start time, so another PID namespace sharing the
    directory never loses a live lane, and a reused pid does not keep a dead one."""
    root = root or tempfile.gettempdir()
    removed = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(DIR_PREFIX):
            continue
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if _owner_gone(path):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


async def _read(reader: asyncio.StreamReader) -> bytes:
    n = frame_length(await reader.readexactly(_LEN.size))
    return await reader.readexactly(n)


async def _failed(e: BaseException) -> Any:
    raise e


class LaneServer:
    """Listens on ``<private temp dir>/lane.sock`` once :meth:`start` ran on the actor's loop
    (and, given ``tcp_host``, on a TCP port of that address: the host lane); ``info()`` is
    what writers and peers need to connect (the node's ``lane()`` method returns it)."""

    def __init__(self, node: str, handlers: dict[str, Handler],
                 release: Release | None = None, tcp_host: str | None = None,
                 node_id: str | None = None) -> None:
        unknown = set(handlers) - set(METHODS)
        if unknown:
            raise ValueError(f"the lane carries {METHODS}, not {sorted(unknown)}")
        self.node = node
        self.handlers = handlers
        self.token = secrets.token_hex(16)
        self.calls = 0
        self.connections = 0
        self.tcp_connections = 0  # of them, host lanes (peers on other hosts)
        self.refused = 0
        self.undelivered = 0  # answers whose connection broke first (their segments released)
        self._release = release
        self._dir: str | None = None
        self._server: asyncio.AbstractServer | None = None
        # the host lane: the same calls over TCP on this host's IP, for peers on other hosts
        self._tcp_host = tcp_host
        self._tcp: asyncio.AbstractServer | None = None
        self._node_id = node_id  # the Ray node this actor runs on (lane_watch compares it)
        self._starting = asyncio.Lock()  # (bound to the loop on first use)
        self._tasks: set[asyncio.Task] = set()

    @property
    def path(self) -> str | None:
        return None if self._dir is None else os.path.join(self._dir, "lane.sock")

    async def start(self) -> None:
        """Listen (once, however many writers ask at the same time)."""
        async with self._starting:
            if self._server is not None:
                return
            remove_dead_lanes()
            # mode 0700: this user only; the owner record lets a later actor remove it
            # should this process die without shutting down
            self._dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")
            try:
                # written under a temporary name and renamed into place: the record is
                # either whole or absent (an absent one is never judged), never half written
                tmp = os.path.join(self._dir, f".{OWNER_FILE}.tmp")
                with open(tmp, "w") as f:
                    json.dump(owner_record(), f)
                os.replace(tmp, os.path.join(self._dir, OWNER_FILE))
                self._server = await asyncio.start_unix_server(self._serve, path=self.path)
            except BaseException:
                shutil.rmtree(self._dir, ignore_errors=True)  # ours, and of no use
                self._dir = None
                raise
            if self._tcp_host is not None:
                try:
                    self._tcp = await asyncio.start_server(self._serve, host=self._tcp_host,
                                                           port=0)
                except OSError as e:  # (an address not of this host, behind NAT): by Ray
                    log.warning("%s: no host lane on %s: %s (peers on other hosts use Ray "
                                "calls)", self.node, self._tcp_host, e)

    def info(self) -> dict[str, Any] | None:
        if self._server is None:
            return None
        # the pid ties a lane to this process: a peer drops a lane whose actor Ray restarted
        # elsewhere or declared dead (dstl_ray.node.peers)
        info: dict[str, Any] = {"path": self.path, "token": self.token,
                                "machine": machine_id(), "pid": os.getpid()}
        if self._tcp is not None:
            host, port = self._tcp.sockets[0].getsockname()[:2]
            info["tcp"] = f"tcp://{host}:{port}"
        if self._node_id:
            info["node_id"] = self._node_id
        return info

    def stats(self) -> dict[str, int]:
        return {"calls": self.calls, "connections": self.connections,
                "tcp_connections": self.tcp_connections, "refused": self.refused,
                "undelivered": self.undelivered}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lock = asyncio.Lock()  # one frame at a time on the socket
        mine: set[asyncio.Task] = set()  # this connection's calls not answered yet
        try:
            # drain() returns only once the kernel took every byte: an answer still in the
            # loop's buffer when the connection ends is undelivered, and released here
            writer.transport.set_write_buffer_limits(high=0)
            tcp = isinstance(writer.get_extra_info("peername"), tuple)
            if tcp:  # a host lane: a peer whose host is gone ends the connection
                keepalive(writer.get_extra_info("socket"))
            # raw bytes, compared before anything else is read (a host lane is reachable
            # from the network: a connection that does not say them in time is dropped)
            hello = await asyncio.wait_for(reader.readexactly(len(HELLO) + TOKEN_BYTES),
                                           HELLO_TIMEOUT_S)
            if not hmac.compare_digest(hello, hello_bytes(self.token)):
                self.refused += 1
                if hello.startswith(PROTOCOL) and not hello.startswith(HELLO):
                    log.warning("%s: lane connection of protocol %s refused (this node "
                                "speaks %s): that peer uses Ray calls", self.node,
                                hello[:len(HELLO)].decode("ascii", "replace"),
                                HELLO.decode())
                else:
                    log.warning("%s: lane connection without the node's token refused",
                                self.node)
                writer.write(b"NO")
                await writer.drain()
                return
            self.connections += 1
            self.tcp_connections += tcp
            writer.write(b"OK")
            await writer.drain()
            while True:
                body = await _read(reader)
                method, args = "", ()
                try:
                    call_id, method, args = decode_call(body)
                    handler = self.handlers.get(method)
                    work = handler(*args) if handler is not None else _failed(
                        DstlError(f"node {self.node} takes no {method!r} by lane"))
                except DstlError as e:
                    if not hasattr(e, "call_id"):
                        raise  # no call to answer: this connection is unusable
                    call_id, work = e.call_id, _failed(e)  # answered with the error
                task = asyncio.get_running_loop().create_task(
                    self._run(call_id, method, args, work, writer, lock))
                for tasks in (self._tasks, mine):
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            # the writer shut its side (closing the lane) or went away: answer what it sent
            # (its reader waits for our end of the stream), then close
            if mine:
                await asyncio.wait(set(mine))
        except Exception as e:  # noqa: BLE001 - a bad frame ends this connection only
            log.warning("%s: lane connection closed: %s: %s", self.node, type(e).__name__, e)
        finally:
            with contextlib.suppress(RuntimeError):  # the event loop closed under us
                writer.close()

    async def _run(self, call_id: int, method: str, args: tuple[Any, ...],
                   work: Awaitable[Any], writer: asyncio.StreamWriter,
                   lock: asyncio.Lock) -> None:
        self.calls += 1
        value: Any = None
        try:
            value = await work
        except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 - the caller learns it
            data = frame(encode_answer(call_id, False, e if isinstance(e, Exception) else
                                       DstlError("the call was cancelled")))
        else:
            try:
                data = frame(encode_answer(call_id, True, value))
            except Exception as e:  # noqa: BLE001 - the caller learns it; nobody names these
                log.warning("%s: cannot encode the answer of %s: %s", self.node, method, e)
                await self._undelivered(method, args, value)
                value = None
                data = frame(encode_answer(call_id, False, DstlError(
                    f"node {self.node} could not encode its answer: {type(e).__name__}: {e}")))
        delivered = False
        try:
            async with lock:
                if not writer.is_closing():  # (a closing transport drops writes silently)
                    writer.write(data)
                    await writer.drain()
                    delivered = True
        except ConnectionError:
            pass  # the caller's process went away, or it shut its read side
        except Exception as e:  # noqa: BLE001 - undelivered all the same
            log.warning("%s: lane answer not sent: %s: %s", self.node, type(e).__name__, e)
        finally:
            if not delivered:  # (cancelled too: the release runs to its end)
                await asyncio.shield(self._undelivered(method, args, value))

    async def _undelivered(self, method: str, args: tuple[Any, ...], value: Any) -> None:
        """Nobody gets this answer: release the segments it names, unused."""
        self.undelivered += 1
        if (self._release is None or method not in ("persist_many", "persist_batch")
                or not isinstance(value, list) or not args):
            return
        log.info("%s: lane answer of %s undeliverable: releasing its segments", self.node,
                 method)
        try:
            await self._release(list(args[0]), value)
        except Exception as e:  # noqa: BLE001 - recovery's orphan cleanup covers it
            log.warning("%s: cannot release an undelivered answer: %s", self.node, e)

    async def close(self) -> None:
        if self._tcp is not None:
            self._tcp.close()
            self._tcp = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
