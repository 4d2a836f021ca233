"""Unit tests run first in the session, before any Ray cluster is up (tests/conftest.py):
one that started a local Ray (an API call Ray wraps in its auto-init, such as
``ray.get_runtime_context()``) would leave the session connected to it, and every later test
that needs the shared cluster would fail to connect. So each unit test must leave Ray as it
found it."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def _no_ray_started():
    ray = sys.modules.get("ray")
    before = ray is not None and ray.is_initialized()
    yield
    ray = sys.modules.get("ray")
    if not before and ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail("this unit test started Ray (a call Ray wraps in its auto-init?): unit "
                    "tests run before the session's cluster and must not connect to any")
