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
* ``big_request``: one subtask's persist request holds a single change of 10 MB.

Every episode runs a second job on the same tree (``Bystander``) checkpointing every 0.3 s
all along: DFS faults are aimed at the episode's job only (its path), and the other job must
see 0 declined checkpoints outside tree-wide faults (node kill, removal, stall, and 10 s after
them while the tree heals), lose nothing
and leak nothing (``other_job_*`` in the results).

A failover restores every subtask from the latest completed checkpoint and replays the rounds
after it. After every fault and every clean round: the live state equals the oracle, the
latest completed checkpoint restored from storage in the driver equals the oracle at its
round (changes lost = the sum of count differences, must be 0), and a checkpoint without
faults completes. At the end a new coordinator cleans up and storage must hold exactly the
retained checkpoints' files (leaked and missing, must be 0). Peak RSS of node actors and
subtasks is recorded; node buffers must be empty between rounds.

Run: python -m experiments.chaos [--quick] [--seed N] [--faults N] [--kinds a,b] [--storage
file,s3]. Writes experiments/results/chaos.json (+ .png).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import machine, parser, plt, write_results

KINDS = ("node_kill", "node_removal", "writer_kill", "dfs_5xx", "dfs_timeout", "dfs_slow",
         "dfs_torn", "lost_ack", "coordinator_restart", "rescale", "job_restart", "stall",
         "big_request")
FAILOVER = {"node_removal", "writer_kill", "coordinator_restart", "rescale", "job_restart"}
# faults that hit the whole tree, not one job: another job's checkpoints may fail meanwhile
TREE_WIDE = {"node_kill", "node_removal", "stall"}
TREE_WIDE_GRACE_S = 10.0  # after a tree-wide fault ended, other jobs may still see its effect
OP, MAXP, PAR, KEYS, UPDATES = "count", 128, 4, 2000, 400
BIG_REQUEST = 10 * 1024 * 1024 + 4096  # bytes of one subtask's request in ``big_request``


def subtask_keys(index: int) -> list[int]:
    from dstl_ray import assign_key_group
    from dstl_ray.keygroups import key_group_range_for_subtask

    kgr = key_group_range_for_subtask(MAXP, PAR, index)
    return [k for k in range(KEYS) if kgr.start <= assign_key_group(k, MAXP) <= kgr.end]


def round_keys(seed: int, index: int, rnd: int, keys: list[int]) -> list[int]:
    """The updates of subtask ``index`` in round ``rnd``: the same on every replay."""
    rng = random.Random(f"{seed}/{index}/{rnd}")
    return [rng.choice(keys) for _ in range(UPDATES)]


