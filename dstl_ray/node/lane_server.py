"""The node side of the local lane (:mod:`dstl_ray.transport.lane`): a Unix socket server on
the node actor's event loop that hands each call to the same coroutine its Ray method runs.

Calls start in the order their frames arrive (each becomes a task on the loop, and tasks
start in creation order), as Ray starts an async actor's calls from one caller in order; a
slow call never holds up the next one on the same lane. Answers go back in the order the
calls finish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import secrets
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from ..transport.lane import _LEN, HELLO, METHODS, dump_answer, encode, frame_length, machine_id

log = logging.getLogger(__name__)

Handler = Callable[..., Awaitable[Any]]


async def _read(reader: asyncio.StreamReader) -> Any:
    n = frame_length(await reader.readexactly(_LEN.size))
    return pickle.loads(await reader.readexactly(n))


class LaneServer:
    """Listens on ``<private temp dir>/lane.sock`` once :meth:`start` ran on the actor's loop;
    ``info()`` is what writers need to connect (the node's ``info`` carries it)."""

    def __init__(self, node: str, handlers: dict[str, Handler]) -> None:
        unknown = set(handlers) - set(METHODS)
        if unknown:
            raise ValueError(f"the lane carries {METHODS}, not {sorted(unknown)}")
        self.node = node
        self.handlers = handlers
        self.token = secrets.token_hex(16)
        self.calls = 0
        self.connections = 0
        self.refused = 0
        self._dir: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def path(self) -> str | None:
        return None if self._dir is None else os.path.join(self._dir, "lane.sock")

    async def start(self) -> None:
        if self._server is not None:
            return
        self._dir = tempfile.mkdtemp(prefix="dstl-lane-")  # mode 0700: this user only
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    def info(self) -> dict[str, Any] | None:
        if self._server is None:
            return None
        return {"path": self.path, "token": self.token, "machine": machine_id()}

    def stats(self) -> dict[str, int]:
        return {"calls": self.calls, "connections": self.connections, "refused": self.refused}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lock = asyncio.Lock()  # one frame at a time on the socket
        try:
            hello = await _read(reader)
            if not (isinstance(hello, tuple) and hello == (HELLO, self.token)):
                self.refused += 1
                log.warning("%s: lane connection without the node's token refused", self.node)
                writer.write(encode(("refused", self.node)))
                await writer.drain()
                return
            self.connections += 1
            writer.write(encode(("ok", self.node)))
            await writer.drain()
            while True:
                call_id, method, args = await _read(reader)
                task = asyncio.get_running_loop().create_task(
                    self._run(call_id, method, args, writer, lock))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the writer process went away; its calls still finish here
        except Exception as e:  # noqa: BLE001 - a bad frame ends this connection only
            log.warning("%s: lane connection closed: %s: %s", self.node, type(e).__name__, e)
        finally:
            writer.close()

    async def _run(self, call_id: int, method: str, args: tuple[Any, ...],
                   writer: asyncio.StreamWriter, lock: asyncio.Lock) -> None:
        self.calls += 1
        try:
            handler = self.handlers.get(method)
            if handler is None:
                raise ValueError(f"the lane carries {METHODS}, not {method!r}")
            frame = encode((call_id, True, dump_answer(await handler(*args))))
        except Exception as e:  # noqa: BLE001 - the caller learns it, as from a Ray call
            frame = encode((call_id, False, dump_answer(e)))
        if writer.is_closing():
            return
        async with lock:
            try:
                writer.write(frame)
                await writer.drain()
            except ConnectionError:
                pass  # the writer process went away

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
