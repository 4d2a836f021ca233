"""``CheckpointHub``: the coordinator's side of checkpoints whose backends live in other
processes (Ray actors, say), triggered and acknowledged over one TCP connection per process.

:meth:`CheckpointCoordinator.complete_checkpoint` takes snapshots taken elsewhere; how they
get there is the job's. A Ray actor call costs 1.5-2.5 ms each way to a busy process on one
machine here, most of a checkpoint without changes; a frame on a socket the process already
holds costs a tenth of that. So the hub does what Flink's JobManager does with its RPC: it
sends the checkpoint's trigger to every participating process (Flink's
``triggerCheckpoint``), each takes its subtasks' snapshots and answers with them once they
are durable (``acknowledgeCheckpoint``, or a decline naming the error), and the hub completes
the checkpoint from them. A participant is a
:class:`~dstl_ray.checkpoint.hub_participant.HubParticipant`, given the hub's
:attr:`address` and a name.

Nothing is completed on partial knowledge. A checkpoint waits for every participant named in
:meth:`checkpoint`, over the connection each had when it was triggered, and is declined when
one is not connected, answers with an error, loses that connection before the checkpoint
completes (a restarted one connecting again under its name replaces the old connection, as
Flink's failover aborts the pending checkpoints), or is not in by the deadline. What the
answers hold is checked before anything is written (:mod:`~dstl_ray.checkpoint.hub_checks`):
each answer reads, every operator of the job is there, each operator's key groups are
covered exactly once. Restart a participant between checkpoints, from the latest complete
one: one restored while a checkpoint is in flight may restore from the checkpoint that the
flight subsumes.
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
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointDeclinedError, ConfigError, HubError
from ..state.json_memo import DecodeMemo
from .hub_checks import check_coverage, check_operators, read_answers
from .hub_wire import (
    MAX_HELLO,
    PROTOCOL,
    HubAddress,
    check_checkpoint_id,
    recv_frame,
    send_frame,
    trigger_of,
    watch_peer,
)
from .recovery import CompletedCheckpoint

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0  # for the whole hello, however slowly its bytes come
MAX_HELLOS = 64  # connections not yet past their hello; more are closed at once


def _names(operators: Collection[str] | None) -> set[str] | None:
    if operators is None:
        return None
    return {operators} if isinstance(operators, str) else set(operators)


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


@dataclass
class _Pending:
    """One trigger in flight: the connections it went to, and their answers (the snapshots'
    JSON texts, or the error a participant declined with)."""

    conns: dict[str, _Connection]
    answers: dict[str, list[Any] | str] = field(default_factory=dict)


class CheckpointHub:
    """Triggers checkpoints of ``coordinator``'s job at participant processes and completes
    them from their answers. Listens on ``host`` (``port`` 0: any free port); on a cluster of
    several machines, give the host's address the participants reach (e.g.
    ``ray.util.get_node_ip_address()``). ``operators``: the job's operators, each of which
    every checkpoint must hold (default: those of the latest complete checkpoint)."""

    def __init__(self, coordinator: Any, host: str = "127.0.0.1", port: int = 0,
                 operators: Collection[str] | None = None) -> None:
        self.coordinator = coordinator
        self.operators = _names(operators)
        self._token = secrets.token_hex(16)
        self._server = socket.create_server((host, port))
        self.address = HubAddress(host, self._server.getsockname()[1], self._token)
        self._cond = threading.Condition()
        self._conns: dict[str, _Connection] = {}
        self._pending: dict[tuple[int, int], _Pending] = {}  # (id, attempt) -> in flight
        self._attempts = 0
        self._hellos = threading.BoundedSemaphore(MAX_HELLOS)
        # the answers' snapshots, each text decoded once while it repeats (state/json_memo.py)
        self._decoded = DecodeMemo()
        self._closed = False
        # the latest completed checkpoints' durations, oldest first
        self.history: collections.deque[HubCheckpointTimes] = collections.deque(maxlen=1000)
        threading.Thread(target=self._accept, name="dstl-hub-accept", daemon=True).start()

    # ------------------------------------------------------------------ connections

    def _accept(self) -> None:
        while not self._closed:
            sock = None
            try:
                sock, _ = self._server.accept()
                if not self._hellos.acquire(blocking=False):
                    sock.close()  # too many half-open hellos: this one tries again later
                    continue
                threading.Thread(target=self._serve, args=(sock,), name="dstl-hub-conn",
                                 daemon=True).start()
            except Exception as e:  # noqa: BLE001 - out of descriptors, say: try again
                if sock is not None:
                    sock.close()
                if not self._closed:
                    log.warning("checkpoint hub: accepting a connection failed: %s", e)
                    time.sleep(0.1)

    def _hello(self, sock: socket.socket) -> _Connection | None:
        hello = recv_frame(sock, MAX_HELLO, time.monotonic() + HELLO_TIMEOUT_S)
        name, token = hello.get("name"), hello.get("token")
        if hello.get("hello") != PROTOCOL:
            send_frame(sock, {"error": f"this hub speaks {PROTOCOL}, not {hello.get('hello')!r}"})
            return None
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(),
                                                                 self._token.encode()):
            send_frame(sock, {"error": "wrong token for this checkpoint hub"})
            return None
        if not isinstance(name, str) or not name:
            send_frame(sock, {"error": f"a participant needs a name, got {name!r}"})
            return None
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        watch_peer(sock)  # a host gone without a word ends its connection
        return _Connection(name, sock)  # (its "ok" goes once it is registered)

    def _serve(self, sock: socket.socket) -> None:
        conn = None
        try:
            try:
                conn = self._hello(sock)
            finally:
                self._hellos.release()
            if conn is None:
                return
            with self._cond:
                if self._closed:
                    return
                # told ok as it is registered (the one its name's checkpoints trigger from
                # now on), before any trigger (they go out after taking this lock); an ok
                # that cannot be sent leaves the old connection in place
                conn.send({"ok": True})
                old, self._conns[conn.name] = self._conns.get(conn.name), conn
                self._cond.notify_all()
            if old is not None:  # restarted: the old process's answers no longer count
                old.close()
            while True:
                self._answer(conn, recv_frame(sock))
        except (HubError, OSError) as e:
            if conn is not None and not self._closed:
                log.info("checkpoint hub: participant %r disconnected: %s", conn.name, e)
        except Exception as e:  # noqa: BLE001 - a peer's bytes never end the hub
            log.warning("checkpoint hub: connection of %r dropped: %s: %s",
                        conn and conn.name, type(e).__name__, e)
        finally:
            sock.close()
            if conn is not None:
                with self._cond:
                    if self._conns.get(conn.name) is conn:
                        del self._conns[conn.name]
                    self._cond.notify_all()

    def _answer(self, conn: _Connection, message: dict[str, Any]) -> None:
        key = trigger_of(message)
        got: list[Any] | str
        if "error" in message:
            got = str(message["error"])
        else:
            snaps = message.get("snapshots")
            if not isinstance(snaps, list):
                raise HubError(f"{conn.name!r} answered checkpoint {key[0]} without snapshots")
            got = snaps
        with self._cond:
            p = self._pending.get(key)
            # only the connection this trigger went to answers it, once
            if p is not None and p.conns.get(conn.name) is conn:
                p.answers.setdefault(conn.name, got)
                self._cond.notify_all()

    def connected(self) -> list[str]:
        """The names of the participants connected now."""
        with self._cond:
            return sorted(self._conns)

    def wait_for(self, names: Collection[str], timeout_s: float = 60.0) -> None:
        """Until every participant of ``names`` is connected (:class:`HubError` after
        ``timeout_s``, or when the hub is closed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or set(names) <= self._conns.keys(),
                                timeout_s)
            if self._closed:
                raise HubError("the checkpoint hub is closed")
            if not set(names) <= self._conns.keys():
                raise HubError(f"participants not connected after {timeout_s} s: "
                               f"{sorted(set(names) - self._conns.keys())}")

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self, checkpoint_id: int, participants: Collection[str],
                   timeout_s: float = 60.0, operators: Collection[str] | None = None
                   ) -> CompletedCheckpoint:
        """Checkpoint ``checkpoint_id``: triggered at every one of ``participants``,
        completed (``_metadata`` durable) from their snapshots; raises
        :class:`CheckpointDeclinedError` naming the participant when one fails it.
        ``operators``: the job's operators, each of which must be in it (default: the hub's
        ``operators``, else those of the latest complete checkpoint; a job that drops an
        operator names the ones it keeps)."""
        n, names = check_checkpoint_id(checkpoint_id), sorted(set(participants))
        if not names:
            raise ConfigError("a checkpoint through the hub needs at least one participant")
        latest = self.coordinator.latest_checkpoint()
        if latest is not None and n <= latest.checkpoint_id:
            raise CheckpointDeclinedError(f"checkpoint {n}: checkpoint {latest.checkpoint_id} "
                                          f"is complete already (ids only rise)")
        expected = _names(operators) if operators is not None else self.operators
        if expected is None:
            expected = {s.operator_id for s in latest.metadata.snapshots} if latest else set()
        t0 = time.monotonic()
        with self._cond:
            if self._closed:
                raise HubError("the checkpoint hub is closed")
            missing = [p for p in names if p not in self._conns]
            if missing:
                raise CheckpointDeclinedError(f"checkpoint {n}: participants not connected: "
                                              f"{missing}")
            if any(k[0] == n for k in self._pending):
                raise CheckpointDeclinedError(f"checkpoint {n} is already being taken")
            self._attempts += 1
            key = (n, self._attempts)
            pending = self._pending[key] = _Pending({p: self._conns[p] for p in names})
        begun = committing = False
        try:
            self.coordinator.incarnation  # noqa: B018 - the job's lease, before any trigger
            for p, c in pending.conns.items():
                try:
                    c.send({"id": n, "attempt": key[1]})
                except OSError as e:
                    raise CheckpointDeclinedError(f"checkpoint {n}: the trigger did not reach "
                                                  f"{p!r}: {e}") from e
            # chk-n made while the snapshots are taken; begun after the triggers are out, as
            # its thread, woken in the middle of them, spread them (4 participants on 2 cores:
            # first to last send 1.0 ms p50 against 0.4 this way)
            self.coordinator.begin_checkpoint(n)
            begun = True
            self._await(n, pending, t0 + timeout_s, timeout_s)
            t1 = time.monotonic()
            snaps = read_answers(n, pending.answers, self.coordinator.base_path,  # type: ignore[arg-type]
                                 self._decoded)
            check_operators(n, snaps, expected)
            check_coverage(snaps, self.coordinator.max_parallelism)
            self._still_connected(n, pending)
            committing = True  # from here on the coordinator cleans up what it declines
            cc = self.coordinator.complete_checkpoint(n, snaps)
        except BaseException:
            if begun and not committing:  # its chk-n goes (if empty), as a declined one's
                try:
                    self.coordinator.locations.declined(n)
                except Exception as e:  # noqa: BLE001 - the decline is the news
                    log.warning("checkpoint %d: its location not removed: %s", n, e)
            raise
        finally:
            with self._cond:
                self._pending.pop(key, None)
        self.history.append(HubCheckpointTimes(n, t1 - t0, time.monotonic() - t0))
        return cc

    def _still_connected(self, n: int, pending: _Pending) -> None:
        """Each participant still holds the connection it answered on (one that went away
        since, or was replaced by a restarted process, fails the checkpoint)."""
        with self._cond:
            gone = [p for p, c in pending.conns.items() if self._conns.get(p) is not c]
            if gone or self._closed:
                raise CheckpointDeclinedError(
                    f"checkpoint {n}: " + ("the checkpoint hub was closed" if self._closed
                                           else f"participants disconnected or restarted: "
                                                f"{gone}"))

    def _await(self, n: int, pending: _Pending, deadline: float, timeout_s: float) -> None:
        with self._cond:
            while True:
                for p, got in sorted(pending.answers.items()):
                    if isinstance(got, str):
                        raise CheckpointDeclinedError(f"checkpoint {n}: participant {p!r} "
                                                      f"declined it: {got}")
                self._still_connected(n, pending)  # (the condition's lock is re-entrant)
                if len(pending.answers) == len(pending.conns):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CheckpointDeclinedError(
                        f"checkpoint {n}: no answer from "
                        f"{sorted(pending.conns.keys() - pending.answers.keys())} within "
                        f"{timeout_s} s")
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
