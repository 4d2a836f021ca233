"""A job's life, many times over (docs/architecture.md "A job's life"): lives of several jobs
on ONE long-lived tree, each life a new driver (coordinator) that

1. restores, from the latest checkpoint or from one of the job's savepoints, at a parallelism
   other than the last life's, in CLAIM or NO_CLAIM mode; the restored state is compared with
   the oracle of what it was restored from;
2. takes a savepoint at once (the savepoint that a counter restarted from the retained
   checkpoints alone would give an earlier run's number);
3. runs rounds of updates with a checkpoint each (a materialization now and then); while it
   runs, some lives see a second driver on a skewed clock (``faketime``, +-1 s to +-10 min)
   try to take the job: it must be refused while this driver is alive;
4. takes a savepoint before it stops, then stops: a clean stop, a cancel with
   RETAIN_ON_CANCELLATION or DELETE_ON_CANCELLATION, or a crash (nothing closed or released);
5. between lives, a node actor is killed now and then (Ray restarts it).

At the end every savepoint ever taken is read back (``read_state``) against the oracle of
the moment it was taken, and every job directory must hold only files that a retained
checkpoint or a savepoint names (plus the job's lease).

Run: python -m experiments.lifecycle [--quick] [--lives N] [--seed N]
Writes experiments/results/lifecycle.json and .png.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import parser, plt, summary, write_results

OP = "count"
MAXP = 32
KEYS = 120
LEASE_TTL_S = 3.0
OFFSETS = ("+1s", "-1s", "+60s", "-60s", "+10m", "-10m")


def _owner(backends: list[Any], key: int) -> Any:
    from dstl_ray import assign_key_group

    kg = assign_key_group(key, MAXP)
    return next(b for b in backends if kg in b.key_group_range)


def _dump(backends: list[Any]) -> dict[int, int]:
    out: dict[int, int] = {}
    for b in backends:
        out.update(b.dump().get("v", {}))
    return out


def differences(got: dict[int, int], want: dict[int, int]) -> int:
    return sum(1 for k in set(got) | set(want) if got.get(k) != want.get(k))


def contend(job_path: str, ttl: float) -> None:
    """The second driver (run under faketime): try to take the job, print what happened."""
    import threading

    try:  # under faketime --exclude-monotonic (libfaketime 0.9.10) time.sleep fails with
        time.sleep(0.001)  # EINVAL while timed lock waits work: sleep on a lock then
    except OSError:
        time.sleep = lambda s: threading.Event().wait(s) and None  # type: ignore[assignment]
    from dstl_ray.checkpoint.lease import JobLease
    from dstl_ray.errors import JobLeaseError

    lease = JobLease(job_path, ttl_s=ttl)
    try:
        lease.acquire(renew=False)
    except JobLeaseError as e:
        print(json.dumps({"took": False, "error": str(e)[:200]}), flush=True)
        return
    lease.abandon()  # never act on a job taken by mistake: the harness counts it
    print(json.dumps({"took": True}), flush=True)


def start_contender(job_path: str, offset: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "experiments.lifecycle", "--contend", job_path,
           "--ttl", str(LEASE_TTL_S)]
    if shutil.which("faketime"):
        # only the wall clock is skewed: monotonic clocks are never compared across hosts
        # (and libfaketime 0.9.10 hangs Python's timed waits when it fakes them)
        cmd = ["faketime", "--exclude-monotonic", "-f", offset, *cmd]
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


class Lives:
    """The jobs, their oracles and their savepoints across lives."""

    def __init__(self, base: str, namespace: str, tree: Any, rng: random.Random,
                 log: Any) -> None:
        self.base, self.ns, self.tree, self.rng, self.log = base, namespace, tree, rng, log
        self.latest: dict[str, dict[int, int] | None] = {}  # job -> latest checkpoint oracle
        self.parallelism: dict[str, int] = {}
        self.savepoints: list[tuple[str, str, dict[int, int]]] = []  # (job, url, oracle)
        self.res: dict[str, Any] = {
            "lives": 0, "savepoints_taken": 0, "savepoints_failed": 0,
            "checkpoints_completed": 0, "checkpoints_declined": 0, "changes_verified": 0,
            "changes_lost": 0, "restores_from_savepoint": 0, "contenders": 0,
            "skewed_takeovers": 0, "node_kills": 0, "stops": {}, "restore_s": [],
            "checkpoint_ms": []}

    def life(self, job: str, rounds: int, contend_offset: str | None) -> None:
        import dstl_ray as d

        rng, res = self.rng, self.res
        retention = rng.choice(list(d.CheckpointRetention))
        coord = d.CheckpointCoordinator(job, self.base, max_parallelism=MAXP, retained=2,
                                        retention=retention, lease_ttl_s=LEASE_TTL_S)
        client = d.StateChangelogClient(job, namespace=self.ns)
        mine = [s for s in self.savepoints if s[0] == job]
        use_sp = mine and (self.latest.get(job) is None or rng.random() < 0.3)
        source, want = (None, self.latest.get(job) or {})
        if use_sp:
            _, source, want = rng.choice(mine)
            res["restores_from_savepoint"] += 1
        par = rng.choice([p for p in (1, 2, 3, 4) if p != self.parallelism.get(job)])
        self.parallelism[job] = par
        mode = rng.choice(list(d.RestoreMode))
        t0 = time.perf_counter()
        backends = coord.restore(client, OP, par, checkpoint=source, mode=mode,
                                 materialization_interval=None)
        res["restore_s"].append(time.perf_counter() - t0)
        for b in backends:  # declared from the start: an empty savepoint still has it
            b.value_state("v")
        oracle = _dump(backends)
        res["changes_lost"] += differences(oracle, want)
        res["changes_verified"] += len(want)
        self._savepoint(coord, job, oracle)  # right after the restart
        contender = (start_contender(coord.job_path, contend_offset)
                     if contend_offset else None)
        for rnd in range(rounds):
            for _ in range(40):
                k = rng.randrange(KEYS)
                b = _owner(backends, k)
                v = b.value_state("v")
                v.update(k, v.value(k, 0) + 1)
                oracle[k] = oracle.get(k, 0) + 1
            if rnd == 1 and rng.random() < 0.5:
                for b in backends:
                    b.materialize().result(timeout=60)
            t1 = time.perf_counter()
            try:
                coord.trigger_checkpoint().result(timeout=60)
                res["checkpoints_completed"] += 1
                res["checkpoint_ms"].append((time.perf_counter() - t1) * 1000)
                self.latest[job] = dict(oracle)
            except d.DstlError as e:
                res["checkpoints_declined"] += 1
                self.log(f"  {job}: checkpoint declined: {e}")
        if contender is not None:
            res["contenders"] += 1
            out, _ = contender.communicate(timeout=120)
            took = any(json.loads(line).get("took") for line in out.splitlines()
                       if line.startswith("{"))
            if took:
                res["skewed_takeovers"] += 1
                self.log(f"  {job}: a driver at {contend_offset} TOOK the live job")
        self._savepoint(coord, job, oracle)  # before it stops
        stop = rng.choice(["clean", "cancel", "cancel", "crash"])
        res["stops"][f"{stop}:{retention.value}"] = \
            res["stops"].get(f"{stop}:{retention.value}", 0) + 1
        if stop == "crash":
            for b in backends:
                b.writer.wait_uploads(30)
            coord.abandon()
            for b in backends:  # the process's resources go with it
                b.close()
        else:
            coord.shutdown(cancel=stop == "cancel")
            if stop == "cancel" and retention is d.CheckpointRetention.DELETE_ON_CANCELLATION:
                self.latest[job] = None  # nothing retained: the next life needs a savepoint
        res["lives"] += 1

    def settle(self, job: str) -> None:
        """Restore the job (from its latest checkpoint, else its newest savepoint), check
        it, and stop cleanly."""
        import dstl_ray as d

        coord = d.CheckpointCoordinator(job, self.base, max_parallelism=MAXP, retained=2,
                                        lease_ttl_s=LEASE_TTL_S)
        mine = [s for s in self.savepoints if s[0] == job]
        source, want = None, self.latest.get(job)
        if want is None and mine:
            _, source, want = mine[-1]
        backends = coord.restore(d.StateChangelogClient(job, namespace=self.ns), OP, 2,
                                 checkpoint=source, materialization_interval=None)
        self.res["changes_lost"] += differences(_dump(backends), want or {})
        coord.shutdown()

    def _savepoint(self, coord: Any, job: str, oracle: dict[int, int]) -> None:
        try:
            cc = coord.trigger_savepoint().result(timeout=120)
        except Exception as e:  # noqa: BLE001 - counted; the oracle check finds the harm
            self.res["savepoints_failed"] += 1
            self.log(f"  {job}: savepoint failed: {e}")
            return
        self.res["savepoints_taken"] += 1
        self.savepoints.append((job, cc.metadata_url, dict(oracle)))

    def kill_a_node(self) -> None:
        import ray

        names = sorted(s["name"] for s in self.tree.status() if "error" not in s)
        name = self.rng.choice(names)
        ray.kill(self.tree.node(name), no_restart=False)
        self.res["node_kills"] += 1
        time.sleep(2.0)  # the kill lands asynchronously: a status right away may predate it
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the tree answers again
            if all("error" not in s for s in self.tree.status()):
                return
            time.sleep(0.5)

    def unreadable_savepoints(self) -> int:
        from dstl_ray import read_state

        bad = 0
        for job, url, want in self.savepoints:
            try:
                got = read_state(url, "v", OP)
            except Exception as e:  # noqa: BLE001
                self.log(f"  savepoint {url} unreadable: {e}")
                bad += 1
                continue
            if got != want:
                self.log(f"  savepoint {url} of {job}: {differences(got, want)} keys differ")
                bad += 1
        return bad


def named_files(base: str, job: str) -> tuple[set[str], list[str]]:
    """(files named by the job's retained checkpoints and its savepoints, every file)."""
    from dstl_ray.checkpoint.recovery import load_checkpoint
    from dstl_ray.storage.base import join
    from dstl_ray.storage.registry import get_storage

    job_path = join(base, job)
    storage = get_storage(job_path)
    files = storage.list_files(job_path)
    named: set[str] = set()
    for url in files:
        if url.endswith("/_metadata"):
            cc = load_checkpoint(url)
            named |= set(cc.files.values()) | {url}
    return named, files


def unreferenced(base: str, jobs: list[str]) -> list[str]:
    out: list[str] = []
    for job in jobs:
        named, files = named_files(base, job)
        prefix = f"{base.rstrip('/')}/{job}/"
        out += [f for f in files if f not in named
                and not f[len(prefix):].startswith("_")  # the lease and its kin
                and not f.endswith("/_savepoint")]  # a savepoint directory's marker
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--lives", type=int, default=0, help="default 120 (quick: 8)")
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--contend", help=argparse_hidden())
    p.add_argument("--ttl", type=float, default=LEASE_TTL_S, help=argparse_hidden())
    args = p.parse_args()
    if args.contend:
        contend(args.contend, args.ttl)
        return
    run(args, args.lives or (8 if args.quick else 120))


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


def run(args: Any, lives: int) -> None:
    import ray

    import dstl_ray as d
    from dstl_ray.testing import start_local_cluster, stop_local_cluster

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="lifecycle-"))
    ns = "lifecycle"
    cluster = start_local_cluster(4, 1, ns)
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[lifecycle {time.time() - t0:6.1f}s] {msg}", flush=True)

    base = f"file://{work}/dfs"
    jobs = [f"life-{i}" for i in range(args.jobs)]
    try:
        tree = d.deploy(base, d.ChangelogConfig(namespace=ns), detached=False)
        h = Lives(base, ns, tree, rng, log)
        try:
            for i in range(lives):
                job = jobs[i % len(jobs)]
                offset = rng.choice(OFFSETS) if i % 4 == 3 else None
                h.life(job, rounds=4, contend_offset=offset)
                if i % 5 == 4:
                    h.kill_a_node()
                if i % 10 == 9:
                    counts = {k: v for k, v in h.res.items() if isinstance(v, int)}
                    log(f"{i + 1} lives: {json.dumps(counts)}")
            for job in jobs:  # a last clean life each: a crash's leftovers are cleaned
                h.settle(job)  # by the next recovery (FLIP-158 "Cleanup after recovery")
            unref: list[str] = []
            for _ in range(20):  # deletions run in the background: let them settle
                unref = unreferenced(base, jobs)
                if not unref:
                    break
                time.sleep(0.5)
            bad = h.unreadable_savepoints()
        finally:
            tree.shutdown()
    finally:
        ray.shutdown()
        stop_local_cluster(cluster)
        shutil.rmtree(work, ignore_errors=True)
    res = h.res
    data = {"seed": args.seed, "quick": args.quick, "seconds": round(time.time() - t0, 1),
            "jobs": len(jobs), **{k: v for k, v in res.items()
                                  if k not in ("restore_s", "checkpoint_ms")},
            "savepoints_unreadable": bad, "unreferenced_files": len(unref),
            "unreferenced_examples": unref[:10],
            "restore_s": summary(res["restore_s"]), "checkpoint_ms": summary(res["checkpoint_ms"]),
            "command": " ".join(["python -m experiments.lifecycle", *sys.argv[1:]])}
    pyplot = plt()
    fig, (a1, a2) = pyplot.subplots(1, 2, figsize=(11, 4))
    names = ["lives", "savepoints_taken", "savepoints_unreadable", "changes_lost",
             "unreferenced_files", "skewed_takeovers", "node_kills"]
    a1.barh(names, [data[n] for n in names])
    a1.set(title=f"{data['lives']} lives of {len(jobs)} jobs on one tree")
    a2.plot(res["checkpoint_ms"], ".", ms=3)
    a2.set(xlabel="checkpoint (all lives, in order)", ylabel="ms", yscale="log",
           title="checkpoint latency across lives")
    fig.tight_layout()
    write_results("lifecycle", data, fig, args.out)
    print(f"[lifecycle] {data['lives']} lives, {data['savepoints_taken']} savepoints "
          f"({bad} unreadable), {data['changes_lost']} changes lost, "
          f"{data['unreferenced_files']} unreferenced files, "
          f"{data['skewed_takeovers']} skewed takeovers", flush=True)
    if bad or data["changes_lost"] or data["unreferenced_files"] or data["skewed_takeovers"]:
        raise SystemExit("lifecycle FAILED")


if __name__ == "__main__":
    main()
