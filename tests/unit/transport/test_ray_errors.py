"""What a Ray error means to a writer (dstl_ray.transport.ray_errors): which errors say the
node actor is gone, and Ray's owner-died error on this live process explained."""

from __future__ import annotations

import pytest
import ray

from dstl_ray.errors import NodeUnavailableError, PersistError
from dstl_ray.transport.auth import AUTH_MODE_ENV
from dstl_ray.transport.ray_errors import explained, node_gone


@pytest.mark.parametrize("e, gone", [
    (ray.exceptions.ActorDiedError(), True),
    (ray.exceptions.ActorUnavailableError("restarting", None), True),
    (NodeUnavailableError("lane broke"), True),
    (ray.exceptions.GetTimeoutError("slow"), False),
    (PersistError("deadline"), False),
    (ValueError("bad"), False),
])
def test_which_errors_say_the_node_is_gone(e, gone):
    assert node_gone(e) is gone


def test_owner_died_names_the_node_and_the_authentication_setting(monkeypatch):
    monkeypatch.setenv(AUTH_MODE_ENV, "token")
    e = ray.exceptions.OwnerDiedError("ab" * 14, None, "")
    got = explained(e, "dstl-node-3")
    assert isinstance(got, PersistError)
    assert "dstl-node-3" in str(got) and f"{AUTH_MODE_ENV}='token'" in str(got)
    assert "OwnerDiedError" in str(got)


def test_other_errors_pass_through():
    e = ray.exceptions.ActorDiedError()
    assert explained(e, "n") is e
