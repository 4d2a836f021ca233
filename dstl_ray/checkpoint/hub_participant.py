"""``HubParticipant``: a process hosting subtasks takes part in the checkpoints of a
:class:`~dstl_ray.checkpoint.hub.CheckpointHub`.

It connects to the hub's address under a name and serves its triggers on a thread of its
own: for checkpoint ``n`` it calls ``snapshot(n)`` (the checkpoint barrier: the process
snapshots each of its backends between two records, as a Flink task's mailbox takes the
barrier) and answers once every snapshot is durable, from the thread that completes the last
one (no thread waits). ``snapshot`` returns the snapshots or their futures, e.g. ``[b.snapshot(n)
for b in backends]``; if it raises, or a snapshot fails, the answer declines the checkpoint with
the error.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import HubError
from ..log.futures import when_all_done
from ..state.json_memo import json_list
from ..state.snapshot import KeyedStateSnapshot
from .hub_wire import (
    PROTOCOL,
    HubAddress,
    encode_frame,
    recv_frame,
    send_frame,
    trigger_of,
    watch_peer,
)

log = logging.getLogger(__name__)

Snapshots = Iterable["KeyedStateSnapshot | concurrent.futures.Future[KeyedStateSnapshot]"]


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class HubParticipant:
    """Connects to the hub at ``address`` as ``name`` (a name connected again replaces the
    earlier connection: a restarted process keeps its name) and answers its triggers with
    ``snapshot(n)``'s snapshots. :class:`HubError` when the hub refuses it (a wrong token)."""

    def __init__(self, address: HubAddress, name: str,
                 snapshot: Callable[[int], Snapshots], timeout_s: float = 30.0) -> None:
        self.name, self._snapshot = name, snapshot
        sock = socket.create_connection((address.host, address.port), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_frame(sock, {"hello": PROTOCOL, "token": address.token, "name": name})
            answer = recv_frame(sock)
            if not answer.get("ok"):
                raise HubError(f"the checkpoint hub at {address.host}:{address.port} refused "
                               f"{name!r}: {answer.get('error', answer)}")
            sock.settimeout(None)
            watch_peer(sock)  # a hub gone without a word ends the connection
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._send = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=f"dstl-hub-{name}",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while True:
                self._trigger(*trigger_of(recv_frame(self._sock)))
        except (HubError, OSError) as e:
            log.debug("checkpoint hub participant %r: connection ended: %s", self.name, e)
        except Exception as e:  # noqa: BLE001 - logged; the hub sees the connection end
            log.warning("checkpoint hub participant %r: stopped: %s", self.name, _error(e))
        finally:  # never connected and deaf: the hub declines at once instead of waiting
            self._sock.close()

    def _trigger(self, n: int, attempt: int) -> None:
        key = {"id": n, "attempt": attempt}
        try:
            items = list(self._snapshot(n))
        except Exception as e:  # noqa: BLE001 - declined, with the reason
            self._reply({**key, "error": _error(e)})
            return
        when_all_done([i for i in items if isinstance(i, concurrent.futures.Future)],
                      lambda: self._answer(key, items))

    def _answer(self, key: dict[str, int], items: list[Any]) -> None:
        try:
            snaps = [i.result() if isinstance(i, concurrent.futures.Future) else i
                     for i in items]
            # encoded here: one that cannot be sent (not JSON, too big) declines, rather
            # than never comes
            frame = encode_frame(key, snapshots=json_list(json.dumps(s.to_json())
                                                          for s in snaps))
        except Exception as e:  # noqa: BLE001 - a failed snapshot declines
            self._reply({**key, "error": _error(e)})
            return
        self._send_frame(frame, key["id"])

    def _reply(self, message: dict[str, Any]) -> None:
        self._send_frame(encode_frame(message), message.get("id"))

    def _send_frame(self, frame: bytes, n: Any) -> None:
        try:
            with self._send:
                self._sock.sendall(frame)
        except Exception as e:  # noqa: BLE001 - the hub gone: declined there, by its deadline
            log.warning("checkpoint hub participant %r: answer to checkpoint %s not sent: %s",
                        self.name, n, _error(e))

    def close(self) -> None:
        """Leave the hub (a checkpoint waiting for this participant is declined). Waits up to
        10 s for a barrier ``snapshot`` is taking."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=10)

    def __enter__(self) -> HubParticipant:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
