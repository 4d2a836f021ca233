"""Clock skew is a fault injected with real clocks: driver processes racing for one job, some
under libfaketime with their wall clock a minute or ten off (docs/architecture.md "Many jobs,
one tree"). A live, renewing driver is never taken over whatever the other's clock says; a
driver that stops renewing (SIGSTOP: alive and silent, as in a long GC pause) is taken over
after the taker watched its lease unchanged for a full TTL, and when it wakes up it is fenced:
it writes no ``_metadata`` and deletes nothing, so every retained checkpoint still reads back.

The drivers run ``faketime --exclude-monotonic -f OFFSET python lease_driver.py``: only the
wall clock is skewed. The lease never compares monotonic clocks of two processes, and
libfaketime 0.9.10 hangs Python's timed lock waits when it fakes the monotonic clock too (the
driver works around its other bug there: ``lease_driver._patch_sleep``).
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from dstl_ray.testing.lease_process import DriverProcess, assert_reads_back, until

FAKETIME = shutil.which("faketime")
pytestmark = pytest.mark.skipif(
    FAKETIME is None, reason="libfaketime's `faketime` command is missing (Debian package "
    "`faketime`; .ci/run installs it): clock skew cannot be injected")

TTL_S = 3.0
OFFSETS = {"+60s": 60, "-60s": -60, "+10m": 600, "-10m": -600}
RACERS = ["+60s", "-60s", "+10m"]  # race the first driver while it renews
TAKER = "+10m"  # takes over once the first stops renewing
LATE = "-10m"  # races the taker


def test_skewed_drivers_never_take_a_live_job_and_a_silent_one_is_fenced(tmp_path):
    base, job = f"file://{tmp_path}/dfs", "skewed"
    # every process starts at once (starting Python is the slow part), then they race
    roles = {"first": None, **{f"racer {o}": o for o in RACERS}, "taker": TAKER,
             "late": LATE}
    procs = {r: DriverProcess(base, job, TTL_S, tmp_path, r.replace(" ", "-"),
                              [str(FAKETIME), "--exclude-monotonic", "-f", o] if o else [])
             for r, o in roles.items()}
    try:
        for r, p in procs.items():  # on a skewed clock: the python under faketime
            p.ready(OFFSETS[roles[r]] if roles[r] else 0)
        first = procs["first"]
        started = first.ask("start")
        assert started["ok"], started
        first.ask("run")
        # drivers whose wall clock is a minute or ten ahead or behind, all at once: each
        # is refused while the first renews, naming it
        racers = [procs[f"racer {o}"] for o in RACERS]
        for p in racers:
            p.send("start")
        for p in racers:
            got = p.answer()
            assert not got["ok"] and started["holder"] in got["error"], (
                p.name, got, first.ask("status"), first.stderr.read_text()[-2000:])
            assert p.ask("stop")["ok"]
        st = first.ask("status")
        assert st["done"] > 0 and st["declined"] == 0 and not st["fenced"], st
        # the first stops renewing but stays alive (SIGSTOP); a driver 10 minutes ahead
        # takes over once it has watched the lease unchanged for a full TTL
        os.kill(first.proc.pid, signal.SIGSTOP)
        taker = procs["taker"]
        took = taker.ask("start")
        assert took["ok"], took
        assert took["waited_s"] >= TTL_S, took
        taker.ask("run")
        until(lambda: taker.ask("status")["done"] >= 3)
        # the first wakes up: fenced, it declines every checkpoint and deletes nothing
        os.kill(first.proc.pid, signal.SIGCONT)
        until(lambda: first.ask("status")["declined"] >= 2)
        st = first.ask("status")
        assert st["fenced"], st
        # one behind by ten minutes races the new holder: refused as well
        got = procs["late"].ask("start")
        assert not got["ok"] and took["holder"] in got["error"], got
        procs["late"].ask("stop")
        until(lambda: taker.ask("status")["done"] >= 8)
        assert first.ask("stop")["ok"]  # the fenced driver's shutdown deletes nothing either
        final = taker.ask("stop")["checkpointed"]
    finally:
        for p in procs.values():
            p.close()
    # every retained checkpoint names only files that exist, and the latest holds what the
    # taker checkpointed last
    assert_reads_back(base, job, final)