class Subtask:
    """One operator subtask at ``parallelism``: a backend counting keys; restored from
    ``restore_url``. The updates of a round are those of the ``PAR`` logical partitions the
    oracle knows, each applied by whichever subtask owns the key now (rescaling keeps them)."""

    def __init__(self, job: str, index: int, restore_url: str | None, namespace: str,
                 env: dict[str, str], incarnation: str = "", parallelism: int = PAR) -> None:
        os.environ.update(env)
        from dstl_ray import ChangelogKeyedStateBackend, StateChangelogClient, assign_key_group
        from dstl_ray.checkpoint.recovery import assign_sources, load_checkpoint
        from dstl_ray.keygroups import key_group_range_for_subtask

        self.index = index
        client = StateChangelogClient(job, namespace=namespace)
        sources = (assign_sources(load_checkpoint(restore_url), OP, parallelism)[index]
                   if restore_url else [])
        kgr = key_group_range_for_subtask(MAXP, parallelism, index)
        self.b = ChangelogKeyedStateBackend(client, OP, kgr, MAXP, restore=sources,
                                            materialization_interval=1.5,
                                            incarnation=incarnation)
        self.count = self.b.value_state("count")
        self.keys = [subtask_keys(i) for i in range(PAR)]
        self.mine = [{k for k in ks if kgr.start <= assign_key_group(k, MAXP) <= kgr.end}
                     for ks in self.keys]

    def apply(self, seed: int, rnd: int) -> int:
        n = 0
        for i, own in enumerate(self.mine):
            if own:
                for k in round_keys(seed, i, rnd, self.keys[i]):
                    if k in own:
                        self.count.update(k, self.count.value(k, 0) + 1)
                        n += 1
        return n

    def blob(self, nbytes: int) -> None:
        """A state change of ``nbytes`` (one value): the next persist request is that big
        (0: clear it again)."""
        blob = self.b.value_state("blob")
        key = min(k for own in self.mine for k in own)  # a key of this subtask's range
        if nbytes:
            blob.update(key, os.urandom(nbytes))
        else:
            blob.clear(key)

    def snapshot(self, checkpoint_id: int, watermark: int = -1) -> str:
        self.b.notify_checkpoint_subsumed(watermark)  # with the barrier, as Spark's tasks
        return json.dumps(self.b.snapshot(checkpoint_id).result(timeout=60).to_dict())

    def dump(self) -> dict[int, int]:
        return self.b.dump().get("count", {})

    def debug(self) -> dict[str, Any]:
        import sys
        import traceback

        t = self.b._writer._transport
        w = self.b._writer
        return {"index": self.index, "queue": len(getattr(t, "_queue", [])),
                "stale": getattr(t, "_stale", None), "node": getattr(t, "node_name", ""),
                "uploads": {s: (u.future.done(), u.preemptive) for s, u in w._uploads.items()},
                "stacks": {str(k): "".join(traceback.format_stack(f)[-6:])
                           for k, f in sys._current_frames().items()}}

    def rss_kb(self) -> int:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


