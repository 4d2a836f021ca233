"""What a Ray error on a writer's call to its node actor means, in our terms
(docs/architecture.md "Write path" 2 and "Failures").

Two questions are asked of every error a persist call, a mark or a registration fails with:

* Is the node actor gone? Ray says so with ``RayActorError`` (the actor died; Ray restarts a
  node actor under the same name, with none of its old state) or ``ActorUnavailableError``
  (it is restarting, or not reachable now); a broken lane says so with
  :class:`~dstl_ray.errors.NodeUnavailableError`. Then the transport finds the node again by
  name before its next call (:mod:`.node_lookup`) instead of calling a handle that leads
  nowhere.
* What does the error tell the user? Ray's ``OwnerDiedError`` on a persist request says that
  the caller, this very process, is dead, while it is alive and reading the error: the node's
  Ray node could not call this process back to fetch a large request, which happens when
  this process joined Ray in another authentication mode than the cluster's
  (:mod:`.auth`). The error is turned into a :class:`~dstl_ray.errors.PersistError` that says
  so and names the setting to check.

Pure functions: the Ray exception classes are the only thing taken from Ray.
"""

from __future__ import annotations

import os

from ..errors import NodeUnavailableError, PersistError
from .auth import AUTH_MODE_ENV


def node_gone(e: BaseException) -> bool:
    """Whether ``e`` says the node actor is gone (dead, restarting, its lane broken), so the
    node is to be found again by name before the next call."""
    import ray

    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                          NodeUnavailableError))


def explained(e: BaseException, node: str) -> BaseException:
    """``e``, or what it means when Ray says this (alive) process died: a
    :class:`PersistError` naming node actor ``node`` and the authentication setting."""
    import ray

    if isinstance(e, ray.exceptions.OwnerDiedError):
        # the owner of the request is this very process, alive: the node's Ray node could
        # not call it back to fetch the request (dstl_ray.transport.auth)
        return PersistError(
            f"node actor {node} could not fetch this process's persist request: Ray took "
            f"this process for dead because the cluster cannot call it back (is "
            f"{AUTH_MODE_ENV}={os.environ.get(AUTH_MODE_ENV, '<unset>')!r} the cluster's "
            f"authentication mode?): {type(e).__name__}: {e}")
    return e
