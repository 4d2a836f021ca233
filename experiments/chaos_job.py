"""The job under chaos (``experiments.chaos``): subtasks counting keys in Ray actors, the
oracle of what they must hold after any round, the other job sharing the tree (``Bystander``)
and the fault kinds' names.

A job is ``PAR`` logical partitions of a replayable source: round ``r`` applies the same
updates on every replay (:func:`round_keys`), each by whichever subtask owns the key now, so
rescaling keeps them. The same rounds can be applied to backends in the driver
(:func:`apply_local`), which is how a savepoint's driver and a takeover driver on a skewed
clock continue the job.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KINDS = ("node_kill", "node_removal", "writer_kill", "dfs_5xx", "dfs_timeout", "dfs_slow",
         "dfs_torn", "lost_ack", "coordinator_restart", "rescale", "job_restart", "stall",
         "big_request", "clock_skew", "savepoint_cycle", "long_stall")
# the kinds of a job's life (docs/architecture.md "A job's life"): each gets quiet windows
# around it for the recovery latency ratio, also in quick runs
LIFE_KINDS = ("clock_skew", "savepoint_cycle", "long_stall")
FAILOVER = {"node_removal", "writer_kill", "coordinator_restart", "rescale", "job_restart",
            "savepoint_cycle"}
# faults that hit the whole tree, not one job: another job's checkpoints may fail meanwhile
TREE_WIDE = {"node_kill", "node_removal", "stall", "long_stall"}
TREE_WIDE_GRACE_S = 10.0  # after a tree-wide fault ended, other jobs may still see its effect
LEASE_TTL_S = 6.0  # the coordinators' lease: a takeover after a driver's crash stays fast;
# below this, on 2 busy cores, a renewal waiting for S3 could miss its 0.8 TTL and fence a
# healthy driver (every later checkpoint of the episode declined)
OP, MAXP, PAR, KEYS, UPDATES = "count", 128, 4, 2000, 400
BIG_REQUEST = 10 * 1024 * 1024 + 4096  # bytes of one subtask's request in ``big_request``


@dataclass(frozen=True)
class Savepoint:
    """A savepoint taken under chaos: read back at the end of the run against ``want`` (the
    counts it was taken with); ``files`` (its part files and metadata) stay the user's, so
    the final check of the job directory counts them as kept."""

    job: str
    url: str
    want: dict[int, int]
    files: frozenset[str]


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
    oracle knows, each applied by whichever subtask owns the key now (rescaling keeps them).
    ``foreign``: ``restore_url`` is a savepoint (docs/architecture.md "Checkpoint lifecycle":
    materialized away before the first checkpoint)."""

    def __init__(self, job: str, index: int, restore_url: str | None, namespace: str,
                 env: dict[str, str], incarnation: str = "", parallelism: int = PAR,
                 foreign: bool = False) -> None:
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
        if foreign and restore_url:  # restored from a savepoint: as the coordinator does for
            f = self.b.materialize(force=True)  # its own backends, the first checkpoint must
            if f is not None:  # not depend on files the job does not own
                f.result(timeout=300)
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
                "stale": getattr(t, "stale", None), "node": getattr(t, "node_name", ""),
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
        """(Built up round by round from the newest known: the other job of a full run's
        episode checkpoints thousands of rounds, too deep for recursion.)"""
        known = max(r for r in self._after if r <= rnd)
        for r in range(known + 1, rnd + 1):
            c = Counter(self._after[r - 1])
            for i in range(PAR):
                c.update(round_keys(self.seed, i, r, self.keys[i]))
            self._after[r] = c
        got = self._after[rnd]
        if len(self._after) > 512:  # keep the recent rounds (older ones are rebuilt if asked)
            for r in [r for r in self._after if 0 < r < rnd - 256]:
                del self._after[r]
        return got


@dataclass


