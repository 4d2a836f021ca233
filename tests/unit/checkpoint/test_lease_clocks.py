"""The job lease trusts no clock but each process's own monotonic one (docs/architecture.md
"Many jobs, one tree"): an observer takes a lease over only after it has seen the record
unchanged for a full TTL on its clock, a holder judges its validity on its own clock from the
start of its last renewal and fences itself for good when a renewal comes too late, epochs
are counters in storage, and a fenced driver's queued deletes never run.

Processes' monotonic clocks are injected (:class:`~.lease_util.World`: one real time, each
process's clock an arbitrary offset from it), storage stalls are writes that take the world's
time (:class:`~.lease_util.SlowWrites`) or let another driver act first
(:class:`~.lease_util.Hooked`); ``test_a_restart_from_a_host_whose_clock_is_behind_...`` skews
a real process's wall clock with libfaketime."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import dstl_ray as d
from dstl_ray.checkpoint import lease as lease_mod
from dstl_ray.checkpoint.lease import JobLease
from dstl_ray.checkpoint.lease_record import known_dead
from dstl_ray.errors import JobLeaseError, StaleIncarnationError
from dstl_ray.node.dead_writers import DeadWriters
from dstl_ray.node.jobs import Jobs
from dstl_ray.node.namespaces import JobNamespaces
from dstl_ray.node.peers import Place
from dstl_ray.node.stats import NodeCounters
from dstl_ray.process_identity import start_time as process_start
from dstl_ray.state.registry import SharedStateRegistry
from dstl_ray.storage.deleter import Deleter
from dstl_ray.storage.registry import get_storage
from dstl_ray.transport.sender import Caller, Incarnation

from ..ckpt_util import MAXP, client
from .lease_util import Hooked, SlowWrites, World

ROOT = Path(__file__).resolve().parents[3]
TTL = 10.0


def _lease(url: str, world: World, offset: float = 0.0, **kw) -> JobLease:
    return JobLease(url, ttl_s=TTL, clock=world.clock(offset), sleep=world.sleep, **kw)


def test_a_renewing_holder_is_never_taken_over_whatever_the_clocks_say(tmp_path, remote):
    for i, offset in enumerate([60.0, -60.0, 600.0, -600.0, 1e9]):
        world, url = World(), f"file://{tmp_path}/dfs/job{i}"
        a = _lease(url, world)
        a.acquire(renew=False)
        for k in range(1, 20):  # a renews every TTL/5, as its background renewer does
            world.at(k * TTL / 5, a.renew)
        b = _lease(url, world, offset)
        with pytest.raises(JobLeaseError, match=f"holder {a.holder}.*renewed while"):
            b.acquire(renew=False)
        assert world.t <= TTL / 5 + TTL / 10  # refused at the first renewal it saw
        a.check()
        assert a.held and not b.held


def test_a_silent_holder_is_taken_over_only_after_a_full_ttl_of_watching(tmp_path, remote):
    world, url = World(), f"file://{tmp_path}/dfs/job"
    a = _lease(url, world)
    inc_a = a.acquire(renew=False)
    world.at(3.0, a.renew)  # renews once while b watches, then stops (paused)
    b = _lease(url, world, -1e6)
    with pytest.raises(JobLeaseError, match=a.holder):
        b.acquire(renew=False)
    seen = world.t  # b saw the renewal at 3 s: that record stays unchanged from now on
    c = _lease(url, world, 1e6)
    inc_c = c.acquire(renew=False)
    assert world.t - seen >= TTL  # a full TTL watched on c's clock
    assert inc_c.epoch == inc_a.epoch + 1 and c.held
    # a could not renew within its validity: it was past it long before c took over
    assert a.fenced is None and not a.holds_validly()
    with pytest.raises(JobLeaseError, match="could not renew"):
        a.check()
    assert not a.renew() and not a.held
    assert json.loads(get_storage(url).read_file(c.url))["holder"] == c.holder


def test_check_renews_past_a_quarter_ttl_and_fences_for_good_past_its_deadline(tmp_path):
    world, url = World(), f"file://{tmp_path}/dfs/job"
    a = JobLease(url, ttl_s=TTL, clock=world.clock())
    a.acquire(renew=False)
    st = get_storage(url)

    def renewal() -> object:
        return json.loads(st.read_file(a.url)).get("renewal")

    first = renewal()
    world.t = 2.0
    a.check()
    assert renewal() == first  # fresh enough: no write
    world.t = 3.0
    a.check()  # older than TTL/4: renewed synchronously
    assert renewal() != first
    world.t = 3.0 + 0.6 * TTL  # paused past its validity, but a renewal still lands in time
    assert not a.holds_validly()
    a.check()  # renewed (no observer's final read comes before 3 + TTL): valid again
    assert a.holds_validly()
    world.t += 0.85 * TTL  # e.g. paused past its renewal deadline: it cannot know who holds
    with pytest.raises(JobLeaseError, match="could not renew"):
        a.check()
    last = st.read_file(a.url)
    world.t += 0.1
    with pytest.raises(JobLeaseError):
        a.check()  # for good
    assert not a.renew() and st.read_file(a.url) == last  # never written again


def test_a_renewal_write_slower_than_the_ttl_fences_its_holder(tmp_path, remote):
    world, url = World(), f"file://{tmp_path}/dfs/job"
    slow = SlowWrites(get_storage(url), world)
    a = JobLease(url, ttl_s=TTL, clock=world.clock(), storage=slow)
    a.acquire(renew=False)
    world.t = 3.0
    slow.delay = 1.1 * TTL
    with pytest.raises(JobLeaseError, match="renewal took"):
        a.check()  # the write landed, but too late to count: someone may hold the job
    assert a.fenced and not a.held
    # an observer that saw the slow write's record waits its TTL and takes over
    b = _lease(url, world, 42.0)
    b.acquire(renew=False)
    assert b.held


@pytest.mark.parametrize("ttl,stall", [(None, 10.0), (3.0, 1.0)],
                         ids=["default-ttl-10s-stall", "3s-ttl-1s-stall"])
def test_a_storage_stall_within_the_renewal_deadline_does_not_fence(tmp_path, remote, ttl,
                                                                   stall):
    world, url = World(), f"file://{tmp_path}/dfs/job"
    slow = SlowWrites(get_storage(url), world)
    kw = {} if ttl is None else {"ttl_s": ttl}
    a = JobLease(url, clock=world.clock(), sleep=world.sleep, storage=slow, **kw)
    a.acquire(renew=False)
    world.t = lease_mod.RENEW_AT * a.ttl_s  # when the background renewer renews
    slow.delay = stall  # its write hangs (a storage stall)
    assert a.renew() and a.fenced is None  # it landed before any observer could take over
    slow.delay = 0.0
    a.check()
    assert a.held
    # an observer that watched across the stall saw the record change: refused
    b = _lease(url, world, 7.0)
    world.at(world.t + lease_mod.RENEW_AT * a.ttl_s, a.renew)
    with pytest.raises(JobLeaseError, match=a.holder):
        b.acquire(renew=False)


def test_a_late_renewal_write_of_a_taken_over_holder_does_not_fence_the_new_one(tmp_path,
                                                                               remote):
    world, url = World(), f"file://{tmp_path}/dfs/job"
    st = Hooked(get_storage(url))
    a = JobLease(url, ttl_s=TTL, clock=world.clock(), sleep=world.sleep, storage=st)
    a.acquire(renew=False)
    b = _lease(url, world, 33.0)
    world.t = 2.0
    # a's renewal write hangs; meanwhile b watches the unchanged record for a TTL and takes
    # over; then a's write lands over b's record
    st.hook(a.url, lambda: b.acquire(renew=False))
    assert not a.renew() and a.fenced  # too late to count: a knows it may have lost the job
    assert b.held and json.loads(get_storage(url).read_file(a.url))["holder"] == a.holder
    assert b.renew() and b.fenced is None  # the newer epoch wins: b writes its record again
    b.check()
    assert json.loads(get_storage(url).read_file(a.url))["holder"] == b.holder
    with pytest.raises(JobLeaseError):
        a.check()


@pytest.mark.parametrize("late", ["release", "delete"])
def test_a_late_release_of_a_taken_over_holder_lets_nobody_take_the_job_at_once(
        tmp_path, remote, late):
    world, url = World(), f"file://{tmp_path}/dfs/job"
    st = get_storage(url)
    a = _lease(url, world)
    a.acquire(renew=False)
    released = a._record(released=True)  # what a's release writes: it lands late
    b = _lease(url, world, 5.0)
    b.acquire(renew=False)  # a went silent: b watched it for a TTL and took over
    if late == "release":
        st.write_file(a.url, released)
    else:  # DELETE_ON_CANCELLATION's delete of the record
        st.delete(a.url)
    for k in range(1, 10):
        world.at(world.t + k * TTL / 5, b.renew)
    c = _lease(url, world, -7.0)
    with pytest.raises(JobLeaseError, match=f"holder {b.holder}"):
        c.acquire(renew=False)  # watched b's claim (a's record is of an older epoch)
    b.check()
    assert b.held and not c.held
    assert json.loads(st.read_file(b.url))["holder"] == b.holder


def test_a_holder_of_this_process_past_its_validity_is_watched_not_taken_at_once(tmp_path):
    world, url = World(), f"file://{tmp_path}/dfs/job"
    a = _lease(url, world)
    a.acquire(renew=False)
    world.t = 0.5 * TTL + 0.01  # a is past its validity, not yet fenced: a step that passed
    b = _lease(url, world)  # its check before may still be landing
    b.acquire(renew=False)
    assert world.t >= TTL  # as long as any observer waits: a silent for a full TTL
    with pytest.raises(JobLeaseError):
        a.check()


def test_epochs_never_repeat_when_a_slow_driver_decides_before_others_run(
        tmp_path, separate_processes):
    url = f"file://{tmp_path}/dfs/job"
    st = Hooked(get_storage(url))
    a = JobLease(url, storage=st)
    epochs: list[int] = []

    def others() -> None:  # two runs start and are cancelled (DELETE_ON_CANCELLATION)
        for _ in range(2):
            x = JobLease(url)
            epochs.append(x.acquire(renew=False).epoch)
            x.release(delete=True)

    st.hook("", others)  # a decided its epoch; its first write stalls meanwhile
    with pytest.raises(JobLeaseError, match="taken by another driver"):
        a.acquire(renew=False)  # its epoch was claimed meanwhile: refused, never reused
    assert epochs == [1, 2]
    d_ = JobLease(url)
    assert d_.acquire(renew=False).epoch == 3
    d_.release()


def _previous_version_takes(rec: dict, wall_clock: float) -> bool:
    """The version before counted epochs (``JobLease._alive`` then): a record is dead when
    released or when its wall-clock ``renewed_at`` is more than its TTL behind the reader's
    wall clock (a missing one counts as 0)."""
    if rec.get("released"):
        return True
    return wall_clock - float(rec.get("renewed_at", 0)) > float(rec.get("ttl_s", 0))


def test_a_driver_of_the_previous_version_never_takes_a_live_job(tmp_path):
    url = f"file://{tmp_path}/dfs/job"
    a = JobLease(url)
    a.acquire(renew=False)
    rec = json.loads(get_storage(url).read_file(a.url))
    for skew in (-600.0, 0.0, 600.0, 1e9):  # its host's wall clock, any offset
        assert not _previous_version_takes(rec, time.time() + skew)
    a.release()
    assert _previous_version_takes(json.loads(get_storage(url).read_file(a.url)), time.time())


def test_a_coordinator_whose_lease_renewal_is_slow_writes_no_metadata(tmp_path):
    world, base = World(), f"file://{tmp_path}/dfs"
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP)
    slow = SlowWrites(coord.storage, world)
    coord.lease = JobLease(coord.job_path, ttl_s=TTL, clock=world.clock(), storage=slow)
    bs = coord.restore(client("job", base), "op", 1, materialization_interval=None)
    bs[0].value_state("v").update("k", 1)
    world.t = 3.0
    slow.delay = 1.1 * TTL
    with pytest.raises(d.CheckpointDeclinedError, match="renewal took"):
        coord.trigger_checkpoint().result(timeout=30)
    assert not [u for u in get_storage(base).list_files(base) if u.endswith("_metadata")]
    coord.abandon()


def test_epochs_count_on_across_delete_on_cancellation_and_a_wiped_job_directory(tmp_path):
    base = f"file://{tmp_path}/dfs"

    def run(cancel: bool) -> Incarnation:
        coord = d.CheckpointCoordinator(
            "job", base, max_parallelism=MAXP,
            retention=d.CheckpointRetention.DELETE_ON_CANCELLATION)
        bs = coord.restore(client("job", base), "op", 1, materialization_interval=None)
        bs[0].value_state("v").update("k", 1)
        coord.trigger_checkpoint().result(timeout=30)
        inc = coord.incarnation
        coord.shutdown(cancel=cancel)
        return inc

    first = run(cancel=True)
    assert get_storage(base).list_files(f"{base}/job") == []  # nothing left in the directory
    second = run(cancel=False)
    assert second.epoch == first.epoch + 1
    shutil.rmtree(tmp_path / "dfs" / "job")  # the user deletes the whole job directory
    third = run(cancel=False)
    assert third.epoch == second.epoch + 1


def test_an_unreadable_epoch_counter_is_a_clear_error(tmp_path):
    url = f"file://{tmp_path}/dfs/job"
    a = JobLease(url)
    counter = a.claims.legacy_url  # the previous version's counter: read as a floor
    get_storage(counter).write_file(counter, b"not a number")
    with pytest.raises(JobLeaseError, match=f"epoch counter {counter}"):
        a.acquire(renew=False)


def _jobs() -> Jobs:
    return Jobs(Place("node-0"), NodeCounters(), DeadWriters(),
                JobNamespaces(all_dead=lambda _jobs: False), now=lambda: 0.0,
                on_reset=lambda _job: None, active=set, holds=lambda _job: False)


def _incarnation_elsewhere(base: str, offset: str) -> Incarnation:
    """A driver process whose wall clock is ``offset`` off starts the job."""
    code = ("import os, sys, threading, time\n"
            "time.sleep = lambda s: threading.Event().wait(s) and None  # libfaketime 0.9.10\n"
            "import dstl_ray as d\n"
            "c = d.CheckpointCoordinator('job', sys.argv[1], max_parallelism=16)\n"
            "print(c.incarnation, flush=True)\n"
            "os._exit(0)\n")
    out = subprocess.run([shutil.which("faketime"), "--exclude-monotonic", "-f", offset,
                          sys.executable, "-c", code, base], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    inc = Incarnation.parse(out.stdout.strip())
    assert inc is not None
    return inc


@pytest.mark.skipif(shutil.which("faketime") is None, reason="libfaketime's `faketime` command "
                    "is missing (Debian package `faketime`; .ci/run installs it)")
def test_a_restart_from_a_host_whose_clock_is_behind_is_not_refused_as_stale(tmp_path):
    base = f"file://{tmp_path}/dfs"
    node, caller = _jobs(), Caller("ns")
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP,
                                    retention=d.CheckpointRetention.DELETE_ON_CANCELLATION)
    first = coord.incarnation
    node.admit("job", caller, str(first))
    coord.shutdown(cancel=True)  # the lease is deleted
    again = _incarnation_elsewhere(base, "-10m")
    assert again.epoch > first.epoch
    node.admit("job", caller, str(again))  # the node serves the new run, not refuses it
    with pytest.raises(StaleIncarnationError):
        node.admit("job", caller, str(first))  # the old run is the stale one
    # the user deleted the job directory (and the dead driver's lease with it)
    shutil.rmtree(tmp_path / "dfs" / "job", ignore_errors=True)
    third = _incarnation_elsewhere(base, "-60s")
    assert third.epoch > again.epoch
    node.admit("job", caller, str(third))


def test_a_holder_on_this_machine_is_known_dead_by_its_pid_and_start_time():
    me = {"machine": lease_mod.MACHINE, "holder": "x"}
    parent = os.getppid()
    assert not known_dead({**me, "pid": parent, "started": process_start(parent)})
    # the pid now belongs to another process than the one that wrote the record
    assert known_dead({**me, "pid": parent, "started": (process_start(parent) or 0) + 1})
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert known_dead({**me, "pid": p.pid, "started": 1})  # its process is gone
    assert not known_dead({**me, "machine": "elsewhere", "pid": p.pid})  # another pid table


def test_the_background_deleter_deletes_nothing_once_its_driver_is_fenced(tmp_path):
    base = f"file://{tmp_path}/dfs"
    gate = threading.Event()
    deleter = Deleter(workers=1)
    deleter.submit(lambda: gate.wait(30), "the test's gate")  # deletes queue up behind it
    registry = SharedStateRegistry(list_files=get_storage(base).list_files, deleter=deleter)
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP, retained=1,
                                    registry=registry)
    try:
        b = coord.restore(client("job", base), "op", 1, materialization_interval=None)[0]
        b.value_state("v").update("k", 1)
        c1 = coord.trigger_checkpoint().result(timeout=30)
        b.materialize(force=True).result(timeout=30)
        b.value_state("v").update("k", 2)
        c2 = coord.trigger_checkpoint().result(timeout=30)  # subsumes c1
        freed = set(c1.files.values()) - set(c2.files.values())
        assert freed and deleter.pending >= len(freed) + 1  # queued behind the gate
        # another driver took the job over (this one was paused): the next check fences it
        st = get_storage(coord.lease.url)
        rec = json.loads(st.read_file(coord.lease.url))
        st.write_file(coord.lease.url, json.dumps({**rec, "holder": "0therdriver"}).encode())
        with pytest.raises(JobLeaseError, match="taken over"):
            coord.lease.check(force=True)
    finally:
        gate.set()
    assert deleter.flush(30)
    assert all(get_storage(u).exists(u) for u in freed), "a fenced driver's delete ran"
    assert deleter.stats.fenced >= len(freed)
    coord.abandon()
