"""``CheckpointHub``: the coordinator's side of checkpoints whose backends live in other
processes (Ray actors, say), triggered and acknowledged over one TCP connection per process.

:meth:`CheckpointCoordinator.complete_checkpoint` takes snapshots taken elsewhere; how they
get there is the job's. Ray actor calls cost 3 ms for a round trip to one process here and 10
ms to four busy ones on one machine, most of a checkpoint without changes; a frame on a
socket the process already holds costs 0.5 and 1.5 ms. So the hub does what Flink's
JobManager does with its RPC: it sends the checkpoint's trigger to every participating
process (Flink's ``triggerCheckpoint``), each takes its subtasks' snapshots and answers with
them once they are durable (``acknowledgeCheckpoint``, or a decline naming the error), and
the hub completes the checkpoint from them. A participant is a
:class:`~dstl_ray.checkpoint.hub_participant.HubParticipant`, given the hub's
:attr:`address` and a name.

Nothing is completed on partial knowledge: a checkpoint waits for every participant named in
:meth:`checkpoint`, and is declined when one is not connected, answers with an error,
disconnects (a restarted one connecting again under its name replaces the old connection, whose
answer no longer counts), or is not in by the deadline; and the snapshots of each operator
must cover its key groups ``0..max_parallelism-1`` exactly once (a participant that left a
subtask out would otherwise complete a checkpoint that restores without it).
"""

from __future__ import annotations

import collections
import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointDeclinedError, ConfigError, HubError
from ..state.snapshot import KeyedStateSnapshot
from .hub_wire import PROTOCOL, HubAddress, checkpoint_id_of, recv_frame, send_frame
from .recovery import CompletedCheckpoint

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class HubCheckpointTimes:
    """How long one checkpoint through the hub took, from its trigger: until the last
    participant's answer (Flink's end-to-end duration, which it counts to the last
    acknowledgement) and until its ``_metadata`` was durable."""

    checkpoint_id: int
    acknowledged_s: float
    completed_s: float