class Bystander:
    """Another job on the same tree, checkpointing all along an episode (design: "Many
    jobs, one tree"): faults aimed at the episode's job must never decline its checkpoints,
    lose its changes or touch its files. Declines while a tree-wide fault (a node killed,
    removed or stalled) is going on are not counted against isolation.

    Its checkpoints' latencies (snapshot and metadata, the apply before it left out), with
    when each started in seconds after ``origin`` (a ``time.monotonic()``), are the series
    the recovery latency ratio is taken from (``experiments.chaos_report``)."""

    def __init__(self, harness: Any, job: str, origin: float) -> None:
        from dstl_ray import CheckpointCoordinator

        self.h, self.job = harness, job
        self.seed = harness.seed + 1000
        self.coord = CheckpointCoordinator(job, harness.base, max_parallelism=MAXP, retained=2)
        self.actors = harness.start(job, None, str(self.coord.incarnation), parallelism=1)
        self.oracle = Oracle(self.seed)
        self.applied = 0
        self.completed = 0
        self.declines: list[tuple[float, float, str]] = []
        self.origin = origin
        self.latencies: list[tuple[float, float]] = []  # (started s after origin, ms)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bystander")
        self._thread.start()

    def _run(self) -> None:
        import ray

        from dstl_ray.state.snapshot import KeyedStateSnapshot

        while not self._stop.is_set():
            t0 = time.time()
            try:
                ray.get(self.actors[0].apply.remote(self.seed, self.applied + 1), timeout=60)
                self.applied += 1
                t1 = time.monotonic()
                snap = ray.get(self.actors[0].snapshot.remote(
                    self.applied, self.coord.subsumed_watermark()), timeout=60)
                self.coord.complete_checkpoint(self.applied, [KeyedStateSnapshot.from_dict(
                    json.loads(snap), self.coord.base_path)])
                self.latencies.append((round(t1 - self.origin, 3),
                                       round((time.monotonic() - t1) * 1000, 2)))
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
                "other_job_missing_files": files["missing_files"],
                "other_job_checkpoint_ms": [list(x) for x in self.latencies]}


def differences(got: dict[int, int], want: Counter) -> int:
    return sum(abs(got.get(k, 0) - want.get(k, 0)) for k in set(got) | set(want))


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


def kill_actors(actors: list[Any]) -> None:
    """Kill each of ``actors`` (one already dead is no error)."""
    import ray

    for a in actors:
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001 - already dead
            pass


@dataclass(frozen=True)
class Placement:
    """Where a harness puts a job's subtasks: subtask ``i`` on ``nodes()[(i + offset) %
    len]`` (``soft``: elsewhere if that node cannot take it), ready once each answers within
    ``timeout_s``; ``attempts`` placements in all, ``pause_s`` apart (a node that went away
    just then: the subtasks are killed and placed again)."""

    nodes: Callable[[], list[str]]
    offset: int = 0
    soft: bool = False
    attempts: int = 3
    timeout_s: float = 120.0
    pause_s: float = 1.0

    def start(self, actor: Any, job: str, restore: str | None, namespace: str,
              env: dict[str, str], incarnation: str, parallelism: int,
              foreign: bool) -> list[Any]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for attempt in range(self.attempts):
            nodes = self.nodes()
            actors = [actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                nodes[(i + self.offset) % len(nodes)], soft=self.soft)).remote(
                    job, i, restore, namespace, env, incarnation, parallelism, foreign)
                for i in range(parallelism)]
            try:
                ray.get([a.rss_kb.remote() for a in actors], timeout=self.timeout_s)
                return actors
            except Exception:  # noqa: BLE001 - placed on a node that just went away
                kill_actors(actors)
                if attempt == self.attempts - 1:
                    raise
                time.sleep(self.pause_s)
        raise AssertionError("unreachable")


def list_job_files(base: str, job: str) -> list[str]:
    from dstl_ray.storage.base import join
    from dstl_ray.storage.registry import get_storage

    path = join(base, job)
    return get_storage(path).list_files(path)




def final_files(base: str, job: str, kept: set[str] | frozenset[str] = frozenset()
                ) -> dict[str, int]:
    """A new coordinator cleans up; storage must hold exactly the retained checkpoints'
    files and ``kept`` (savepoints' files: the user's, never deleted)."""
    from dstl_ray import CheckpointCoordinator

    final = CheckpointCoordinator(job, base, max_parallelism=MAXP, retained=2)
    final.restore(None, OP, 0)
    keep = {u for c in final.completed_checkpoints() for u in c.files.values()}
    keep |= {c.metadata_url for c in final.completed_checkpoints()} | {final.lease.url}
    keep |= set(kept)
    have = set(list_job_files(base, job))
    final.shutdown()
    return {"leaked_files": len(have - keep), "missing_files": len(keep - have)}


def apply_local(backends: list[Any], seed: int, rnd: int) -> None:
    """Round ``rnd`` applied to ``backends`` in this process (any parallelism): each update
    by the backend whose key groups hold its key, as the subtasks do."""
    from dstl_ray import assign_key_group

    states = [(b.key_group_range, b.value_state("count")) for b in backends]
    for i in range(PAR):
        for k in round_keys(seed, i, rnd, subtask_keys(i)):
            kg = assign_key_group(k, MAXP)
            state = next(s for r, s in states if r.start <= kg <= r.end)
            state.update(k, state.value(k, 0) + 1)


def dump_local(backends: list[Any]) -> dict[int, int]:
    """The counts held by ``backends`` in this process."""
    out: dict[int, int] = {}
    for b in backends:
        out.update(b.dump().get("count", {}))
    return out
