"""Chaos for the changelog itself (issue "Reliability", part 1): writers and backends on a
3-node Ray cluster (``ray.cluster_utils.Cluster``), against ``file://`` and the loopback S3
server, with seeded faults injected at random moments and an oracle after every one.

A job is 4 subtask actors, each a ChangelogKeyedStateBackend counting keys; round ``r`` applies
a deterministic set of updates per subtask (a replayable source), then checkpoint ``r`` is
taken (every subtask's snapshot, then ``complete_checkpoint``). Fault kinds:

* ``node_kill``: a changelog node actor is killed (Ray restarts it), before or during a
  checkpoint; writers re-send, the checkpoint may be declined;
* ``node_removal``: a Ray node hosting subtasks and a node actor is removed, then a fresh
  node joins; the job fails over, the tree re-attaches;
* ``writer_kill``: a subtask (writer process) is killed; the job fails over;
* ``dfs_5xx`` / ``dfs_timeout`` / ``dfs_slow`` / ``dfs_torn``: the nodes' DFS uploads fail
  with 503, hang past the upload timeout, straggle, or land half-written, 1-3 times in a row;
* ``lost_ack``: the coordinator never hears the subtasks' acknowledgements of a checkpoint
  (their uploads landed, the checkpoint is declined);
* ``coordinator_restart``: the coordinator dies before or right after writing a checkpoint's
  metadata; a new one loads the retained checkpoints from storage, cleans orphans and the job
  restarts from the latest (Flink: JobManager failover).
* ``rescale``: the job is restored at another parallelism (2, 3, 6 or 8), by the same
  coordinator or a new one (with file merging, each new subtask writes its own copy at once);
* ``job_restart``: the job is cancelled with DELETE_ON_CANCELLATION and started again under
  the same id (checkpoint ids start at 1 again; the nodes knew the old run);
* ``stall``: an ancestor node actor's process is paused (SIGSTOP) for 1-4 s while a
  checkpoint runs: its children's deadlines pass, they flush themselves; once resumed it must
  write nothing for them, or release what it wrote;
* ``big_request``: one subtask's persist request holds a single change of 10 MB;
* ``clock_skew``: a second driver on a clock 1 s to 10 min off (libfaketime) tries to take
  the live job and must be refused; every other time the driver then crashes and a skewed
  driver takes the free job over, restores and checkpoints it (``experiments.chaos_skew``);
* ``savepoint_cycle``: savepoint, cancel (DELETE_ON_CANCELLATION and RETAIN_ON_CANCELLATION
  in turn), restore from the savepoint at another parallelism; every savepoint taken is read
  back against its oracle at the end of the run (``savepoints_unreadable``, must be 0);
* ``long_stall``: a node actor that children forward to is paused (SIGSTOP) for 10-30 s
  (quick: 10 s) while the job keeps checkpointing.

Every episode runs a second job on the same tree (``Bystander``) checkpointing every 0.3 s
all along: DFS faults are aimed at the episode's job only (its path), and the other job must
see 0 declined checkpoints outside tree-wide faults (node kill, removal, stalls, and 10 s after
them while the tree heals), lose nothing and leak nothing (``other_job_*`` in the results).
Its checkpoint latencies give each fault kind's recovery latency ratio: p50 in the 30 s after
recovery (after the heal window) over p50 in the 30 s before the fault, for faults with no
other fault in those windows (``experiments.chaos_report``). The harness waits around the
faults it measures: on each storage the first three faults of each kind of a job's life
(``clock_skew``, ``savepoint_cycle``, ``long_stall``; quick runs: every one) and, in full
runs, the first of every other kind (``--window-s``; quick: 5 s; 0: no waiting).

A failover restores every subtask from the latest completed checkpoint and replays the rounds
after it. After every fault and every clean round: the live state equals the oracle, the
latest completed checkpoint restored from storage in the driver equals the oracle at its
round (changes lost = the sum of count differences, must be 0), and a checkpoint without
faults completes. At the end a new coordinator cleans up and storage must hold exactly the
retained checkpoints' and the savepoints' files (leaked and missing, must be 0). Peak RSS of node actors and
subtasks is recorded; node buffers must be empty between rounds.

Run: python -m experiments.chaos [--quick] [--seed N] [--faults N] [--kinds a,b] [--storage
file,s3] [--window-s S]. Writes experiments/results/chaos.json (+ .png). The modules:
``chaos_job`` (subtasks, oracle, other job), ``chaos_episode`` (one job's run),
``chaos_faults`` and ``chaos_skew`` (the injections), ``chaos_report`` (the results).
``--hosts N`` (as root) runs the same job on N hosts of their own instead, through 40
partitions and 10 host losses: ``experiments.multihost`` (results: multihost.json).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from . import chaos_skew
from .chaos_episode import Episode
from .chaos_faults import inject
from .chaos_job import (
    FAILOVER,
    KINDS,
    LIFE_KINDS,
    PAR,
    TREE_WIDE,
    TREE_WIDE_GRACE_S,
    Bystander,
    Placement,
    Savepoint,
    Subtask,
    final_files,
    kill_actors,
)
from .chaos_report import drift, read_back, recovery_ratios, report
from .common import parser

LIFE_MEASURED = 3  # per kind of a job's life and storage, in full runs

__all__ = ["FAILOVER", "KINDS", "LIFE_KINDS", "Harness", "main", "schedules"]


class Harness:
    """One cluster and one tree per storage; episodes run jobs with faults on them."""

    def __init__(self, cluster: Any, base: str, namespace: str, config: Any,
                 env: dict[str, str], rng: random.Random, seed: int, quick: bool = False,
                 window_s: float = 0.0) -> None:
        import ray

        from dstl_ray import deploy

        self.cluster, self.base, self.ns, self.env = cluster, base, namespace, env
        self.rng, self.seed, self.quick, self.window_s = rng, seed, quick, window_s
        self.config = config
        self.tree = deploy(base, config, detached=False)
        self.actor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)(Subtask)
        self.placement = Placement(self._nodes, offset=1, soft=True)
        self.peak_rss_kb = {"node_actors": 0, "subtasks": 0}
        self.removed: list[str] = []  # node ids removed from the cluster
        self.tree_wide: list[tuple[float, float]] = []  # when tree-wide faults went on
        self.savepoints: list[Savepoint] = []  # every savepoint taken, read back at the end
        self.savepoint_cycles = 0  # (the retention mode alternates over the run)
        self.clock_skews = 0  # (every other one crashes the driver)
        self._measured: Counter = Counter()  # faults measured per kind on this storage

    # ------------------------------------------------------------------ job

    def start(self, job: str, restore: str | None, incarnation: str = "",
              parallelism: int = PAR, foreign: bool = False) -> list[Any]:
        return self.placement.start(self.actor, job, restore, self.ns, self.env, incarnation,
                                    parallelism, foreign)

    def _nodes(self) -> list[str]:
        import ray

        return sorted(n["NodeID"] for n in ray.nodes()
                      if n["Alive"] and n["NodeID"] not in self.removed)

    def kill(self, actors: list[Any]) -> None:
        kill_actors(actors)

    def live_status(self) -> list[dict[str, Any]]:
        return [s for s in self.tree.status() if "error" not in s]

    def node_names(self) -> list[str]:
        return sorted(s["name"] for s in self.live_status())

    def set_faults(self, spec: str) -> None:
        import ray

        from dstl_ray.errors import ConfigError

        for name in self.node_names():
            try:
                ray.get(self.tree.node(name).set_fault_spec.remote(spec), timeout=30)
            except ConfigError:
                raise  # a spec the node cannot inject (e.g. no plugins): never run without it
            except Exception:  # noqa: BLE001 - a node restarting has no faults anyway
                pass

    def memory(self, actors: list[Any]) -> tuple[int, int]:
        """(bytes still buffered in nodes, pending requests) and peak RSS bookkeeping."""
        import ray

        st = self.live_status()
        self.peak_rss_kb["node_actors"] = max([self.peak_rss_kb["node_actors"],
                                               *(s.get("max_rss_kb", 0) for s in st)])
        try:
            rss = ray.get([a.rss_kb.remote() for a in actors], timeout=30)
            self.peak_rss_kb["subtasks"] = max([self.peak_rss_kb["subtasks"], *rss])
        except Exception:  # noqa: BLE001 - a victim
            pass
        return (sum(s["buffered_bytes"] for s in st), sum(s["pending_requests"] for s in st))

    # ------------------------------------------------------------------ episode

    def measured(self, kind: str) -> bool:
        """Whether the harness waits around this fault so that its recovery latency ratio
        counts: the first :data:`LIFE_MEASURED` of each kind of a job's life (quick runs:
        every one) and, in full runs, the first of every other kind, on each storage (a
        measured fault costs two quiet windows: measuring all ~60 life faults of a full
        run took it past 90 minutes)."""
        if self.window_s <= 0:
            return False
        if kind in LIFE_KINDS and self.quick:
            return True
        first = self._measured[kind] < (LIFE_MEASURED if kind in LIFE_KINDS else 1)
        self._measured[kind] += 1
        return first and not (self.quick and kind not in LIFE_KINDS)

    def episode(self, job: str, schedule: list[str], log: Any) -> dict[str, Any]:
        heal, window = TREE_WIDE_GRACE_S, self.window_s
        origin = time.monotonic()
        other = Bystander(self, job + "-other", origin)
        ep = Episode(self, job, log)
        res = ep.res
        faults: list[dict[str, Any]] = []
        last_end = quiet_until = time.monotonic()  # the other job's warm-up: not a window
        try:
            for kind in schedule:
                ep.rnd += 1
                ep.apply_to(ep.rnd)
                measured = self.measured(kind)
                start_at = max(quiet_until, last_end + heal + window if measured else 0.0)
                time.sleep(max(0.0, start_at - time.monotonic()))
                res["faults_by_kind"][kind] += 1
                log(f"  round {ep.rnd}: {kind}")
                t0, s = time.time(), time.monotonic()
                inject(self, kind, ep)
                if kind in TREE_WIDE:  # another job may fail meanwhile
                    self.tree_wide.append((t0, time.time() + 1.0))
                ep.caught_up()
                ep.apply_to(ep.rnd)
                ep.verify(f"after {kind}")
                ep.clean_round()
                ep.verify("clean round")
                last_end = time.monotonic()
                faults.append({"kind": kind, "start_s": round(s - origin, 3),
                               "end_s": round(last_end - origin, 3), "measured": measured})
                if measured:  # the window after it: nothing else happens
                    quiet_until = last_end + heal + window
                buffered, _pending = self.memory(ep.actors)
                res["max_buffered_bytes"] = max(res["max_buffered_bytes"], buffered)
            time.sleep(max(0.0, quiet_until - time.monotonic()))
        finally:
            ep.stop()
            res.update(other.stop(log))
        res.update(self.final_files(job))
        res["faults"] = faults
        res["recovery"] = recovery_ratios(faults, res["other_job_checkpoint_ms"], window,
                                          heal)
        res["drift"] = drift(res["other_job_checkpoint_ms"], window)
        res["faults_by_kind"] = dict(res["faults_by_kind"])
        return res

    def final_files(self, job: str) -> dict[str, int]:
        return final_files(self.base, job, {u for sp in self.savepoints if sp.job == job
                                            for u in sp.files})

    def debug(self, actors: list[Any], log: Any) -> None:
        import ray

        log("    nodes: " + json.dumps([{k: s.get(k) for k in (
            "name", "pending_requests", "buffered_bytes", "in_flight_bytes",
            "writers", "children", "batch_triggers", "waits_for_late", "upload")}
            for s in self.live_status()]))
        for a in actors:
            try:
                d = ray.get(a.debug.remote(), timeout=10)
                stacks = d.pop("stacks")
                log(f"    subtask {json.dumps(d)}")
                for k, st in stacks.items():
                    if "dstl_ray" in st:
                        log(f"      thread {k}:\n{st}")
            except Exception as e2:  # noqa: BLE001
                log(f"    debug failed {e2}")


def schedules(kinds: list[str], faults: int, quick: bool, rng: random.Random
              ) -> list[list[str]]:
    """Quick: one episode per kind (each kind ``faults`` times). Full: episodes of mixed
    kinds, ``faults`` faults in all, every kind equally often, in a seeded random order."""
    if quick:
        return [[k] * faults for k in kinds]
    order = [kinds[i % len(kinds)] for i in range(faults)]
    rng.shuffle(order)
    size = max(len(kinds), 12)
    return [order[i:i + size] for i in range(0, len(order), size)]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--faults", type=int, default=0,
                   help="per storage (full) or per kind (quick); default 6 per kind / 2")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--storage", default="file,s3")
    p.add_argument("--schedule", default="",
                   help="one episode with exactly these faults, in order (a,b,c)")
    p.add_argument("--file-merging", default="none",
                   help="FLIP-306 mode for the file:// episodes (S3 keeps within at most)")
    p.add_argument("--window-s", type=float, default=None,
                   help="recovery latency windows before and after a measured fault "
                        "(default 30, quick 5; 0: measure only faults that happen to be "
                        "isolated, never wait)")
    p.add_argument("--hosts", type=int, default=0,
                   help="the chaos job on N hosts of their own, with partitions and host "
                        "losses: runs experiments.multihost (root)")
    chaos_skew.add_arguments(p)
    args = p.parse_args()
    if args.hosts:  # the same job between hosts: experiments.multihost drives it
        from . import multihost

        sys.argv = [multihost.__file__, "--hosts", str(args.hosts),
                    *(["--quick"] if args.quick else []), "--seed", str(args.seed),
                    "--out", args.out]
        multihost.main()
        return
    if chaos_skew.run_driver(args):  # a driver on a skewed clock, started by clock_skew
        return
    kinds = [k for k in args.kinds.split(",") if k]
    bad = set(kinds) - set(KINDS)
    if bad:
        raise SystemExit(f"unknown fault kinds {sorted(bad)}; known: {', '.join(KINDS)}")
    if args.window_s is None:
        args.window_s = 5.0 if args.quick else 30.0
    if args.window_s < 0:
        raise SystemExit(f"--window-s must be >= 0, got {args.window_s}")
    args.heal_s = TREE_WIDE_GRACE_S
    if "clock_skew" in kinds + args.schedule.split(","):
        chaos_skew.require_faketime()
    faults = args.faults or (2 if args.quick else 6 * len(KINDS))
    run(args, kinds, faults)


def run(args: Any, kinds: list[str], faults: int) -> None:
    import ray

    from dstl_ray import ChangelogConfig
    from dstl_ray.testing import start_local_cluster
    from dstl_ray.testing.s3server import LoopbackS3

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    cluster = start_local_cluster(3, 2, "chaos")
    episodes: list[dict[str, Any]] = []
    run_totals: dict[str, Any] = {"savepoints_read_back": 0, "savepoints_unreadable": 0,
                                  "savepoints_unreadable_examples": []}
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[chaos {time.time() - t0:6.1f}s] {msg}", flush=True)

    try:
        for storage in args.storage.split(","):
            # the S3 server in a process of its own: in this one it would share the GIL with
            # the driver's threads, and a busy driver stalled the other job's uploads past
            # their timeout (a decline no fault of ours had caused)
            s3 = LoopbackS3(process=True).start() if storage == "s3" else None
            try:
                # loopback S3 answers a PUT in ~10-50 ms, but on 2 busy cores a request can
                # wait a second for its server: the tighter file:// timeout would turn that
                # into the other job's declines
                opts: dict[str, Any] = dict(upload_timeout_s=1.0 if storage == "s3" else 0.5,
                                            retry_delay_s=0.05,
                                            membership_interval_s=1.0, persist_max_wait_s=0.1)
                if args.file_merging != "none":  # across is refused on object stores
                    opts["file_merging"] = ("within_checkpoint" if storage == "s3"
                                            and args.file_merging == "across_checkpoints"
                                            else args.file_merging)
                env: dict[str, str] = {}
                if s3 is not None:
                    base = s3.url("chaos")
                    opts.update(s3.config_options())
                    env = s3.env()
                    os.environ.update(env)
                else:
                    base = f"file://{work}/dfs"
                ns = f"chaos-{storage}"
                # node actors import dstl_ray.testing: its fault injection serves set_faults
                config = ChangelogConfig(namespace=ns, plugins="dstl_ray.testing", **opts)
                h = Harness(cluster, base, ns, config, env, rng,
                            args.seed, quick=args.quick, window_s=args.window_s)
                try:
                    plan = ([args.schedule.split(",")] if args.schedule
                            else schedules(kinds, faults, args.quick, rng))
                    if args.quick and storage == "s3":  # S3: the DFS kinds, mixed
                        plan = [[k for k in kinds if k.startswith("dfs_")] or kinds[:1]]
                    for i, schedule in enumerate(plan):
                        job = f"{storage}-{i}-" + ("-".join(sorted(set(schedule)))
                                                   if len(set(schedule)) == 1 else "mixed")
                        log(f"episode {job}: {len(schedule)} faults on {storage}")
                        r = h.episode(job[:100].replace("_", "-"), schedule, log)
                        log(f"  -> {json.dumps(_brief(r))}")
                        episodes.append(r)
                    for k, v in h.peak_rss_kb.items():
                        for r in episodes:
                            if r["storage"] == base.split(":")[0]:
                                r[f"peak_rss_mb_{k}"] = round(v / 1024, 1)
                    back = read_back(h.savepoints, log)  # at the end: none was overwritten
                    for k, v in back.items():
                        run_totals[k] += v
                finally:
                    h.tree.shutdown()
            finally:
                if s3 is not None:
                    s3.stop()
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    report(args, episodes, time.time() - t0, run_totals)


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    """An episode's result without its long series (for the log)."""
    return {k: v for k, v in r.items() if k not in ("other_job_checkpoint_ms", "faults")}


if __name__ == "__main__":
    main()
