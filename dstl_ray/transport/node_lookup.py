"""Which node actor a writer process talks to, and that this actor knows the process's writers
(docs/architecture.md "Write path" and "Failures"; FLIP-158 "Future directions": each writer
sends to the node actor of its own Ray node).

A node actor is a named Ray actor that Ray restarts under the same name when it dies, with
none of its old state: its registered writers are gone, and for a while its calls fail with
``ActorUnavailableError``. So the handle this process holds is kept only until something
says the node is gone (a failed call, a cut lane: :func:`.ray_errors.node_gone`); the lookup
is then *stale*, and the next call first finds the node again by name (the pinned one, else
the nearest: ``dstl_ray.transport.discovery``) and registers every writer of this process with it
before anything else is sent. A registration that fails once finds the node again and tries
once more; a node that refuses the job (another namespace, a fenced driver) is not asked
again.

The Ray calls are injected (``resolve``, ``get``), so the logic is tested without a cluster.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import FencedError, NamespaceError, NodeUnavailableError

log = logging.getLogger(__name__)

# (actor name, handle, how it was chosen) of the node actor to talk to
Resolve = Callable[[], "tuple[str, Any, str]"]
# ``ray.get(ref, timeout=...)``
Get = Callable[[Any, float], Any]


def ray_get(ref: Any, timeout: float) -> Any:
    """``ray.get`` (looked up at call time: tests replace it)."""
    import ray

    return ray.get(ref, timeout=timeout)


def get_while_restarting(call: Callable[[], Any], timeout: float = 60.0, *,
                         get: Get = ray_get, sleep: Callable[[float], None] = time.sleep) -> Any:
    """``get(call())``, calling again while the actor is restarting (Ray's
    ``ActorUnavailableError``: a node actor killed a moment ago comes back), until
    ``timeout``; then the last error."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        try:
            return get(call(), max(0.1, deadline - time.monotonic()))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise
            sleep(0.2)


def ray_resolver(namespace: str, pinned: str | None) -> Resolve:
    """Ray's lookup: node actor ``pinned`` by name, else the nearest one
    (``dstl_ray.transport.discovery.find_nearest_node``)."""

    def resolve() -> tuple[str, Any, str]:
        import ray

        if pinned:
            try:
                return pinned, ray.get_actor(pinned, namespace=namespace), "pinned"
            except ValueError:
                raise NodeUnavailableError(f"no node actor {pinned!r}") from None
        from .discovery import find_nearest_node

        return find_nearest_node(namespace)

    return resolve


class NodeLookup:
    """The node actor of one transport: its handle, found again after it was marked stale,
    with the writers registered so far registered again. ``caller`` (the process's
    :class:`dstl_ray.transport.sender.Caller`) is passed to the node as is. ``found(handle)``
    runs after the node was found again, holding no lock (the transport opens its lane
    there: that asks the node)."""

    def __init__(self, job_id: str, caller: object, resolve: Resolve, *,
                 get: Get = ray_get, found: Callable[[Any], None] | None = None) -> None:
        self.job_id = job_id
        self._caller = caller
        self._resolve = resolve
        self._get = get
        self._found = found
        self._lock = threading.Lock()
        self._stale = True
        self._handle: Any = None
        self._logs: set[str] = set()
        self.node_name = ""
        self.chosen_by = ""
        self.merges = False  # the node said the tree merges changelog files (marks awaited)

    @property
    def stale(self) -> bool:
        """Whether the node is to be found again before the next call."""
        return self._stale

    def connect(self) -> Any:
        """Find the node now (the transport's first lookup); its handle."""
        with self._lock:
            self._connect()
            self._stale = False
            return self._handle

    def _connect(self) -> None:
        """(caller holds ``_lock``) Stale until the caller has told the node what it must know."""
        self.node_name, self._handle, self.chosen_by = self._resolve()

    def mark_stale(self) -> None:
        """The node is gone (or its lane leads elsewhere): find it again before the next call."""
        with self._lock:
            self._stale = True

    def current(self) -> Any:
        """The node's handle; after it was marked stale, found again and told this process's
        writers first."""
        with self._lock:
            if not self._stale:
                return self._handle
            self._connect()
            # all at once, one deadline: a stalled node costs one wait, not one per writer
            # (a failure leaves it stale: asked again next time)
            refs = [self._handle.register_writer.remote(lg, self.job_id, self._caller)
                    for lg in sorted(self._logs)]
            if refs:
                self._get(refs, 60.0)
            self._stale = False
            handle = self._handle
        if self._found is not None:
            self._found(handle)
        return handle

    def register(self, log_id: str) -> None:
        """Register a new writer with the node, waiting while it restarts (a client made
        right after its node was killed): once, and once more after finding the node again;
        then :class:`NodeUnavailableError`. A refusal (:class:`NamespaceError`,
        :class:`FencedError`) raises at once: no retry helps."""
        for attempt in (1, 2):
            try:  # a new writer: it made no handle yet (named -1); a restart is waited for
                merged = get_while_restarting(lambda: self.current().register_writer.remote(
                    log_id, self.job_id, self._caller, -1), get=self._get)
                if merged:  # the tree merges changelog files: the node keeps our records
                    self.merges = True
                break
            except (NamespaceError, FencedError):
                raise
            except Exception as e:  # noqa: BLE001 - the node died: find it (or another) again
                self.mark_stale()
                if attempt == 2:
                    raise NodeUnavailableError(
                        f"cannot register writer {log_id} with node actor {self.node_name}: "
                        f"{type(e).__name__}: {e}") from e
        with self._lock:
            self._logs.add(log_id)

    def registered(self, log_id: str) -> bool:
        """Whether ``log_id`` is registered (not unregistered since)."""
        with self._lock:
            return log_id in self._logs

    def unregister(self, log_id: str) -> None:
        """Forget ``log_id`` here and tell the node (best effort: the writer is closing)."""
        with self._lock:
            self._logs.discard(log_id)
        try:
            self.current().unregister_writer.remote(log_id, self._caller)
        except Exception as e:  # noqa: BLE001 - best effort on close
            log.debug("unregister of %s failed: %s", log_id, e)