class _Connection:
    """One participant's connection: sends under a lock (triggers of concurrent checkpoints)."""

    def __init__(self, name: str, sock: socket.socket) -> None:
        self.name, self.sock = name, sock
        self._send = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        with self._send:
            send_frame(self.sock, message)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def check_coverage(snapshots: list[KeyedStateSnapshot], max_parallelism: int) -> None:
    """Each operator's snapshots cover key groups ``0..max_parallelism-1``, each once."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for s in snapshots:
        ranges.setdefault(s.operator_id, []).append((s.key_group_range.start,
                                                     s.key_group_range.end))
    for op, rs in sorted(ranges.items()):
        rs.sort()
        nxt = 0
        for start, end in rs:
            if start != nxt:
                raise CheckpointDeclinedError(
                    f"operator {op!r}: the snapshots cover key groups {rs}, not 0.."
                    f"{max_parallelism - 1} each once ({'overlap' if start < nxt else 'gap'}"
                    f" at {min(start, nxt)})")
            nxt = end + 1
        if nxt != max_parallelism:
            raise CheckpointDeclinedError(f"operator {op!r}: the snapshots cover key groups "
                                          f"{rs}, not 0..{max_parallelism - 1}")


class CheckpointHub:
    """Triggers checkpoints of ``coordinator``'s job at participant processes and completes
    them from their answers. Listens on ``host`` (``port`` 0: any free port); on a cluster of
    several machines, give the host's address the participants reach (e.g.
    ``ray.util.get_node_ip_address()``)."""

    def __init__(self, coordinator: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.coordinator = coordinator
        self._token = secrets.token_hex(16)
        self._server = socket.create_server((host, port))
        self.address = HubAddress(host, self._server.getsockname()[1], self._token)
        self._cond = threading.Condition()
        self._conns: dict[str, _Connection] = {}
        # checkpoint id -> {participant: its snapshot dicts, or the error it declined with}
        self._answers: dict[int, dict[str, list[Any] | str]] = {}
        self._closed = False
        # the latest completed checkpoints' durations, oldest first
        self.history: collections.deque[HubCheckpointTimes] = collections.deque(maxlen=1000)
        threading.Thread(target=self._accept, name="dstl-hub-accept", daemon=True).start()

    # ------------------------------------------------------------------ connections

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(sock,), name="dstl-hub-conn",
                             daemon=True).start()

    def _hello(self, sock: socket.socket) -> _Connection | None:
        sock.settimeout(HELLO_TIMEOUT_S)
        hello = recv_frame(sock)
        name, token = hello.get("name"), hello.get("token")
        if hello.get("hello") != PROTOCOL:
            send_frame(sock, {"error": f"this hub speaks {PROTOCOL}, not {hello.get('hello')!r}"})
            return None
        if not isinstance(token, str) or not hmac.compare_digest(token, self._token):
            send_frame(sock, {"error": "wrong token for this checkpoint hub"})
            return None
        if not isinstance(name, str) or not name:
            send_frame(sock, {"error": f"a participant needs a name, got {name!r}"})
            return None
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(sock, {"ok": True})
        return _Connection(name, sock)

    def _serve(self, sock: socket.socket) -> None:
        conn = None
        try:
            conn = self._hello(sock)
            if conn is None:
                return
            with self._cond:
                if self._closed:
                    return
                old, self._conns[conn.name] = self._conns.get(conn.name), conn
                self._cond.notify_all()
            if old is not None:  # restarted: the old process's answers no longer count
                old.close()
            while True:
                self._answer(conn, recv_frame(sock))
        except (HubError, OSError) as e:
            if conn is not None and not self._closed:
                log.info("checkpoint hub: participant %r disconnected: %s", conn.name, e)
        finally:
            sock.close()
            if conn is not None:
                with self._cond:
                    if self._conns.get(conn.name) is conn:
                        del self._conns[conn.name]
                    self._cond.notify_all()

    def _answer(self, conn: _Connection, message: dict[str, Any]) -> None:
        n = checkpoint_id_of(message)
        got: list[Any] | str
        if "error" in message:
            got = str(message["error"])
        else:
            snaps = message.get("snapshots")
            if not isinstance(snaps, list):
                raise HubError(f"{conn.name!r} answered checkpoint {n} without snapshots")
            got = snaps
        with self._cond:
            answers = self._answers.get(n)
            if answers is not None and self._conns.get(conn.name) is conn:
                answers.setdefault(conn.name, got)
                self._cond.notify_all()

    def connected(self) -> list[str]:
        """The names of the participants connected now."""
        with self._cond:
            return sorted(self._conns)

    def wait_for(self, names: Collection[str], timeout_s: float = 60.0) -> None:
        """Until every participant of ``names`` is connected (:class:`HubError` after
        ``timeout_s``)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or set(names) <= self._conns.keys(),
                                       timeout_s):
                raise HubError(f"participants not connected after {timeout_s} s: "
                               f"{sorted(set(names) - self._conns.keys())}")

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self, checkpoint_id: int, participants: Collection[str],
                   timeout_s: float = 60.0) -> CompletedCheckpoint:
        """Checkpoint ``checkpoint_id``: triggered at every one of ``participants``,
        completed (``_metadata`` durable) from their snapshots; raises
        :class:`CheckpointDeclinedError` naming the participant when one fails it."""
        names = sorted(set(participants))
        if not names:
            raise ConfigError("a checkpoint through the hub needs at least one participant")
        n, t0 = checkpoint_id, time.monotonic()
        with self._cond:
            if self._closed:
                raise HubError("the checkpoint hub is closed")
            missing = [p for p in names if p not in self._conns]
            if missing:
                raise CheckpointDeclinedError(f"checkpoint {n}: participants not connected: "
                                              f"{missing}")
            if n in self._answers:
                raise CheckpointDeclinedError(f"checkpoint {n} is already being taken")
            conns = {p: self._conns[p] for p in names}
            answers = self._answers[n] = {}
        try:
            self.coordinator.begin_checkpoint(n)  # chk-n made while the snapshots are taken
            for p, c in conns.items():
                try:
                    c.send({"id": n})
                except OSError as e:
                    raise CheckpointDeclinedError(f"checkpoint {n}: the trigger did not reach "
                                                  f"{p!r}: {e}") from e
            self._await(n, conns, answers, t0 + timeout_s, timeout_s)
        finally:
            with self._cond:
                self._answers.pop(n, None)
        t1 = time.monotonic()
        snaps = [KeyedStateSnapshot.from_dict(d, self.coordinator.base_path)
                 for p in names for d in answers[p]]  # type: ignore[union-attr]
        check_coverage(snaps, self.coordinator.max_parallelism)
        cc = self.coordinator.complete_checkpoint(n, snaps)
        self.history.append(HubCheckpointTimes(n, t1 - t0, time.monotonic() - t0))
        return cc

    def _await(self, n: int, conns: dict[str, _Connection], answers: dict[str, Any],
               deadline: float, timeout_s: float) -> None:
        with self._cond:
            while True:
                for p, got in answers.items():
                    if isinstance(got, str):
                        raise CheckpointDeclinedError(f"checkpoint {n}: participant {p!r} "
                                                      f"declined it: {got}")
                if len(answers) == len(conns):
                    return
                gone = [p for p, c in conns.items()
                        if p not in answers and self._conns.get(p) is not c]
                if gone or self._closed:
                    raise CheckpointDeclinedError(
                        f"checkpoint {n}: participants disconnected before answering: "
                        f"{gone or sorted(set(conns) - answers.keys())}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CheckpointDeclinedError(
                        f"checkpoint {n}: no answer from {sorted(set(conns) - answers.keys())}"
                        f" within {timeout_s} s")
                self._cond.wait(left)

    def close(self) -> None:
        """Stop listening and drop every participant (a checkpoint waiting is declined)."""
        with self._cond:
            self._closed = True
            conns = list(self._conns.values())
            self._cond.notify_all()
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone may not)
        except OSError:
            pass
        self._server.close()
        for c in conns:
            c.close()

    def __enter__(self) -> CheckpointHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
