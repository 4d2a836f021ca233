"""Clock skew for ``experiments.chaos`` (the ``clock_skew`` kind): drivers of the episode's
job on clocks that are wrong by 1 s to 10 min, for real: each is a process of its own run
under libfaketime (``faketime -f +60s python -m experiments.chaos ...``), so its wall clock
and its monotonic clock are both off, as on another host.

Every ``clock_skew`` fault:

1. a second driver (``--contend``) tries, again and again for two lease TTLs, to take the job
   (``JobLease.acquire``) while the episode's driver is alive and checkpointing round after
   round: it must be refused every time (``skewed_takeovers`` counts the times it was not;
   docs/architecture.md "Many jobs, one tree": one live driver per job);
2. every other time, the episode's driver then crashes (``abandon``: its lease is left as
   it was) and a driver on a skewed clock (``--take``) takes the job once the lease is free,
   restores it, checks it against the oracle, applies the next round and checkpoints, then
   stops; a driver on this clock takes the job back from that checkpoint (the job goes on,
   nothing lost). ``skewed_restart_failures`` counts the drivers that could not take a free
   job within ``TAKE_WAIT_S`` or failed to checkpoint it.

Each driver prints one JSON line; ``clock`` (its ``time.time()``) shows the skew it ran with.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .chaos_episode import Episode
from .chaos_job import LEASE_TTL_S, MAXP, OP, Oracle, apply_local, differences, dump_local

MAX_SKEW_S = 600  # offsets are drawn from +-1 s to +-10 min, log-uniform
TAKE_WAIT_S = 30.0  # a skewed driver gives up on a free job after this long
ROOT = Path(__file__).resolve().parent.parent


def draw_offset(rng: Any) -> str:
    """A libfaketime offset (``+37s``, ``-600s``): 1 s to 10 min either way, log-uniform."""
    seconds = round(10 ** rng.uniform(0, math.log10(MAX_SKEW_S)))
    return f"{rng.choice('+-')}{seconds}s"


def require_faketime() -> str:
    exe = shutil.which("faketime")
    if exe is None:
        raise SystemExit("the clock_skew fault kind runs drivers under libfaketime: install "
                         "the faketime package (Debian: apt-get install faketime), or leave "
                         "clock_skew out of --kinds")
    return exe


def spawn(offset: str, args: list[str], out: Any) -> subprocess.Popen[bytes]:
    """``python -m experiments.chaos ARGS`` under ``faketime -f OFFSET``; its output goes to
    the file ``out``, so a chatty child never blocks on a full pipe."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [require_faketime(), "-f", offset, sys.executable, "-m", "experiments.chaos", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen[bytes], out: Any, timeout: float) -> dict[str, Any]:
    """The driver's JSON line (killed after ``timeout``: ``{"error": ...}``)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out.seek(0)
    text = out.read().decode(errors="replace")
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    return {"error": f"exit {proc.returncode}: {text[-1500:]}"}


def clock_skew(h: Any, ep: Episode) -> None:
    """The ``clock_skew`` fault (see the module docstring)."""
    h.clock_skews += 1
    offset = draw_offset(h.rng)
    with tempfile.TemporaryFile() as out:
        proc = spawn(offset, ["--contend", ep.coord.job_path, "--ttl", str(LEASE_TTL_S)], out)
        t0 = time.time()
        ep.checkpoint(ep.rnd)
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:
            ep.advance()  # the live driver checkpoints all along
            time.sleep(0.2)
        got = finish(proc, out, timeout=30)
    _record(h, ep, "contender", offset, got, t0)
    ep.count("skew_contenders")
    if got.get("took"):
        ep.count("skewed_takeovers")
        ep.log(f"    a driver at {offset} TOOK the live job ({got.get('attempts')} attempts)")
    elif "error" in got:
        ep.count("skew_driver_errors")
        ep.log(f"    contender at {offset} failed: {got['error']}")
    if got.get("took") or ep.coord.lease.fenced:  # the job needs a driver that holds it
        ep.log(f"    fenced: {ep.coord.lease.fenced}")
        ep.failover(new_coordinator=True)
    if h.clock_skews % 2:
        return
    # the driver crashes; a driver on a skewed clock takes the job over once it is free
    h.kill(ep.actors)
    ep.coord.abandon()
    offset = draw_offset(h.rng)
    import ray

    ctx = ray.get_runtime_context()
    with tempfile.TemporaryFile() as out:
        proc = spawn(offset, [
            "--take", ep.job, "--base-path", h.base, "--namespace", h.ns,
            "--address", h.cluster.address, "--ray-namespace", ctx.namespace,
            "--seed", str(h.seed), "--base-round", str(ep.base),
            "--parallelism", str(h.rng.choice([1, 2, 3])), "--ttl", str(LEASE_TTL_S)], out)
        t0 = time.time()
        got = finish(proc, out, timeout=TAKE_WAIT_S + 150)
    _record(h, ep, "takeover", offset, got, t0)
    ep.count("skewed_restarts")
    if got.get("checkpoint_id") is None:
        ep.count("skewed_restart_failures")
        ep.log(f"    the driver at {offset} did not go on with the job: "
               f"{got.get('error', got)}")
    else:
        ep.res["checkpoints_completed"] += 1
        ep.res["changes_verified"] += got["verified"]
        ep.res["changes_lost"] += got["lost"]
        ep.log(f"    the driver at {offset} took the job after {got['waited_s']} s, restored "
               f"checkpoint {got['restored']} and completed {got['checkpoint_id']}")
    ep.failover(new_coordinator=True)  # back on this host's clock, from its checkpoint
    ep.caught_up()


def _record(h: Any, ep: Episode, role: str, offset: str, got: dict[str, Any],
            t0: float) -> None:
    """The skew the driver really ran with (its clock against ours, within the time it
    took to start): a faketime that did not take shows up as ``skew_not_applied``."""
    want = float(offset[:-1])
    seen = got.get("clock", t0) - t0
    entry = {"role": role, "offset": offset, "seen_s": round(seen, 1),
             "took": bool(got.get("took"))}
    ep.res.setdefault("clock_skews", []).append(entry)
    if "clock" in got and not -5.0 <= seen - want <= 60.0:  # (its start-up: < 60 s)
        ep.count("skew_not_applied")
        ep.log(f"    {role} asked for {offset}, its clock was off by {seen:.1f} s")


# ---------------------------------------------------------------------- the drivers


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the skewed drivers (hidden: the harness starts them)."""
    hide = argparse.SUPPRESS
    for name, kind in (("--contend", str), ("--take", str), ("--base-path", str),
                       ("--namespace", str), ("--address", str), ("--ray-namespace", str),
                       ("--base-round", int), ("--parallelism", int)):
        p.add_argument(name, type=kind, help=hide)
    p.add_argument("--ttl", type=float, default=LEASE_TTL_S, help=hide)


