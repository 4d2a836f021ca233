"""The authentication mode of a process joining a Ray cluster (dstl_ray.transport.auth): the probe is
bounded, an undecided probe keeps Ray's own behaviour, and a mode this module chose for one
cluster is asked again for the next."""

from __future__ import annotations

import os
import time

import pytest

from dstl_ray.transport import auth


def test_the_probe_of_an_unreachable_cluster_is_bounded():
    t0 = time.monotonic()
    assert auth.cluster_requires_token("127.0.0.1:9", timeout_s=1.0) is None
    assert time.monotonic() - t0 < 5.0


@pytest.fixture
def no_mode(monkeypatch):
    import ray
    from ray._private.authentication import authentication_token_setup as setup

    monkeypatch.delenv(auth.AUTH_MODE_ENV, raising=False)
    monkeypatch.setattr(auth, "_set_by_us", None)
    monkeypatch.setattr(auth, "_token_at_hand", lambda: True)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    enabled: list[bool] = []
    monkeypatch.setattr(setup, "maybe_enable_token_auth_if_token_available",
                        lambda **_: enabled.append(True))
    yield enabled
    os.environ.pop(auth.AUTH_MODE_ENV, None)


def test_a_mode_we_chose_is_asked_again_for_the_next_cluster(no_mode, monkeypatch):
    monkeypatch.setattr(auth, "cluster_requires_token", lambda *_a, **_k: False)
    auth.use_cluster_auth_mode("127.0.0.1:6379")
    assert os.environ[auth.AUTH_MODE_ENV] == "disabled" and not no_mode
    monkeypatch.setattr(auth, "cluster_requires_token", lambda *_a, **_k: True)
    auth.use_cluster_auth_mode("127.0.0.1:6380")  # after ray.shutdown(): another cluster
    assert auth.AUTH_MODE_ENV not in os.environ and no_mode == [True]


def test_an_undecided_probe_turns_the_token_on_as_ray_would(no_mode, monkeypatch):
    monkeypatch.setattr(auth, "cluster_requires_token", lambda *_a, **_k: None)
    auth.use_cluster_auth_mode("127.0.0.1:6379")
    assert no_mode == [True] and auth.AUTH_MODE_ENV not in os.environ


def test_the_users_choice_is_kept(no_mode, monkeypatch):
    monkeypatch.setenv(auth.AUTH_MODE_ENV, "disabled")  # set by the user, not by us
    monkeypatch.setattr(auth, "cluster_requires_token", lambda *_a, **_k: True)
    auth.use_cluster_auth_mode("127.0.0.1:6379")
    assert os.environ[auth.AUTH_MODE_ENV] == "disabled" and not no_mode
