"""The tree on several hosts under the faults only hosts have (issue 31): HOSTS network
namespaces on a bridge, each with its own IP and a Ray node started by ``ray start`` in a
token-authenticated cluster (``dstl_ray.local.hosts``); a driver on the first host
(``experiments.multihost_driver``) runs the chaos job spread over every host and another job
on its own host, checkpointing all along, while this process, outside the namespaces:

* partitions a host (its link down) for 5-9 s, or, one time in five, for 30-60 s: longer
  than Ray's health check (``HEALTH``: ~20 s); where Ray declared the host's node dead
  meanwhile, the host rejoins as a fresh one once the link is back (as an operator restarts
  Ray on a machine that was cut off);
* loses a host (every process of it killed at once, its namespace gone), and a fresh host
  joins.

The first host (the head and the driver) is never touched. The tree re-forms on every
change of hosts (membership), the job fails over to its latest checkpoint when a subtask
goes with its host, and is checked against its oracle after every tenth checkpoint and at
the end (``changes_lost``); at the end a new coordinator cleans up and the job's directory
must hold exactly its retained checkpoints (``leaked_files``, ``missing_files``). The other
job must decline nothing because of a partition of another host (``other_job_declines``:
outside every fault's window and the tree-wide heal window after it;
``other_job_declines_during_partitions``: inside partitions' windows).

Run (as root): python -m experiments.multihost [--quick] [--hosts 4] [--partitions 40]
[--losses 10] [--seed 31]. Writes experiments/results/multihost.json (+ .png).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import parser, percentile, plt, write_results

# Ray's GCS declares a node dead after 10 failed health checks 1 s apart (each waiting 1 s):
# ~20 s; Ray's default (5 checks 3 s apart, each waiting 10 s) leaves a lost host's subtasks
# hanging for about a minute before the job may fail over
HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
          "RAY_health_check_failure_threshold": "10"}
SHORT, LONG = (5.0, 9.0), (30.0, 60.0)
GRACE_S = 10.0  # the tree-wide heal window after a fault (experiments.chaos_job)
ROOT = Path(__file__).resolve().parent.parent


def node_alive(hc: Any, ip: str) -> bool:
    """Whether Ray (the GCS on the head) holds the node at ``ip`` alive."""
    code = ("import json, sys, ray; ray.init(address=sys.argv[1], log_to_driver=False); "
            "print('NODES ' + json.dumps({n['NodeManagerAddress']: n['Alive'] "
            "for n in ray.nodes()}))")
    out = hc.run(hc.hosts[0], [sys.executable, "-c", code, hc.address], timeout=120)
    nodes = json.loads(out.stdout.split("NODES ", 1)[1].splitlines()[0]) \
        if "NODES " in out.stdout else {}
    return bool(nodes.get(ip))


def inject(hc: Any, kind: str, rng: random.Random, log: Any) -> dict[str, Any]:
    """One fault on a random host but the first; returns its window (seconds since the
    epoch) and what happened."""
    victim = rng.choice(hc.hosts[1:])
    start = time.time()
    fault: dict[str, Any] = {"kind": kind, "host": victim.ip, "start": start}
    if kind == "partition":
        seconds = rng.uniform(*(LONG if rng.random() < 0.2 else SHORT))
        hc.partition(victim)
        time.sleep(seconds)
        hc.heal(victim)
        fault["seconds"] = round(seconds, 1)
        if seconds > LONG[0] - 1:  # past Ray's health check: declared dead, rejoins
            fault["node_declared_dead"] = not node_alive(hc, victim.ip)
            if fault["node_declared_dead"]:
                hc.lose(victim)
                fault["rejoined_as"] = hc.add_host().ip
    else:
        hc.lose(victim)
        time.sleep(rng.uniform(2.0, 5.0))
        fault["replaced_by"] = hc.add_host().ip
    fault["end"] = time.time()
    what = {k: v for k, v in fault.items() if k not in ("start", "end")}
    log(f"{kind} of {victim.ip}: {json.dumps(what)} ({fault['end'] - start:.1f} s)")
    return fault


def inside(t0: float, t1: float, faults: list[dict[str, Any]], kind: str | None = None,
           grace: float = 0.0) -> bool:
    """Whether [t0, t1] overlaps a fault's window (of ``kind``, or any) plus ``grace``."""
    return any(t0 < f["end"] + grace and t1 > f["start"] - 1.0 for f in faults
               if kind is None or f["kind"] == kind)


