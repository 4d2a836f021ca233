"""A process that joins a running Ray cluster must use the cluster's authentication mode.

Ray 2.60 runs a cluster with token authentication when it was started so (``RAY_AUTH_MODE=token``,
or ``ray start`` / ``ray.init()`` finding a token), and without it otherwise (for instance every
cluster of ``ray.cluster_utils.Cluster``). Every driver and worker runs a gRPC server of its own,
and that server demands the token from its callers as soon as Ray's token loader has read a
token in that process (``maybe_enable_token_auth_if_token_available`` reads it and turns token
mode on). A process that did so on a cluster without tokens can call the cluster, but the
cluster cannot call it back, and Ray's ownership-based object directory takes the refused call
for the owner's death: when a node actor on another Ray node fetches the argument of a persist
request above Ray's inline limit (100 KiB, so it lives in the object store and is owned by the
caller), that node's raylet logs ``Owner of object died: Unauthenticated: ... Authentication
token is missing or incorrect`` and the call fails with ``OwnerDiedError`` although the caller
is alive. Smaller requests travel inside the call and never need the caller again.

So the mode is never guessed from a token being at hand (``~/.ray/auth_token`` exists on any
machine where ``ray.init()`` once started a local cluster): it is asked of the cluster. A process
that chose a mode (``RAY_AUTH_MODE``) keeps it; otherwise, when a token is at hand, one call to
the cluster's GCS without a token tells whether the cluster requires one, and the process uses
exactly that mode (Ray's token loader is not touched unless the cluster requires the token).
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

AUTH_MODE_ENV = "RAY_AUTH_MODE"
PROBE_TIMEOUT_S = 30.0
_set_by_us: str | None = None  # the mode this module wrote into the environment


def _token_at_hand() -> bool:
    """A token Ray would find (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, else
    ``~/.ray/auth_token``), looked up without Ray's token loader: once that loader has read a
    token, this process's gRPC server demands it from every caller whatever the mode says."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return os.path.isfile(path)


def cluster_requires_token(gcs_address: str, timeout_s: float = PROBE_TIMEOUT_S
                           ) -> bool | None:
    """True if the cluster at ``gcs_address`` refuses a call without a token, False if it
    answers one, None if it did not answer at all (unreachable, too slow). Call it before
    this process turned token mode on: the probe must go out without a token. Bounded by
    ``timeout_s`` (the GCS client's own connection retries are not: it runs in a thread)."""
    answer: list[bool | None] = []

    def probe() -> None:
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError

        try:
            GcsClient(address=gcs_address).internal_kv_get(b"dstl-auth-probe", None,
                                                             timeout=timeout_s)
            answer.append(False)
        except AuthenticationError:
            answer.append(True)
        except Exception as e:  # noqa: BLE001 - no answer: the mode stays undecided
            log.warning("cannot tell the authentication mode of the Ray cluster at %s: "
                        "%s: %s", gcs_address, type(e).__name__, e)

    t = threading.Thread(target=probe, daemon=True, name="dstl-auth-probe")
    t.start()
    t.join(timeout_s)
    if not answer:
        if t.is_alive():
            log.warning("the Ray cluster at %s did not answer within %gs: its "
                        "authentication mode is unknown", gcs_address, timeout_s)
        return None
    return answer[0]


def use_cluster_auth_mode(address: str | None) -> None:
    """Before ``ray.init(address=address)``: make this process use the authentication mode of
    the cluster at ``address`` (a GCS address, ``"auto"`` or None for the cluster running on
    this machine; a Ray Client ``ray://`` address is left to Ray). No-op when this process
    chose a mode, when no token is at hand (the mode can only be "disabled"), when no cluster
    is running (``ray.init`` starts one in its own default mode), or once Ray is connected."""
    global _set_by_us
    import ray

    if ray.is_initialized():
        return
    if AUTH_MODE_ENV in os.environ:
        if os.environ[AUTH_MODE_ENV] != _set_by_us:
            return  # the user's (or a parent process's) choice
        del os.environ[AUTH_MODE_ENV]  # ours, for an earlier cluster: ask this one again
        _set_by_us = None
    if address is not None and address.startswith("ray://"):
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:  # a Ray without token authentication: nothing to match
        return
    if not _token_at_hand():
        return
    try:
        gcs = canonicalize_bootstrap_address(address)
    except Exception:  # noqa: BLE001 - no such cluster: ray.init reports it
        return
    if gcs is None:
        return
    required = cluster_requires_token(gcs)
    if required is None:
        # undecided (a slow or unreachable GCS): what Ray itself does with a token at hand,
        # so a cluster that requires it can still be joined
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        log.info("authentication mode of %s unknown: token authentication on, a token is "
                 "at hand", gcs)
    elif required:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        log.info("the Ray cluster at %s requires its token: token authentication on", gcs)
    elif required is False:
        # written down, so that nothing later (ray.init("auto") itself) turns it on because
        # a token file is at hand; child processes inherit the cluster's mode
        os.environ[AUTH_MODE_ENV] = _set_by_us = "disabled"
        log.info("the Ray cluster at %s runs without token authentication: so does this "
                 "process, although a token is at hand", gcs)
