"""The checkpoint hub's wire (:mod:`~dstl_ray.checkpoint.hub`): where a hub listens, and its
frames.

A frame is a 4-byte big-endian length and a JSON object (UTF-8); nothing is ever unpickled,
so a frame can make neither side run code. A connection starts with the participant's hello
(the protocol, the hub's token, the participant's name) and the hub's answer to it; then the
hub sends triggers (``{"id": n}``) and the participant answers each (``{"id": n,
"snapshots": [text, ...]}``, each snapshot's JSON as a string, which the hub decodes once while
it repeats, or ``{"id": n, "error": "..."}``), Flink's ``triggerCheckpoint`` and
``acknowledgeCheckpoint`` / ``declineCheckpoint``. A trigger carries an ``attempt``, a number
the hub never uses twice, and the answer returns it: a late answer to an earlier trigger of
the same checkpoint id (one the hub declined, then took again) is never taken for the new
one's.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, HubError
from ..state.json_memo import json_with

PROTOCOL = "dstl-checkpoint-hub/3"  # /2: triggers and answers carry the attempt; /3: an
# answer's snapshots are each one's JSON text (state/json_memo.py)
_LEN = struct.Struct(">I")
# a frame is a trigger or the snapshots of one process's subtasks (handles, never state):
# anything near this size is not a frame of this protocol
MAX_FRAME = 256 << 20
MAX_HELLO = 4096  # a hello is read before its token is checked: it stays small


@dataclass(frozen=True)
class HubAddress:
    """Where a :class:`~dstl_ray.checkpoint.hub.CheckpointHub` listens and the token it wants:
    what a process hosting subtasks needs to take part (it pickles, so it can go to a Ray
    actor as an argument). The token is kept out of ``repr``."""

    host: str
    port: int
    token: str = field(repr=False)


def encode_frame(message: dict[str, Any], **encoded: str) -> bytes:
    """A frame's bytes: ``message`` with the members of ``encoded``, JSON text already (an
    answer's snapshots, :meth:`~dstl_ray.state.snapshot.KeyedStateSnapshot.to_json`);
    :class:`HubError` for a message above :data:`MAX_FRAME` (the other end would drop the
    connection over it)."""
    body = json_with(message, **encoded).encode()
    if len(body) > MAX_FRAME:
        raise HubError(f"a frame of {len(body)} bytes, above the {MAX_FRAME} a hub reads")
    return _LEN.pack(len(body)) + body


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(encode_frame(message))


# how long sent bytes may stay unacknowledged before the connection is given up: keepalive
# probes only a quiet connection, and a trigger sent to a host that is gone is not quiet
USER_TIMEOUT_MS = 40_000


def watch_peer(sock: socket.socket) -> None:
    """TCP keepalive, and a bound on unacknowledged data, on a hub connection (either end):
    a peer gone without a word ends the connection within a minute, quiet or not."""
    from ..transport.lane import keepalive

    keepalive(sock)
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # (Linux)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)


def _exactly(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    parts, left = [], n
    while left:
        if deadline is not None:  # one deadline for the whole frame, however it trickles
            sock.settimeout(max(0.001, deadline - time.monotonic()))
        got = sock.recv(min(left, 1 << 20))
        if not got:
            raise HubError("the connection closed" + (" in the middle of a frame"
                                                      if left < n or parts else ""))
        parts.append(got)
        left -= len(got)
    return b"".join(parts)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME,
               deadline: float | None = None) -> dict[str, Any]:
    """The next frame's object (whole by ``deadline``, a ``time.monotonic()``, if given);
    :class:`HubError` when the connection closed or the bytes are not a frame of this
    protocol (``OSError`` from the socket itself, ``TimeoutError`` past the deadline)."""
    (n,) = _LEN.unpack(_exactly(sock, _LEN.size, deadline))
    if n > max_bytes:
        raise HubError(f"a frame of {n} bytes: not a frame of {PROTOCOL}")
    body = _exactly(sock, n, deadline)
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise HubError(f"a frame that is not JSON: {type(e).__name__}: {e}") from None
    if not isinstance(message, dict):
        raise HubError(f"a frame that is not a JSON object: {type(message).__name__}")
    return message


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def trigger_of(message: dict[str, Any]) -> tuple[int, int]:
    """A trigger's or an answer's (checkpoint id, attempt)."""
    n, attempt = message.get("id"), message.get("attempt")
    if not _count(n) or not _count(attempt):
        raise HubError(f"a frame without a checkpoint id and attempt: {sorted(message)}")
    return n, attempt


def check_checkpoint_id(n: Any) -> int:
    if not _count(n):
        raise ConfigError(f"a checkpoint id is an int >= 0, got {n!r}")
    return n