def summarize(res: dict[str, Any], faults: list[dict[str, Any]], hosts: int) -> dict[str, Any]:
    """The figures of a run (pure: tested in tests/unit/test_multihost_report.py)."""
    ok = [r for r in res["rounds"] if r["ok"]]
    ms = [r["ms"] for r in ok]
    calm = [r["ms"] for r in ok if not inside(r["at"], r["at"] + r["ms"] / 1000, faults,
                                              grace=GRACE_S)]
    declines = res["other_job_decline_times"]
    other_ms = [m for _at, m in res["other_job_checkpoint_ms"]]
    return {
        "hosts": hosts,
        "hosts_ever": hosts + sum(1 for f in faults if "replaced_by" in f or "rejoined_as" in f),
        "partitions": sum(f["kind"] == "partition" for f in faults),
        "long_partitions_node_declared_dead": sum(bool(f.get("node_declared_dead"))
                                                  for f in faults),
        "host_losses": sum(f["kind"] == "loss" for f in faults),
        "checkpoints_completed": res["checkpoints_completed"],
        "checkpoints_declined": res["checkpoints_declined"],
        "recoveries": res["recoveries"],
        "changes_verified": res["changes_verified"],
        "changes_lost": res["changes_lost"] + res["other_job_lost"],
        "leaked_files": res["leaked_files"] + res["other_job_leaked_files"],
        "missing_files": res["missing_files"] + res["other_job_missing_files"],
        "checkpoint_ms_p50": percentile(ms, 50), "checkpoint_ms_p99": percentile(ms, 99),
        "checkpoint_ms_p50_outside_faults": percentile(calm, 50),
        "checkpoint_ms_p99_outside_faults": percentile(calm, 99),
        "other_job_checkpoints": res["other_job_checkpoints"],
        "other_job_checkpoint_ms_p50": percentile(other_ms, 50),
        "other_job_checkpoint_ms_p99": percentile(other_ms, 99),
        "other_job_declines": sum(not inside(a, b, faults, grace=GRACE_S)
                                  for a, b in declines),
        "other_job_declines_during_partitions": sum(inside(a, b, faults, "partition")
                                                    for a, b in declines),
        "other_job_declines_in_heal_windows": sum(inside(a, b, faults, grace=GRACE_S)
                                                  for a, b in declines),
    }


def plot(res: dict[str, Any], faults: list[dict[str, Any]], origin: float) -> Any:
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(11, 4))
    for f in faults:
        ax.axvspan(f["start"] - origin, f["end"] - origin, alpha=0.25,
                   color="tab:blue" if f["kind"] == "partition" else "tab:red")
    ok = [r for r in res["rounds"] if r["ok"]]
    ax.plot([r["at"] - origin for r in ok], [r["ms"] for r in ok], ".", ms=3,
            label="job on every host: checkpoint ms")
    bad = [r["at"] - origin for r in res["rounds"] if not r["ok"]]
    ax.plot(bad, [1.0] * len(bad), "x", color="tab:red", label="declined (job on every host)")
    ax.set_yscale("log")
    ax.set_xlabel("s (blue: a host partitioned, red: a host lost and replaced)")
    ax.set_ylabel("checkpoint ms")
    ax.set_title("The tree on several hosts: checkpoints through partitions and host losses")
    ax.legend(loc="upper right", fontsize=8)
    return fig


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--partitions", type=int, default=40)
    p.add_argument("--losses", type=int, default=10)
    p.add_argument("--seed", type=int, default=31)
    args = p.parse_args()
    from dstl_ray.local.hosts import HostCluster, unavailable

    reason = unavailable()
    if reason:
        raise SystemExit(f"experiments.multihost cannot run here: {reason}")
    if args.hosts < 2:
        raise SystemExit(f"--hosts must be >= 2 (the first is never touched), got {args.hosts}")
    partitions, losses = (4, 1) if args.quick else (args.partitions, args.losses)
    rng = random.Random(args.seed)
    plan = ["partition"] * partitions + ["loss"] * losses
    rng.shuffle(plan)
    work = Path(tempfile.mkdtemp(prefix="multihost-"))
    origin = time.time()

    def log(msg: str) -> None:
        print(f"[multihost {time.time() - origin:6.1f}s] {msg}", flush=True)

    faults: list[dict[str, Any]] = []
    try:
        with HostCluster(args.hosts, env=dict(HEALTH)) as hc:
            log(f"{args.hosts} hosts: {', '.join(h.ip for h in hc.hosts)}")
            proc = hc.popen(hc.hosts[0], [sys.executable, "-m", "experiments.multihost_driver",
                                          hc.address, f"file://{work}/dfs", str(args.seed)],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            try:
                ready = proc.stdout.readline() if proc.stdout else ""
                if not ready.startswith("READY"):
                    raise SystemExit(f"the driver did not start: {ready!r}")
                log("driver ready")
                time.sleep(10.0)  # checkpoints before the first fault
                for i, kind in enumerate(plan):
                    log(f"fault {i + 1}/{len(plan)}")
                    faults.append(inject(hc, kind, rng, log))
                    time.sleep(rng.uniform(4.0, 8.0))
                assert proc.stdin is not None
                proc.stdin.write("STOP " + json.dumps(faults) + "\n")
                proc.stdin.flush()
                out, _ = proc.communicate(timeout=900)
            finally:
                if proc.poll() is None:
                    proc.kill()
            if proc.returncode != 0 or "RESULT " not in out:
                raise SystemExit(f"the driver failed (exit {proc.returncode})")
            res = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures = summarize(res, faults, args.hosts)
    log(json.dumps(figures))
    write_results("multihost", {
        **figures, "seed": args.seed, "quick": args.quick, "health_check": HEALTH,
        "wall_s": round(time.time() - origin, 1), "faults": faults,
        "rounds": res["rounds"], "other_job_checkpoint_ms": res["other_job_checkpoint_ms"],
    }, plot(res, faults, origin), args.out)


if __name__ == "__main__":
    main()
