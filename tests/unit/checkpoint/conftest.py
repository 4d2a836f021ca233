"""Fixtures of the job lease's tests (helpers: :mod:`.lease_util`)."""

from __future__ import annotations

import contextlib

import pytest

from dstl_ray.checkpoint import lease as lease_mod


@pytest.fixture
def separate_processes(monkeypatch):
    """The leases of this test stand for drivers in separate processes: none sees that
    another one of this process is taking the job (``lease_record.taking``)."""
    monkeypatch.setattr(lease_mod, "taking", lambda url, holder, where: contextlib.nullcontext(),
                        raising=False)


@pytest.fixture
def remote(monkeypatch, separate_processes):
    """... and on other machines: no pid says anything about them, only watching their
    records and claims does."""
    monkeypatch.setattr(lease_mod, "MACHINE", "another-host/boot/pid-ns")