class Oracle:
    """The expected counts after each round (cumulative)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.keys = [subtask_keys(i) for i in range(PAR)]
        self._after: dict[int, Counter] = {0: Counter()}

    def between(self, base: int, rnd: int) -> Counter:
        """The counts of a job (re)started from nothing after round ``base``."""
        return self.after(rnd) - self.after(base) if base else self.after(rnd)

    def after(self, rnd: int) -> Counter:
        if rnd not in self._after:
            c = Counter(self.after(rnd - 1))
            for i in range(PAR):
                c.update(round_keys(self.seed, i, rnd, self.keys[i]))
            self._after[rnd] = c
        return self._after[rnd]


@dataclass
class _Episode:
    """What a fault needs of the running episode."""

    job: str
    actors: Any  # () -> the live subtask actors
    checkpoint: Any  # (round, drop_acks=False) -> completed?
    failover: Any  # (new_coordinator, parallelism=None, restart=False) -> None
    parallelism: Any  # () -> the current parallelism


class Bystander:
    """Another job on the same tree, checkpointing all along an episode (design: "Many
    jobs, one tree"): faults aimed at the episode's job must never decline its checkpoints,
    lose its changes or touch its files. Declines while a tree-wide fault (a node killed,
    removed or stalled) is going on are not counted against isolation."""

    def __init__(self, harness: Any, job: str) -> None:
        from dstl_ray import CheckpointCoordinator

        self.h, self.job = harness, job
        self.seed = harness.seed + 1000
        self.coord = CheckpointCoordinator(job, harness.base, max_parallelism=MAXP, retained=2)
        self.actors = harness.start(job, None, str(self.coord.incarnation), parallelism=1)
        self.oracle = Oracle(self.seed)
        self.applied = 0
        self.completed = 0
        self.declines: list[tuple[float, float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bystander")
        self._thread.start()

    def _run(self) -> None:
        import ray

        from dstl_ray.checkpoint.snapshot import KeyedStateSnapshot

        while not self._stop.is_set():
            t0 = time.time()
            try:
                ray.get(self.actors[0].apply.remote(self.seed, self.applied + 1), timeout=60)
                self.applied += 1
                snap = ray.get(self.actors[0].snapshot.remote(
                    self.applied, self.coord.subsumed_watermark()), timeout=60)
                self.coord.complete_checkpoint(self.applied, [KeyedStateSnapshot.from_dict(
                    json.loads(snap), self.coord.base_path)])
                self.completed += 1
            except Exception as e:  # noqa: BLE001 - counted; a dead subtask is restored
                text = f"{type(e).__name__}: {e}"
                self.declines.append((t0, time.time(), text[:200] + " ... " + text[-600:]))
                if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)):
                    self.h.kill(self.actors)
                    latest = self.coord.latest_checkpoint()
                    self.actors = self.h.start(self.job, latest.metadata_url if latest else None,
                                               str(self.coord.incarnation), parallelism=1)
                    self.applied = latest.checkpoint_id if latest else 0
            self._stop.wait(0.3)

    def stop(self, log: Any) -> dict[str, Any]:
        import ray

        self._stop.set()
        self._thread.join(timeout=180)
        got = ray.get(self.actors[0].dump.remote(), timeout=120)
        lost = differences(got, self.oracle.after(self.applied))
        latest = self.coord.latest_checkpoint()
        if latest is not None:
            lost += differences(restore_in_driver(self.job, self.h.base, latest.metadata_url),
                                self.oracle.after(latest.checkpoint_id))
        self.h.kill(self.actors)
        self.coord.abandon()
        files = self.h.final_files(self.job)

        def tree_wide(t0: float, t1: float) -> bool:
            # a killed node actor is restarted by Ray, a removed node replaced: writers
            # re-resolve their node on the next request; allow that much after the fault
            return any(t0 < b + TREE_WIDE_GRACE_S and t1 > a - 1.0
                       for a, b in self.h.tree_wide)

        counted = [d for d in self.declines if not tree_wide(d[0], d[1])]
        for d in counted:
            log(f"    OTHER JOB declined: {d[2]}")
        return {"other_job_checkpoints": self.completed,
                "other_job_declines": len(counted),
                "other_job_declines_tree_wide": len(self.declines) - len(counted),
                "other_job_lost": lost, "other_job_leaked_files": files["leaked_files"],
                "other_job_missing_files": files["missing_files"]}


def differences(got: dict[int, int], want: Counter) -> int:
    return sum(abs(got.get(k, 0) - want.get(k, 0)) for k in set(got) | set(want))


class Harness:
    """One cluster and one tree per storage; episodes run jobs with faults on them."""

    def __init__(self, cluster: Any, base: str, namespace: str, config: Any,
                 env: dict[str, str], rng: random.Random, seed: int) -> None:
        import ray

        from dstl_ray import deploy

        self.cluster, self.base, self.ns, self.env = cluster, base, namespace, env
        self.rng, self.seed = rng, seed
        self.tree = deploy(base, config, detached=False)
        self.actor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)(Subtask)
        self.peak_rss_kb = {"node_actors": 0, "subtasks": 0}
        self._removed: list[str] = []  # node ids removed from the cluster
        self.tree_wide: list[tuple[float, float]] = []  # when tree-wide faults went on

    # ------------------------------------------------------------------ job

    def start(self, job: str, restore: str | None, incarnation: str = "",
              parallelism: int = PAR) -> list[Any]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for attempt in range(3):
            nodes = sorted(n["NodeID"] for n in ray.nodes()
                           if n["Alive"] and n["NodeID"] not in self._removed)
            actors = [self.actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                nodes[(i + 1) % len(nodes)], soft=True)).remote(job, i, restore, self.ns,
                                                                 self.env, incarnation,
                                                                 parallelism)
                for i in range(parallelism)]
            try:
                ray.get([a.rss_kb.remote() for a in actors], timeout=120)
                return actors
            except Exception:  # noqa: BLE001 - placed on a node that just went away
                self.kill(actors)
                if attempt == 2:
                    raise
                time.sleep(1.0)
        raise AssertionError("unreachable")

    def kill(self, actors: list[Any]) -> None:
        import ray

        for a in actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already dead
                pass

    def live_status(self) -> list[dict[str, Any]]:
        return [s for s in self.tree.status() if "error" not in s]

    def node_names(self) -> list[str]:
        return sorted(s["name"] for s in self.live_status())

    def set_faults(self, spec: str) -> None:
        import ray

        for name in self.node_names():
            try:
                ray.get(self.tree.node(name).set_fault_spec.remote(spec), timeout=30)
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

    def episode(self, job: str, schedule: list[str], log: Any) -> dict[str, Any]:
        import ray

        from dstl_ray import CheckpointCoordinator, CheckpointRetention
        from dstl_ray.checkpoint.snapshot import KeyedStateSnapshot

        def coordinator() -> Any:
            return CheckpointCoordinator(
                job, self.base, max_parallelism=MAXP, retained=2,
                retention=CheckpointRetention.DELETE_ON_CANCELLATION)

        oracle = Oracle(self.seed)
        other = Bystander(self, job + "-other")
        coord = coordinator()
        actors = self.start(job, None, str(coord.incarnation))
        res: dict[str, Any] = {"job": job, "storage": self.base.split(":")[0],
                               "faults_by_kind": Counter(), "recoveries": 0,
                               "checkpoints_completed": 0, "checkpoints_declined": 0,
                               "changes_verified": 0, "changes_lost": 0,
                               "clean_checkpoint_failures": 0, "clean_checkpoint_retries": 0,
                               "max_buffered_bytes": 0, "parallelisms": [PAR]}
        applied = 0  # rounds applied to the live subtasks
        base = 0  # the round after which the job last started from nothing (job_restart)
        par = PAR

        def apply_to(rnd: int) -> None:
            nonlocal applied
            while applied < rnd:
                applied += 1
                ray.get([a.apply.remote(self.seed, applied) for a in actors], timeout=120)

        def checkpoint(rnd: int, drop_acks: bool = False) -> bool:
            cid = rnd - base  # a restarted job numbers its checkpoints from 1 again
            try:
                wm = coord.subsumed_watermark()
                snaps = ray.get([a.snapshot.remote(cid, wm) for a in actors], timeout=120)
            except Exception as e:  # noqa: BLE001 - declined: writers keep their changes
                log(f"    checkpoint {cid} declined: {type(e).__name__}: {str(e)[:120]}")
                if "Timeout" in type(e).__name__ or "TimeoutError" in str(e)[:300]:
                    self._debug(actors, log)
                res["checkpoints_declined"] += 1
                return False
            if drop_acks:
                res["checkpoints_declined"] += 1
                return False
            coord.complete_checkpoint(cid, [KeyedStateSnapshot.from_dict(
                json.loads(s), coord.base_path) for s in snaps])
            res["checkpoints_completed"] += 1
            return True

        def failover(new_coordinator: bool, parallelism: int | None = None,
                     restart: bool = False) -> None:
            nonlocal actors, applied, coord, base, par
            self.kill(actors)
            if restart:  # cancelled (DELETE_ON_CANCELLATION) and started under the same id
                coord.shutdown(cancel=True)
                coord = coordinator()
                base = applied
            elif new_coordinator:
                coord.abandon()  # the driver dies with its subtasks
                coord = coordinator()
            if restart or new_coordinator:
                coord.restore(None, OP, 0)  # load retained checkpoints, clean orphans
            par = parallelism or par
            res["parallelisms"].append(par)
            latest = coord.latest_checkpoint()
            actors = self.start(job, latest.metadata_url if latest else None,
                                str(coord.incarnation), par)
            applied = base + (latest.checkpoint_id if latest else 0)
            res["recoveries"] += 1

        def verify(where: str) -> None:
            got: dict[int, int] = {}
            for d in ray.get([a.dump.remote() for a in actors], timeout=120):
                got.update(d)
            lost = differences(got, oracle.between(base, applied))
            latest = coord.latest_checkpoint()
            if latest is not None:
                restored = restore_in_driver(job, self.base, latest.metadata_url)
                want = oracle.between(base, base + latest.checkpoint_id)
                lost += differences(restored, want)
                res["changes_verified"] += sum(want.values())
            res["changes_lost"] += lost
            if lost:
                log(f"    LOST {lost} changes ({where})")

        ctx = _Episode(job, actors=lambda: actors, checkpoint=checkpoint, failover=failover,
                       parallelism=lambda: par)
        rnd = 0
        try:
            for kind in schedule:
                rnd += 1
                apply_to(rnd)
                res["faults_by_kind"][kind] += 1
                log(f"  round {rnd}: {kind}")
                t0 = time.time()
                self.inject(kind, rnd, ctx)
                if kind in TREE_WIDE:  # another job may fail meanwhile
                    self.tree_wide.append((t0, time.time() + 1.0))
                apply_to(rnd)
                verify(f"after {kind}")
                rnd += 1  # a round without faults: a checkpoint must complete soon (as in
                apply_to(rnd)  # Flink, a declined one is followed by the next trigger)
                for _attempt in range(20):
                    if checkpoint(rnd):
                        break
                    res["clean_checkpoint_retries"] += 1
                    time.sleep(0.5)
                else:
                    res["clean_checkpoint_failures"] += 1
                verify("clean round")
                buffered, _pending = self.memory(actors)
                res["max_buffered_bytes"] = max(res["max_buffered_bytes"], buffered)
        finally:
            self.kill(actors)
            coord.abandon()
            res.update(other.stop(log))
        res.update(self.final_files(job))
        res["faults_by_kind"] = dict(res["faults_by_kind"])
        return res

    def final_files(self, job: str) -> dict[str, int]:
        """A new coordinator cleans up; storage must hold exactly the retained files."""
        from dstl_ray import CheckpointCoordinator

        final = CheckpointCoordinator(job, self.base, max_parallelism=MAXP, retained=2)
        final.restore(None, OP, 0)
        keep = {u for c in final.completed_checkpoints() for u in c.files.values()}
        keep |= {c.metadata_url for c in final.completed_checkpoints()} | {final.lease.url}
        have = set(list_job_files(self.base, job))
        final.shutdown()
        return {"leaked_files": len(have - keep), "missing_files": len(keep - have)}

    def _debug(self, actors: list[Any], log: Any) -> None:
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

    # ------------------------------------------------------------------ faults

    def inject(self, kind: str, rnd: int, ep: _Episode) -> None:
        import ray

        rng = self.rng
        actors, checkpoint, failover = ep.actors(), ep.checkpoint, ep.failover
        during = rng.random() < 0.5  # before the checkpoint, or while it runs
        if kind.startswith("dfs_"):
            n = rng.choice([1, 2, 3, 3])  # 3 = every attempt of an upload fails
            script = {"dfs_5xx": ["5xx"] * n, "dfs_timeout": ["timeout"] * n,
                      "dfs_torn": ["torn"] * n, "dfs_slow": [f"slow:{rng.uniform(0.1, 0.4):.2f}"]}
            # aimed at this job's changelog files only: other jobs on the tree never notice
            self.set_faults(json.dumps({"script": script[kind], "match": f"/{ep.job}/",
                                        "hang_s": 1.0, "seed": rnd}))
            try:
                checkpoint(rnd)
            finally:
                self.set_faults("")
            return
        if kind == "lost_ack":
            checkpoint(rnd, drop_acks=True)
            return
        if kind == "coordinator_restart":
            # dies before writing the metadata (the checkpoint never completes), or right
            # after completing it
            checkpoint(rnd, drop_acks=during)
            failover(new_coordinator=True)
            return
        if kind == "rescale":  # restored at another parallelism (by a new driver, or not)
            checkpoint(rnd)
            failover(new_coordinator=during, parallelism=rng.choice(
                [p for p in (2, 3, 6, 8) if p != ep.parallelism()]))
            return
        if kind == "job_restart":  # cancelled with DELETE_ON_CANCELLATION, same id again
            checkpoint(rnd)
            failover(new_coordinator=True, restart=True)
            return
        if kind == "big_request":  # one subtask's persist request is >= 10 MB
            a = rng.choice(actors)
            ray.get(a.blob.remote(BIG_REQUEST), timeout=120)
            checkpoint(rnd)
            ray.get(a.blob.remote(0), timeout=120)
            return
        if kind == "stall":
            self._stall(rng.uniform(1.0, 4.0), lambda: checkpoint(rnd))
            return
        victim = self._victim(kind, actors)
        if during:
            t = threading.Timer(rng.uniform(0.0, 0.03), victim)
            t.start()
            checkpoint(rnd)
            t.join()
        else:
            victim()
            time.sleep(0.2)
            checkpoint(rnd)
        if kind == "node_removal":
            self._replace_node()
        if kind in FAILOVER:
            failover(new_coordinator=False)

    def _stall(self, seconds: float, work: Any) -> None:
        """Pause an ancestor node actor's process (SIGSTOP) for ``seconds`` while ``work``
        runs: its children's deadlines pass, they flush themselves, and the ancestor, once
        it runs again, must write nothing for them (or release what it wrote)."""
        ancestors = [s for s in self.live_status() if s.get("children") and s.get("pid")]
        if not ancestors:
            work()
            return
        victim = self.rng.choice(ancestors)
        os.kill(victim["pid"], signal.SIGSTOP)
        resume = threading.Timer(seconds, os.kill, (victim["pid"], signal.SIGCONT))
        resume.start()
        try:
            work()
        finally:
            resume.cancel()
            os.kill(victim["pid"], signal.SIGCONT)

    def _victim(self, kind: str, actors: list[Any]) -> Any:
        import ray

        rng = self.rng
        if kind == "node_kill":
            name = rng.choice(self.node_names())
            return lambda: ray.kill(self.tree.node(name), no_restart=False)
        if kind == "writer_kill":
            a = rng.choice(actors)
            return lambda: ray.kill(a)
        # node_removal: a worker node (never the head), replaced by a fresh one
        node = rng.choice(sorted(self.cluster.worker_nodes,
                                 key=lambda n: getattr(n, "unique_id", "")))

        def remove() -> None:  # (the replacement joins from the main thread: _replace_node)
            self._removed.append(node.unique_id)
            self.cluster.remove_node(node, allow_graceful=False)

        return remove

    def _replace_node(self) -> None:
        """A fresh node joins; wait until Ray has declared the removed ones dead."""
        import ray

        self.cluster.add_node(num_cpus=2)
        self.cluster.wait_for_nodes()
        deadline = time.monotonic() + 120
        while any(n["Alive"] for n in ray.nodes() if n["NodeID"] in self._removed):
            if time.monotonic() > deadline:
                raise RuntimeError("a removed node is still alive after 120 s")
            time.sleep(0.5)


def restore_in_driver(job: str, base: str, metadata_url: str) -> dict[int, int]:
    """The counts of a checkpoint, restored from storage in this process."""
    from dstl_ray import ChangelogKeyedStateBackend, DirectTransport, StateChangelogClient
    from dstl_ray.checkpoint.recovery import assign_sources, load_checkpoint
    from dstl_ray.keygroups import KeyGroupRange

    client = StateChangelogClient(job, transport=DirectTransport(job, base))
    b = ChangelogKeyedStateBackend(client, OP, KeyGroupRange(0, MAXP - 1), MAXP,
                                   restore=assign_sources(load_checkpoint(metadata_url), OP,
                                                          1)[0],
                                   materialization_interval=None)
    try:
        return b.dump().get("count", {})
    finally:
        b.close()


def list_job_files(base: str, job: str) -> list[str]:
    from dstl_ray.storage.base import join
    from dstl_ray.storage.registry import get_storage

    path = join(base, job)
    return get_storage(path).list_files(path)


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
                   help="per storage (full) or per kind (quick); default 54 / 2")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--storage", default="file,s3")
    p.add_argument("--schedule", default="",
                   help="one episode with exactly these faults, in order (a,b,c)")
    p.add_argument("--file-merging", default="none",
                   help="FLIP-306 mode for the file:// episodes (S3 keeps within at most)")
    args = p.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    bad = set(kinds) - set(KINDS)
    if bad:
        raise SystemExit(f"unknown fault kinds {sorted(bad)}; known: {', '.join(KINDS)}")
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
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[chaos {time.time() - t0:6.1f}s] {msg}", flush=True)

    try:
        for storage in args.storage.split(","):
            s3 = LoopbackS3().start() if storage == "s3" else None
            try:
                opts: dict[str, Any] = dict(upload_timeout_s=0.5, retry_delay_s=0.05,
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
                h = Harness(cluster, base, ns, ChangelogConfig(namespace=ns, **opts), env, rng,
                            args.seed)
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
                        log(f"  -> {json.dumps(r)}")
                        episodes.append(r)
                    for k, v in h.peak_rss_kb.items():
                        for r in episodes:
                            if r["storage"] == base.split(":")[0]:
                                r[f"peak_rss_mb_{k}"] = round(v / 1024, 1)
                finally:
                    h.tree.shutdown()
            finally:
                if s3 is not None:
                    s3.stop()
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    report(args, episodes, time.time() - t0)


def report(args: Any, episodes: list[dict[str, Any]], seconds: float) -> None:
    by_kind: Counter = Counter()
    for r in episodes:
        by_kind.update(r["faults_by_kind"])
    totals = {k: sum(r[k] for r in episodes) for k in (
        "recoveries", "checkpoints_completed", "checkpoints_declined", "changes_verified",
        "changes_lost", "leaked_files", "missing_files", "clean_checkpoint_failures",
        "clean_checkpoint_retries", "other_job_checkpoints", "other_job_declines",
        "other_job_declines_tree_wide", "other_job_lost", "other_job_leaked_files",
        "other_job_missing_files")}
    data = {"seed": args.seed, "quick": args.quick, "seconds": round(seconds, 1),
            "faults_injected": sum(by_kind.values()), "faults_by_kind": dict(by_kind),
            **totals,
            "peak_rss_mb": {k: max((r.get(f"peak_rss_mb_{k}", 0) for r in episodes),
                                   default=0) for k in ("node_actors", "subtasks")},
            "max_buffered_bytes_between_rounds": max((r["max_buffered_bytes"]
                                                      for r in episodes), default=0),
            "episodes": episodes, "machine": machine(),
            "command": " ".join(["python -m experiments.chaos", *sys.argv[1:]])}
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(8, 4))
    kinds = sorted(by_kind)
    ax.bar(kinds, [by_kind[k] for k in kinds])
    ax.set(ylabel="faults injected", title=f"chaos: {data['faults_injected']} faults, "
           f"{totals['changes_verified']:,} changes verified, {totals['changes_lost']} lost, "
           f"{totals['leaked_files']} leaked files")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    write_results("chaos", data, fig, args.out)
    print(f"[chaos] other job: {totals['other_job_checkpoints']} checkpoints, "
          f"{totals['other_job_declines']} declined", flush=True)
    print(f"[chaos] {data['faults_injected']} faults, {totals['recoveries']} recoveries, "
          f"{totals['checkpoints_completed']} checkpoints, {totals['changes_verified']:,} "
          f"changes verified, {totals['changes_lost']} lost, {totals['leaked_files']} leaked, "
          f"{totals['missing_files']} missing", flush=True)
    if (totals["changes_lost"] or totals["leaked_files"] or totals["missing_files"]
            or totals["clean_checkpoint_failures"] or totals["other_job_declines"]
            or totals["other_job_lost"] or totals["other_job_leaked_files"]
            or totals["other_job_missing_files"]):
        raise SystemExit("chaos FAILED")


if __name__ == "__main__":
    main()