def run_driver(args: argparse.Namespace) -> bool:
    """Run the skewed driver the options name; False if they name none."""
    if args.contend:
        print(json.dumps(contend(args.contend, args.ttl)), flush=True)
        return True
    if args.take:
        print(json.dumps(take_over(args)), flush=True)
        return True
    return False


def contend(job_path: str, ttl: float) -> dict[str, Any]:
    """Try to take the job for two TTLs (plus one second), as a second driver started by
    mistake would keep trying; a job taken is abandoned at once (never acted on: the
    harness counts it)."""
    from dstl_ray.checkpoint.lease import JobLease
    from dstl_ray.errors import JobLeaseError

    out: dict[str, Any] = {"took": False, "clock": time.time(), "attempts": 0}
    lease = JobLease(job_path, ttl_s=ttl)
    until = time.monotonic() + 2 * ttl + 1.0
    while True:
        out["attempts"] += 1
        try:
            lease.acquire(renew=False)
        except JobLeaseError as e:
            out["refused"] = str(e)[:300]
        else:
            lease.abandon()
            out["took"] = True
            return out
        if time.monotonic() >= until:
            return out
        time.sleep(0.3)


def take_over(args: argparse.Namespace) -> dict[str, Any]:
    """Wait for the job's lease to be free, restore the job, check it against the oracle,
    apply the next round, checkpoint it and stop cleanly."""
    import ray

    import dstl_ray as d
    from dstl_ray.errors import JobLeaseError

    out: dict[str, Any] = {"took": False, "clock": time.time()}  # (before Ray's start-up)
    ray.init(address=args.address, namespace=args.ray_namespace, log_to_driver=False,
             logging_level="ERROR")
    coord = d.CheckpointCoordinator(
        args.take, args.base_path, max_parallelism=MAXP, retained=2, lease_ttl_s=args.ttl,
        retention=d.CheckpointRetention.DELETE_ON_CANCELLATION)
    t0 = time.monotonic()
    while True:  # one coordinator (and lease) all along: it may be watching the holder
        try:
            coord.incarnation  # noqa: B018 - takes the job's lease
            break
        except JobLeaseError as e:
            if time.monotonic() - t0 > TAKE_WAIT_S:
                coord.abandon()
                out["error"] = f"the job was not free after {TAKE_WAIT_S} s: {e}"
                return out
            time.sleep(0.3)
    out.update(took=True, waited_s=round(time.monotonic() - t0, 2))
    try:
        backends = coord.restore(d.StateChangelogClient(args.take, namespace=args.namespace),
                                 OP, args.parallelism, materialization_interval=None)
        latest = coord.latest_checkpoint()
        restored = latest.checkpoint_id if latest else 0
        want = Oracle(args.seed).between(args.base_round, args.base_round + restored)
        out.update(restored=restored, verified=sum(want.values()),
                   lost=differences(dump_local(backends), want))
        apply_local(backends, args.seed, args.base_round + restored + 1)
        cc = coord.trigger_checkpoint().result(timeout=120)
        if cc.checkpoint_id != restored + 1:  # (the harness's numbering: rounds after base)
            raise RuntimeError(f"checkpoint {cc.checkpoint_id} after restoring {restored}")
        out["checkpoint_id"] = cc.checkpoint_id
    except Exception as e:  # noqa: BLE001 - reported to the harness
        out["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    finally:
        coord.shutdown()
    return out
