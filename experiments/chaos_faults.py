"""The fault injections of ``experiments.chaos``: what each fault kind does to the tree, the
storage and the episode's job (:class:`experiments.chaos_episode.Episode`). The kinds are
listed in the docstring of ``experiments.chaos``; ``clock_skew`` lives in
``experiments.chaos_skew``.

Every injection works at the episode's current round (``ep.rnd``, applied to the subtasks
before the fault) and may go further: a fault that lasts (``long_stall``, ``clock_skew``)
keeps the job running rounds and checkpoints while it is under way.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

from dstl_ray.checkpoint.recovery import SAVEPOINT_MARKER as MARKER

from .chaos_episode import Episode
from .chaos_job import BIG_REQUEST, FAILOVER, OP, Savepoint, differences, dump_local
from .chaos_skew import clock_skew

LONG_STALL_S = (10.0, 30.0)  # how long ``long_stall`` pauses a receiver (quick: the least)


def inject(h: Any, kind: str, ep: Episode) -> None:
    """Inject one fault of ``kind`` into the episode ``ep`` run by harness ``h``."""
    import ray

    rng, rnd = h.rng, ep.rnd
    during = rng.random() < 0.5  # before the checkpoint, or while it runs
    if kind.startswith("dfs_"):
        n = rng.choice([1, 2, 3, 3])  # 3 = every attempt of an upload fails
        script = {"dfs_5xx": ["5xx"] * n, "dfs_timeout": ["timeout"] * n,
                  "dfs_torn": ["torn"] * n, "dfs_slow": [f"slow:{rng.uniform(0.1, 0.4):.2f}"]}
        # aimed at this job's changelog files only: other jobs on the tree never notice
        h.set_faults(json.dumps({"script": script[kind], "match": f"/{ep.job}/",
                                 "hang_s": 2 * h.config.upload_timeout_s, "seed": rnd}))
        try:
            ep.checkpoint(rnd)
        finally:
            h.set_faults("")
        return
    if kind == "lost_ack":
        ep.checkpoint(rnd, drop_acks=True)
        return
    if kind == "coordinator_restart":
        # dies before writing the metadata (the checkpoint never completes), or right
        # after completing it
        ep.checkpoint(rnd, drop_acks=during)
        ep.failover(new_coordinator=True)
        return
    if kind == "rescale":  # restored at another parallelism (by a new driver, or not)
        ep.checkpoint(rnd)
        ep.failover(new_coordinator=during, parallelism=other_parallelism(h, ep))
        return
    if kind == "job_restart":  # cancelled with DELETE_ON_CANCELLATION, same id again
        ep.checkpoint(rnd)
        ep.failover(new_coordinator=True, restart=True)
        return
    if kind == "big_request":  # one subtask's persist request is >= 10 MB
        a = rng.choice(ep.actors)
        ray.get(a.blob.remote(BIG_REQUEST), timeout=120)
        ep.checkpoint(rnd)
        ray.get(a.blob.remote(0), timeout=120)
        return
    if kind == "stall":
        stall(h, rng.uniform(1.0, 4.0), lambda: ep.checkpoint(rnd))
        return
    if kind == "long_stall":
        long_stall(h, ep, LONG_STALL_S[0] if h.quick else rng.uniform(*LONG_STALL_S))
        return
    if kind == "savepoint_cycle":
        savepoint_cycle(h, ep)
        return
    if kind == "clock_skew":
        clock_skew(h, ep)
        return
    victim = _victim(h, kind, ep.actors)
    if during:
        t = threading.Timer(rng.uniform(0.0, 0.03), victim)
        t.start()
        ep.checkpoint(rnd)
        t.join()
    else:
        victim()
        time.sleep(0.2)
        ep.checkpoint(rnd)
    if kind == "node_removal":
        _replace_node(h)
    if kind in FAILOVER:
        ep.failover(new_coordinator=False)


def other_parallelism(h: Any, ep: Episode) -> int:
    return h.rng.choice([p for p in (2, 3, 6, 8) if p != ep.par])


# ---------------------------------------------------------------------- stalls


def stall(h: Any, seconds: float, work: Any) -> None:
    """Pause an ancestor node actor's process (SIGSTOP) for ``seconds`` while ``work``
    runs: its children's deadlines pass, they flush themselves, and the ancestor, once
    it runs again, must write nothing for them (or release what it wrote)."""
    ancestors = [s for s in h.live_status() if s.get("children") and s.get("pid")]
    if not ancestors:
        work()
        return
    victim = h.rng.choice(ancestors)
    os.kill(victim["pid"], signal.SIGSTOP)
    resume = threading.Timer(seconds, os.kill, (victim["pid"], signal.SIGCONT))
    resume.start()
    try:
        work()
    finally:
        resume.cancel()
        os.kill(victim["pid"], signal.SIGCONT)


def long_stall(h: Any, ep: Episode, seconds: float) -> None:
    """A receiver stalls for ``seconds`` (10-30 s: a long GC pause, SIGSTOP, a blocking
    call): a node actor that children forward to, preferably the parent of the nodes the
    writers use, is paused while the job keeps checkpointing, then resumed. Lateness within
    the caller's deadline is fine; nothing may be lost, leaked or missing, and once it runs
    again a checkpoint completes (docs/architecture.md "Failures"). The checkpoints taken
    while it was paused are counted (``long_stall_checkpoints`` / ``_declines``)."""
    status = h.live_status()
    by_name = {s["name"]: s for s in status}
    ancestors = [s for s in status if s.get("children") and s.get("pid")]
    parents = [s for s in ancestors
               if any(by_name.get(c, {}).get("writers") for c in s["children"])]
    if not ancestors:
        ep.checkpoint(ep.rnd)
        return
    victim = h.rng.choice(parents or ancestors)
    pid = victim["pid"]
    ep.log(f"    SIGSTOP {victim['name']} (pid {pid}) for {seconds:.1f} s")
    os.kill(pid, signal.SIGSTOP)
    until = time.monotonic() + seconds
    resume = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
    resume.start()
    completed = declined = 0
    try:
        ok = ep.checkpoint(ep.rnd)
        while True:
            completed, declined = completed + ok, declined + (not ok)
            if time.monotonic() >= until:
                break
            time.sleep(min(1.0, max(0.0, until - time.monotonic())))
            if time.monotonic() >= until:
                break
            ok = ep.advance()
    finally:
        resume.join()  # never resumed early: the receiver stays paused its full time
        os.kill(pid, signal.SIGCONT)
    ep.count("long_stall_checkpoints", completed)
    ep.count("long_stall_declines", declined)


# ---------------------------------------------------------------------- savepoints


def savepoint_cycle(h: Any, ep: Episode) -> None:
    """Savepoint, cancel, restore from the savepoint at another parallelism.

    The job checkpoints and stops; a new driver (retention alternating between
    DELETE_ON_CANCELLATION and RETAIN_ON_CANCELLATION over the run) restores it in this
    process, takes a savepoint (``CheckpointCoordinator.trigger_savepoint``) and cancels it:
    with DELETE_ON_CANCELLATION the retained checkpoints go, never the savepoint. Then
    another new driver restores the job from that savepoint and starts its subtasks at
    another parallelism. Every savepoint is kept in ``h.savepoints`` with the counts it was
    taken with, and read back at the end of the run (FLINK-5053; docs/architecture.md
    "Checkpoint lifecycle")."""
    from dstl_ray import CheckpointRetention, StateChangelogClient

    ep.checkpoint(ep.rnd)
    h.savepoint_cycles += 1
    retention = (CheckpointRetention.DELETE_ON_CANCELLATION if h.savepoint_cycles % 2
                 else CheckpointRetention.RETAIN_ON_CANCELLATION)
    h.kill(ep.actors)
    ep.coord.shutdown()  # the job stops; its next driver takes the savepoint
    driver = ep.coordinator(retention)
    backends = driver.restore(StateChangelogClient(ep.job, namespace=h.ns), OP,
                              h.rng.choice([1, 2]), materialization_interval=None)
    latest = driver.latest_checkpoint()
    rounds = latest.checkpoint_id if latest else 0
    want = ep.want(rounds)
    lost = differences(dump_local(backends), want)
    ep.res["changes_lost"] += lost
    ep.res["changes_verified"] += sum(want.values())
    if lost:
        ep.log(f"    LOST {lost} changes (restored for a savepoint)")
    try:
        sp = driver.trigger_savepoint().result(timeout=300)
    except Exception as e:  # noqa: BLE001 - counted; the job goes on from its checkpoint
        ep.count("savepoints_failed")
        ep.log(f"    savepoint failed: {type(e).__name__}: {str(e)[:300]}")
        driver.shutdown()  # not cancelled: the job goes on from its latest checkpoint
        ep.coord = driver
        ep.failover(new_coordinator=True)
        return
    # the savepoint's directory is the user's whole: its marker too (it was counted leaked)
    files = frozenset(sp.files.values()) | {sp.metadata_url,
                                            sp.metadata_url.rsplit("/", 1)[0] + "/" + MARKER}
    h.savepoints.append(Savepoint(ep.job, sp.metadata_url, dict(want), files))
    ep.count("savepoints_taken")
    retained = [c.metadata_url for c in driver.completed_checkpoints()]
    driver.shutdown(cancel=True)
    _check_cancel(h, ep, retention, retained, files)
    ep.coord = ep.coordinator()
    ep.coord.restore(None, OP, 0, checkpoint=sp.metadata_url)
    ep.start(sp.metadata_url, rounds, other_parallelism(h, ep), foreign=True)
    ep.log(f"    savepoint {sp.metadata_url} ({retention.value}), restored at {ep.par}")


def _check_cancel(h: Any, ep: Episode, retention: Any, retained: list[str],
                  savepoint_files: frozenset[str]) -> None:
    """After a cancel: DELETE_ON_CANCELLATION deleted every retained checkpoint's metadata,
    RETAIN_ON_CANCELLATION none; the savepoint's files are all there in both modes."""
    from dstl_ray import CheckpointRetention
    from dstl_ray.storage.registry import get_storage

    storage = get_storage(h.base)
    delete = retention is CheckpointRetention.DELETE_ON_CANCELLATION
    wrong = [u for u in retained if storage.exists(u) == delete]
    gone = [u for u in savepoint_files if not storage.exists(u)]
    if wrong or gone:
        ep.count("cancel_problems", len(wrong) + len(gone))
        ep.log(f"    CANCEL ({retention.value}): checkpoints {'kept' if delete else 'gone'}: "
               f"{wrong[:3]}, savepoint files gone: {sorted(gone)[:3]}")


# ---------------------------------------------------------------------- kills and removals


def _victim(h: Any, kind: str, actors: list[Any]) -> Any:
    import ray

    rng = h.rng
    if kind == "node_kill":
        name = rng.choice(h.node_names())
        return lambda: ray.kill(h.tree.node(name), no_restart=False)
    if kind == "writer_kill":
        a = rng.choice(actors)
        return lambda: ray.kill(a)
    # node_removal: a worker node (never the head), replaced by a fresh one
    node = rng.choice(sorted(h.cluster.worker_nodes, key=lambda n: getattr(n, "unique_id", "")))

    def remove() -> None:  # (the replacement joins from the main thread: _replace_node)
        h.removed.append(node.unique_id)
        h.cluster.remove_node(node, allow_graceful=False)

    return remove


def _replace_node(h: Any) -> None:
    """A fresh node joins; wait until Ray has declared the removed ones dead."""
    import ray

    h.cluster.add_node(num_cpus=2)
    h.cluster.wait_for_nodes()
    deadline = time.monotonic() + 120
    while any(n["Alive"] for n in ray.nodes() if n["NodeID"] in h.removed):
        if time.monotonic() > deadline:
            raise RuntimeError("a removed node is still alive after 120 s")
        time.sleep(0.5)
