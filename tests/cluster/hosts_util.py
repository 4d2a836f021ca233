"""What the multi-host tests share besides the ``hosts`` fixture (conftest.py)."""

from __future__ import annotations

import subprocess

import pytest

from dstl_ray.local.hosts import PREFIX, unavailable

needs_hosts = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


def leftovers(tag: str) -> list[str]:
    """The namespaces, links and processes of host cluster ``tag`` still there."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    procs = subprocess.run(["pgrep", "-f", f"{PREFIX}{tag}"], capture_output=True,
                           text=True).stdout
    return ([line for line in ns.splitlines() if f"{PREFIX}-{tag}" in line]
            + [line for line in links.splitlines() if f"{PREFIX}b{tag}" in line
               or f"{PREFIX}v{tag}" in line] + procs.split())
