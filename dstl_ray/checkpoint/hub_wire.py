"""The checkpoint hub's wire (:mod:`~dstl_ray.checkpoint.hub`): where a hub listens, and its
frames.

A frame is a 4-byte big-endian length and a JSON object (UTF-8); nothing is ever unpickled,
so a frame can make neither side run code. A connection starts with the participant's hello
(the protocol, the hub's token, the participant's name) and the hub's answer to it; then the
hub sends triggers (``{"id": n}``) and the participant answers each (``{"id": n,
"snapshots": [...]}`` or ``{"id": n, "error": "..."}``), Flink's ``triggerCheckpoint`` and
``acknowledgeCheckpoint`` / ``declineCheckpoint``.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

from ..errors import HubError

PROTOCOL = "dstl-checkpoint-hub/1"
_LEN = struct.Struct(">I")
# a frame is a trigger or the snapshots of one process's subtasks (handles, never state):
# anything near this size is not a frame of this protocol
MAX_FRAME = 256 << 20


@dataclass(frozen=True)
class HubAddress:
    """Where a :class:`~dstl_ray.checkpoint.hub.CheckpointHub` listens and the token it wants:
    what a process hosting subtasks needs to take part (it pickles, so it can go to a Ray
    actor as an argument). The token is kept out of ``repr``."""

    host: str
    port: int
    token: str = field(repr=False)


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def _exactly(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        got = sock.recv(min(left, 1 << 20))
        if not got:
            raise HubError("the connection closed" + (" in the middle of a frame"
                                                      if left < n or parts else ""))
        parts.append(got)
        left -= len(got)
    return b"".join(parts)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    """The next frame's object; :class:`HubError` when the connection closed or the bytes
    are not a frame of this protocol."""
    (n,) = _LEN.unpack(_exactly(sock, _LEN.size))
    if n > MAX_FRAME:
        raise HubError(f"a frame of {n} bytes: not a frame of {PROTOCOL}")
    body = _exactly(sock, n)
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise HubError(f"a frame that is not JSON: {e}") from None
    if not isinstance(message, dict):
        raise HubError(f"a frame that is not a JSON object: {type(message).__name__}")
    return message


def checkpoint_id_of(message: dict[str, Any]) -> int:
    n = message.get("id")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise HubError(f"a frame without a checkpoint id: {sorted(message)}")
    return n
