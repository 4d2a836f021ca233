"""dstl-ray vs Flink's own changelog state backend on the same keyed count, side by side.

Flink: ``experiments/peers/flink_keyed_count.py`` under Flink's own virtual environment
(``$FLINK_VENV``, default ``~/.cache/dstl-ray/flink-venv``, created with ``apache-flink`` if
missing): ``INSERT INTO blackhole SELECT k, COUNT(*) FROM datagen GROUP BY k`` at 20,000
rows/s, parallelism 4, hashmap backend with the changelog on file://, checkpoints every
200 ms, on a MiniCluster with N TaskManagers.

dstl-ray: N Ray nodes (``ray.cluster_utils.Cluster``), the node-actor tree on file://, and
one TaskManager actor per node hosting that node's share of the 4 subtasks, as Flink's N
TaskManagers host ceil(4 / N) slots each; each subtask is a ChangelogKeyedStateBackend
counting its keys (0..9999) at 5,000 rows/s. The driver checkpoints every 200 ms (one call
per TaskManager: its subtasks' snapshots; then ``complete_checkpoint``), materialization
every 10 s as Flink's.

The same input: Flink's SQL ``datagen`` emits each second's rows at once and then sleeps until
the next second (``DataGeneratorSource.run`` in Flink 2.3), so about one checkpoint in five
has changes. dstl-ray's generator does the same by default (``--input bursts``); ``even``
spreads the rows over the second (every checkpoint has changes), as Flink's Source API
``DataGeneratorSource`` with ``RateLimiterStrategy.perSecond`` does (``flink_even``, the
peer's ``--input even``); ``both`` (default) runs each system on each, dstl-ray's even run in
``even_input``, Flink's in ``flink_even``.

The same measure: Flink's end-to-end duration is from the trigger to the last subtask's
acknowledgement (``AbstractCheckpointStats.getEndToEndDuration``; the ``_metadata`` is written
after it). dstl-ray's ``ack_ms`` is that, from the trigger to the last snapshot at the
driver; ``e2e_ms`` also includes ``complete_checkpoint`` (the ``_metadata`` durable).

Both: checkpoints completed, end-to-end duration percentiles, changelog and all files
created per checkpoint (every name created, seen by ``file_watcher``), bytes per checkpoint,
and recovery (kill the job, restore from the latest checkpoint, time until a checkpoint of
the restored job completed). N = 1, 2, 4.

Run: python -m experiments.vs_flink [--quick] [--rounds 3]   (or: make compare). With
``--rounds R`` each node count runs every system and input R times, alternating, and its
row is the median round's (this machine's speed drifts by a quarter between runs).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .burst_phase import burst_phase
from .common import count_at_rate, machine, parser, plt, summary, write_results
from .paired_rounds import median_item

HERE = Path(__file__).resolve().parent
NS = "vs-flink"
KEYS = 10_000


def file_kind(path: str) -> str:
    """What a file the watcher saw under the dstl-ray side's base directory is, from its name:
    ``changelog`` (``*.dstl``, hedged attempts' ``*-aN.dstl`` included), ``materialization``
    (``mat/*.dstm``), ``metadata`` (``chk-n/_metadata``), ``lease`` (``{job}/_lease``, and
    the job's epoch counter ``_epochs/{job}.epoch`` written when the lease is taken),
    ``temp:<kind>`` (a ``NAME.tmp-<uuid>`` of a temp + fsync + rename write of such a
    file), or ``other``."""
    name = os.path.basename(path)
    stem, sep, _ = name.partition(".tmp-")
    if sep:
        return f"temp:{file_kind(stem)}"
    if name.endswith(".dstl"):
        return "changelog"
    if name.endswith(".dstm"):
        return "materialization"
    if name == "_metadata":
        return "metadata"
    if name == "_lease" or name.endswith(".epoch"):
        return "lease"
    return "other"


def files_by_kind(paths: set[str], checkpoints: int) -> dict[str, float]:
    """Files per checkpoint of each :func:`file_kind`."""
    counts: dict[str, int] = {}
    for p in paths:
        k = file_kind(p)
        counts[k] = counts.get(k, 0) + 1
    return {k: counts[k] / max(1, checkpoints) for k in sorted(counts)}


class Counter:
    """One operator subtask: a backend counting keys from a rate-limited generator thread."""

    def __init__(self, index: int, parallelism: int, rate: int, restore_url: str | None,
                 client: Any, burst_from: float | None = None) -> None:
        import random

        from dstl_ray import ChangelogKeyedStateBackend, assign_key_group
        from dstl_ray.checkpoint.recovery import assign_sources, load_checkpoint
        from dstl_ray.keygroups import key_group_range_for_subtask

        kgr = key_group_range_for_subtask(128, parallelism, index)
        sources = (assign_sources(load_checkpoint(restore_url), "count", parallelism)[index]
                   if restore_url else [])
        self.b = ChangelogKeyedStateBackend(client, "count", kgr, 128, restore=sources,
                                            materialization_interval=10.0)
        self.keys = [k for k in range(KEYS)
                     if kgr.start <= assign_key_group(k, 128) <= kgr.end]
        self.rate, self.rng, self.stop = rate, random.Random(index), threading.Event()
        self.burst_from = burst_from
        self.bursts: list[tuple[float, float]] = []  # each burst's (start, end), wall clock
        # the backend is used from one thread at a time, like a Flink task's mailbox: the
        # generator and the checkpoint barrier take turns
        self.mailbox = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        count_at_rate(self.b.value_state("count"), self.keys, self.rng, self.rate, self.stop,
                      self.mailbox, batch=100, burst_from=self.burst_from,
                      bursts=self.bursts)

    def barrier(self, checkpoint_id: int) -> tuple[Any, float, float, float]:
        """The checkpoint barrier: take the snapshot between two generator chunks; returns
        its future (durable once resolved) and the times spent to get there."""
        t0 = time.perf_counter()
        with self.mailbox:
            t1 = time.perf_counter()
            fut = self.b.snapshot(checkpoint_id)
        return fut, t0, t1, time.perf_counter()


class TaskManager:
    """One process per Ray node hosting that node's subtasks, as a Flink TaskManager hosts
    its slots (the Flink side runs parallelism 4 on N TaskManagers of ceil(4 / N) slots):
    one client (one transport, so one node-actor call carries all its subtasks' requests).
    With ``hub`` (a :class:`~dstl_ray.CheckpointHub`'s address) it takes part in the
    driver's checkpoints as participant ``name``, as a Flink TaskManager gets its triggers
    by the JobManager's RPC; otherwise the driver calls :meth:`snapshot` by Ray."""

    def __init__(self, indices: list[int], parallelism: int, rate: int,
                 restore_url: str | None, namespace: str, burst_from: float | None,
                 hub: Any = None, name: str = "") -> None:
        from dstl_ray import HubParticipant, StateChangelogClient

        client = StateChangelogClient("vsflink", namespace=namespace)
        self.tasks = [Counter(i, parallelism, rate, restore_url, client, burst_from)
                      for i in indices]
        self._times: dict[int, dict[str, float]] = {}  # checkpoint id -> stage times
        self.participant = HubParticipant(hub, name, self._barriers) if hub else None

    def spans(self) -> list[dict[str, Any]]:
        """The writers' finished spans (the tree's ``tracing=memory``)."""
        from dstl_ray.observability import tracing

        return tracing.finished_spans()

    def _barriers(self, checkpoint_id: int) -> list[Any]:
        """Every hosted subtask's barrier (the hub's trigger); the futures of their
        snapshots, with the stage times kept for :meth:`times`."""
        from dstl_ray.log.futures import when_all_done

        t_call, wall_in = time.perf_counter(), time.time()
        barriers = [t.barrier(checkpoint_id) for t in self.tasks]
        slowest = max(barriers, key=lambda b: b[3] - b[1])
        row = self._times[checkpoint_id] = {
            "wall_in": wall_in, "mailbox_ms": max((b[2] - b[1]) * 1000 for b in barriers),
            "snapshot_call_ms": (slowest[3] - slowest[2]) * 1000}
        t2 = barriers[-1][3]

        def done() -> None:
            t3 = time.perf_counter()
            row.update(persist_ms=(t3 - t2) * 1000, actor_ms=(t3 - t_call) * 1000,
                       wall_out=time.time())

        # registered before the participant's own callbacks: the times are in before the
        # answer leaves
        when_all_done([b[0] for b in barriers], done)
        while len(self._times) > 10_000:
            self._times.pop(next(iter(self._times)))
        return [b[0] for b in barriers]

    def bursts(self) -> list[tuple[float, float]]:
        """Every hosted subtask's bursts so far, ``(start, end)`` in wall-clock time."""
        return [b for t in self.tasks for b in list(t.bursts)]

    def times(self) -> dict[int, dict[str, float]]:
        """The stage times of the hub's checkpoints so far, by checkpoint id."""
        return self._times.copy()

    def snapshot(self, checkpoint_id: int = -1) -> list[dict[str, Any]]:
        """Every hosted subtask's barrier, then wait until all their changelogs are durable;
        the stage times go back with each snapshot for the profile."""
        t_call, wall_in = time.perf_counter(), time.time()
        barriers = [t.barrier(checkpoint_id) for t in self.tasks]
        out = []
        for fut, t0, t1, t2 in barriers:
            snap = fut.result(timeout=60).to_dict()
            t3 = time.perf_counter()
            out.append({"snapshot": json.dumps(snap), "mailbox_ms": (t1 - t0) * 1000,
                        "snapshot_call_ms": (t2 - t1) * 1000, "persist_ms": (t3 - t2) * 1000,
                        "actor_ms": (t3 - t_call) * 1000, "wall_in": wall_in})
        wall_out = time.time()
        for o in out:
            o["wall_out"] = wall_out
        return out


def stage_row(parts: list[dict[str, Any]], w0: float, w_ack: float, ack_ms: float,
              complete_ms: float, e2e_ms: float) -> dict[str, float]:
    """One checkpoint's stages from the TaskManagers' times (``parts``: each one's, or each
    subtask's; the slowest counts) and the driver's: the trigger left at wall time ``w0``,
    the last answer was in at ``w_ack``, ``ack_ms`` after the trigger. The calls' two ways
    are wall-clock differences (one machine: the clocks agree): until the last TaskManager
    started its snapshots, and from the last answer sent until it was in."""
    slowest = max(parts, key=lambda o: o["actor_ms"])
    row = {k: slowest[k] for k in ("mailbox_ms", "snapshot_call_ms", "persist_ms")}
    row["actor_calls_ms"] = ack_ms - slowest["actor_ms"]
    row["call_ms"] = (max(o["wall_in"] for o in parts) - w0) * 1000
    row["reply_ms"] = (w_ack - max(o["wall_out"] for o in parts)) * 1000
    row["complete_checkpoint_ms"] = complete_ms
    row["e2e_ms"] = e2e_ms
    row["actor_ms"] = slowest["actor_ms"]
    return row


def trace_stages(actors: list[Any], tree: Any) -> dict[str, Any]:
    """Per-stage p50 of the checkpoints' persist path, from the spans of the writers and
    the node actors (:func:`dstl_ray.observability.trace_view.stage_breakdown`)."""
    import ray

    from dstl_ray.observability.trace_view import stage_breakdown

    spans = [s for part in ray.get([a.spans.remote() for a in actors]) for s in part]
    for st in tree.status():
        node = ray.get_actor(st["name"], namespace=NS)
        spans.extend(ray.get(node.spans.remote()))
    rows = stage_breakdown(spans)
    keys = ("send", "tree", "batch", "put", "reply", "total")
    return {"flushes": len(rows), "spans": len(spans),
            "stages_ms_p50": {k: summary([r[k] for r in rows])["p50"] for k in keys}
            if rows else {},
            "stages_ms_p90": {k: summary([r[k] for r in rows])["p90"] for k in keys}
            if rows else {},
            "levels": max((r["levels"] for r in rows), default=0)}


def dstl_side(nodes: int, seconds: float, interval: float, work: Path,
              traced: bool = False, bursts: bool = True, trigger: str = "hub"
              ) -> dict[str, Any]:
    """``trigger``: how the driver reaches the TaskManagers, by a :class:`CheckpointHub`
    (``hub``) or by a Ray call to each (``ray``)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dstl_ray import ChangelogConfig, CheckpointCoordinator, CheckpointHub, deploy
    from dstl_ray.state.snapshot import ChangelogComponent, KeyedStateSnapshot
    from dstl_ray.testing import start_local_cluster

    from .file_watcher import FileWatcher

    base = work / f"dstl-{nodes}{'-traced' if traced else ''}{'' if bursts else '-even'}"
    cluster = start_local_cluster(nodes, 2, NS)
    hub = coord = None
    try:
        tree = deploy(f"file://{base}", ChangelogConfig(
            namespace=NS, tracing="memory" if traced else "off"), detached=False)
        node_ids = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        actor = ray.remote(num_cpus=0, max_concurrency=4)(TaskManager)
        coord = CheckpointCoordinator("vsflink", f"file://{base}", max_parallelism=128,
                                      retained=2)
        if trigger == "hub":
            hub = CheckpointHub(coord, host=ray.util.get_node_ip_address())
        names = [f"tm-{n}" for n in range(len(node_ids))]

        def start(restore: str | None) -> list[Any]:
            """One TaskManager per node; subtask i on node i % nodes. With ``bursts``, every
            subtask emits each second's rows at once from the same moment, as the subtasks of
            Flink's datagen source, which start together."""
            burst_from = time.time() + 1.0 if bursts else None
            return [actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                nid, soft=False)).remote([i for i in range(4) if i % len(node_ids) == n],
                                         4, 5000, restore, NS, burst_from,
                                         hub and hub.address, names[n])
                for n, nid in enumerate(node_ids)]

        cid = [0]
        trigger_walls: list[float] = []  # when each checkpoint of the loop was triggered
        stages: dict[str, list[float]] = {}
        # checkpoints whose snapshots name a changelog file no earlier one named: the ones
        # with changes to persist (with bursts, about one in five)
        changed = {"checkpoints": 0, "paths": set()}
        # the hub's checkpoints: id -> the driver's side of its stage times, until the
        # TaskManagers' side is fetched (:func:`hub_stages`)
        by_hub: dict[int, dict[str, Any]] = {}

        def note(row: dict[str, float], fresh: bool) -> None:
            for k, v in row.items():
                stages.setdefault(k, []).append(v)
                stages.setdefault(f"{k}:{'with' if fresh else 'without'}_changes", []).append(v)

        def fresh_paths(snaps: Any) -> bool:
            paths = {p for s in snaps for c in s.components
                     if isinstance(c, ChangelogComponent) for p in c.handle.file_paths()}
            fresh = bool(paths - changed["paths"])
            changed["checkpoints"] += fresh
            changed["paths"] |= paths
            return fresh

        def checkpoint(actors: list[Any]) -> tuple[float, float]:
            """One checkpoint; (ms until the last subtask's snapshot arrived: Flink's
            end-to-end duration, ms until its ``_metadata`` is durable)."""
            t0, w0 = time.perf_counter(), time.time()
            trigger_walls.append(w0)
            cid[0] += 1
            if hub is not None:
                cc = hub.checkpoint(cid[0], names, timeout_s=120)
                t2 = time.perf_counter()
                h = hub.history[-1]
                ack_ms = (t2 - t0) * 1000 - (h.completed_s - h.acknowledged_s) * 1000
                by_hub[cid[0]] = {"w0": w0, "w_ack": w0 + ack_ms / 1000,
                                  "fresh": fresh_paths(cc.metadata.snapshots),
                                  "complete_checkpoint_ms":
                                      (h.completed_s - h.acknowledged_s) * 1000,
                                  "e2e_ms": (t2 - t0) * 1000, "ack_ms": ack_ms}
                return ack_ms, (t2 - t0) * 1000
            coord.begin_checkpoint(cid[0])  # chk-n made while the snapshots are taken
            outs = [o for part in ray.get([a.snapshot.remote(cid[0]) for a in actors],
                                          timeout=120) for o in part]
            t1, w1 = time.perf_counter(), time.time()
            snaps = [KeyedStateSnapshot.from_dict(json.loads(o["snapshot"]), coord.base_path)
                     for o in outs]
            coord.complete_checkpoint(cid[0], snaps)
            t2 = time.perf_counter()
            note(stage_row(outs, w0, w1, (t1 - t0) * 1000, (t2 - t1) * 1000,
                           (t2 - t0) * 1000), fresh_paths(snaps))
            return (t1 - t0) * 1000, (t2 - t0) * 1000

        def hub_stages(actors: list[Any]) -> None:
            """The stage rows of the hub's checkpoints: the driver's side with the
            TaskManagers' (the slowest's; one machine, so the clocks agree)."""
            parts = ray.get([a.times.remote() for a in actors])
            for n, drv in sorted(by_hub.items()):
                tms = [p[n] for p in parts if n in p and "wall_out" in p[n]]
                if len(tms) != len(parts):
                    continue
                note(stage_row(tms, drv["w0"], drv["w_ack"], drv["ack_ms"],
                               drv["complete_checkpoint_ms"], drv["e2e_ms"]), drv["fresh"])
            by_hub.clear()

        with FileWatcher(base, interval=0.002) as files:
            actors = start(None)
            ray.get([a.snapshot.remote() for a in actors])  # all running
            if hub is not None:
                hub.wait_for(names, timeout_s=120)
            time.sleep(interval)
            before, st0 = files.names(), tree.status()
            stages.clear()
            changed["checkpoints"] = 0
            trigger_walls.clear()
            loop_from = time.time()
            durations: list[float] = []  # until the _metadata is durable
            acks: list[float] = []  # until the last snapshot arrived (Flink's definition)
            t_end = time.time() + seconds
            while time.time() < t_end:
                t0 = time.time()
                ack, done = checkpoint(actors)
                acks.append(ack)
                durations.append(done)
                time.sleep(max(0.0, interval - (time.time() - t0)))
            loop_to = time.time()
            steady, st1 = files.names() - before, tree.status()
            if hub is not None:
                hub_stages(actors)
            with_changes = changed["checkpoints"]
            profile = {k: list(v) for k, v in stages.items()}
            if traced:  # a run of its own: tracing costs time on the path it measures
                return {"nodes": nodes, "checkpoints_completed": len(durations),
                        "ack_ms": summary(acks), "e2e_ms": summary(durations),
                        **trace_stages(actors, tree)}
            # which draw of the trigger/burst phase this run got (experiments/burst_phase.py)
            phase = burst_phase(trigger_walls, [
                w for part in ray.get([a.bursts.remote() for a in actors]) for w in part
                if loop_from <= w[0] and w[1] <= loop_to]) if bursts else None
            latest = coord.latest_checkpoint().metadata_url
            for a in actors:  # kill the job
                ray.kill(a)
            gone_by = time.time() + 60
            while hub is not None and hub.connected() and time.time() < gone_by:
                time.sleep(0.01)  # (the killed ones' connections)
            t0 = time.time()
            actors = start(latest)
            if hub is not None:
                hub.wait_for(names, timeout_s=120)
            checkpoint(actors)
            recovery_s = time.time() - t0
            for a in actors:
                ray.kill(a)
        seen = files.seen
        n = len(durations)

        def total(st: list[dict[str, Any]], key: str) -> int:
            return sum(s[key] for s in st)

        def triggers(st: list[dict[str, Any]]) -> dict[str, int]:
            return {k: sum(s["batch_triggers"][k] for s in st)
                    for k in ("all_pending", "size", "delay")}

        def mean_metric(a: list[dict[str, Any]], b: list[dict[str, Any]], k: str) -> float:
            n = sum(x["metrics"].get(f"{k}_count", 0) for x in b) - sum(
                x["metrics"].get(f"{k}_count", 0) for x in a)
            t = sum(x["metrics"].get(f"{k}_sum", 0) for x in b) - sum(
                x["metrics"].get(f"{k}_sum", 0) for x in a)
            return t / n if n else 0.0

        steady_changelog = [f for f in steady if f.endswith(".dstl")]
        return {"system": "dstl-ray", "nodes": nodes, "parallelism": 4, "seconds": seconds,
                "interval_ms": interval * 1000, "checkpoints_completed": n, "trigger": trigger,
                "input": "bursts" if bursts else "even",
                # Flink's end_to_end_duration: trigger to the last subtask's acknowledgement
                # (AbstractCheckpointStats.getEndToEndDuration); its _metadata is written after
                "ack_ms": summary(acks),
                # stricter: until the checkpoint's _metadata is durable
                "e2e_ms": summary(durations),
                # during the checkpoint loop (steady state: start-up and recovery excluded)
                "changelog_files_per_checkpoint": len(steady_changelog) / max(1, n),
                "checkpoints_with_changes": with_changes,
                "changelog_files_per_checkpoint_with_changes":
                    len(steady_changelog) / max(1, with_changes),
                "files_per_checkpoint": len(steady) / max(1, n),
                "files_per_checkpoint_by_kind": files_by_kind(steady, n),
                "other_files_sample": sorted(os.path.relpath(f, base) for f in steady
                                             if file_kind(f) == "other")[:20],
                "changelog_bytes_per_checkpoint":
                    (total(st1, "bytes_flushed") - total(st0, "bytes_flushed")) / max(1, n),
                "batch_triggers": {k: v - triggers(st0)[k] for k, v in triggers(st1).items()},
                # the whole run, start-up and the recovery included
                "changelog_files_created": len([f for f in seen if f.endswith(".dstl")]),
                "files_created": len(seen),
                # the slowest subtask's stages per checkpoint; each also over the checkpoints
                # with changes to persist and over those without (``<stage>:with_changes``,
                # ``:without_changes``): with bursts, the p50 falls between the two
                "stages_ms_p50": {k: summary(v)["p50"] for k, v in profile.items()},
                "stages_ms_n": {k: len(v) for k, v in profile.items()},
                "stages_ms_p99": {k: summary(v)["p99"] for k, v in profile.items()},
                # inside the nodes, means over the loop: a request's wait for its batch, and
                # one file write (temp file, fsync, rename)
                "node_mean_ms": {k: mean_metric(st0, st1, k)
                                 for k in ("batch_wait_ms", "dfs_latency_ms")},
                "recovery_s": recovery_s,
                # bursts: each second's burst (ms) and the triggers that fell inside one
                **({"burst_phase": phase} if phase is not None else {})}
    finally:
        if hub is not None:
            hub.close()
        if coord is not None:  # its lease renewals stop before the run's files go
            coord.shutdown()
        ray.shutdown()
        cluster.shutdown()


def flink_python() -> str:
    venv = Path(os.environ.get("FLINK_VENV", Path.home() / ".cache/dstl-ray/flink-venv"))
    py = venv / "bin" / "python"
    if not py.exists():
        print(f"[vs_flink] creating Flink's own environment in {venv} (apache-flink)",
              flush=True)
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "--quiet", "apache-flink"],
                       check=True)
    return str(py)


def flink_side(tms: int, seconds: float, interval: float, work: Path,
               source: str = "bursts") -> dict[str, Any]:
    """Flink's run with ``tms`` TaskManagers; ``source``: SQL's datagen (``bursts``) or the
    rate-limited DataGeneratorSource (``even``: experiments/peers/flink_keyed_count.py)."""
    out = work / f"flink-{tms}-{source}.json"
    proc = subprocess.run([flink_python(), str(HERE / "peers" / "flink_keyed_count.py"),
                           "--out", str(out), "--taskmanagers", str(tms), "--seconds",
                           str(seconds), "--interval-ms", str(int(interval * 1000)),
                           "--input", source, "--base", str(work / f"flink-{tms}-{source}")],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not out.exists():
        return {"system": "flink", "taskmanagers": tms, "input": source,
                "error": proc.stderr[-2000:]}
    r = json.loads(out.read_text())
    r.pop("restored_from", None)
    return r


def over(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> float | None:
    """p50 over p50 of two durations (None: a run missing or without a figure)."""
    if not ours or not theirs or not theirs.get("p50"):
        return None
    return ours["p50"] / theirs["p50"]


def e2e(run: dict[str, Any] | None) -> dict[str, Any] | None:
    return (run or {}).get("e2e_ms")


def one_round(n: int, seconds: float, work: Path, inputs: str, flink: bool,
              trigger: str = "hub") -> dict[str, Any]:
    """One run of each system on each input at ``n`` nodes, alternating, so a pair of runs
    compared is as close in time as this machine allows (in a directory of its own)."""
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    for kind in ("bursts", "even") if inputs == "both" else (inputs,):
        d = dstl_side(n, seconds, 0.2, work, bursts=kind == "bursts", trigger=trigger)
        print(f"[vs_flink] dstl-ray {n} nodes, {kind}: {json.dumps(d)[:600]}", flush=True)
        f = flink_side(n, seconds, 0.2, work, source=kind) if flink else None
        if f:
            print(f"[vs_flink] flink {n} TMs, {kind}: {json.dumps(f)[:600]}", flush=True)
        out[kind] = (d, f)
    return out


def median_row(n: int, rounds: list[dict[str, Any]], trace: dict[str, Any]
               ) -> dict[str, Any]:
    """The row of ``n`` nodes: per input, the round whose durable-over-Flink ratio is the
    median (the lower middle of an even count), each round's figures, and the ratios."""
    def pick(kind: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[Any]]:
        got = [r[kind] for r in rounds if kind in r]
        if not got:
            return None, None, []
        d, f = median_item(got, lambda df: over(e2e(df[0]), e2e(df[1])) or 0.0)
        return d, f, [{"e2e_ms_p50": e2e(x)["p50"], "ack_ms_p50": x["ack_ms"]["p50"],
                       "checkpoints_with_changes": x["checkpoints_with_changes"],
                       "triggers_inside_bursts":
                           (x.get("burst_phase") or {}).get("triggers_inside"),
                       "flink_e2e_ms_p50": (e2e(y) or {}).get("p50"),
                       "e2e_over_flink": over(e2e(x), e2e(y))} for x, y in got]

    d, f, bursts = pick("bursts")
    de, fe, even = pick("even")
    if d is None:  # --input even: the even run is the row's
        d, f, de, fe = de, fe, None, None
    d = dict(d or {}, trace=trace)
    if de is not None:
        d["even_input"] = de
    row: dict[str, Any] = {"nodes": n, "dstl_ray": d, "flink": f, "rounds": len(rounds),
                           "per_round": {"bursts": bursts, "even": even}}
    if fe is not None:
        row["flink_even"] = fe
    row["ratios"] = {"e2e_over_flink": over(e2e(d), e2e(f)),
                     "ack_over_flink": over(d.get("ack_ms"), e2e(f)),
                     "even_e2e_over_flink_even": over(e2e(de), e2e(fe))}
    return row


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--seconds", type=float, default=0)
    p.add_argument("--nodes", default="1,2,4")
    p.add_argument("--no-flink", action="store_true", help="only the dstl-ray side")
    p.add_argument("--input", choices=("bursts", "even", "both"), default="both",
                   help="dstl-ray's generator: each second's rows at once, as Flink's datagen "
                        "source emits them (the comparison), or spread evenly (every "
                        "checkpoint has changes: a run of its own, in 'even_input'), or both "
                        "(default)")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of each system and input per node count, alternating (dstl-ray, "
                        "Flink, dstl-ray even, Flink even; this machine's speed drifts "
                        "between runs): the ratios are the medians of each round's, and the "
                        "row of each input is its median round's")
    p.add_argument("--trigger", choices=("hub", "ray"), default="hub",
                   help="how dstl-ray's driver triggers the TaskManagers' snapshots: through "
                        "a CheckpointHub (default) or by a Ray actor call to each")
    args = p.parse_args()
    seconds = args.seconds or (8 if args.quick else 30)
    counts = [int(x) for x in args.nodes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="vs-flink-"))
    rows = []
    try:
        for n in counts:
            rounds = [one_round(n, seconds, work / f"round-{i}", args.input, not args.no_flink,
                                args.trigger) for i in range(max(1, args.rounds))]
            # where the persist time goes, from spans, in a shorter traced run; with even
            # input every checkpoint writes a changelog file
            trace = dstl_side(n, max(5.0, seconds / 3), 0.2, work, traced=True,
                              bursts=args.input == "bursts", trigger=args.trigger)
            rows.append(median_row(n, rounds, trace))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    pyplot = plt()
    fig, (a1, a2) = pyplot.subplots(1, 2, figsize=(11, 4))
    xs = [r["nodes"] for r in rows]
    a1.plot(xs, [r["dstl_ray"]["changelog_files_per_checkpoint"] for r in rows], "o-",
            label="dstl-ray")
    a1.plot(xs, [r["dstl_ray"]["changelog_files_per_checkpoint_with_changes"] for r in rows],
            "^:", label="dstl-ray, per checkpoint with changes")
    a2.plot(xs, [r["dstl_ray"]["ack_ms"]["p99"] for r in rows], "o-", label="dstl-ray p99")
    a2.plot(xs, [r["dstl_ray"]["ack_ms"]["p50"] for r in rows], "o--", label="dstl-ray p50")
    a2.plot(xs, [r["dstl_ray"]["e2e_ms"]["p50"] for r in rows], "^:",
            label="dstl-ray p50, _metadata durable")
    ev = [r for r in rows if "even_input" in r["dstl_ray"]]
    if ev:
        a2.plot([r["nodes"] for r in ev], [r["dstl_ray"]["even_input"]["ack_ms"]["p50"]
                                           for r in ev], "v:", label="dstl-ray p50, even input")
    fl = [r for r in rows if r["flink"] and "e2e_ms" in r["flink"]]
    if fl:
        fx = [r["nodes"] for r in fl]
        a1.plot(fx, [r["flink"]["changelog_files_per_checkpoint"] for r in fl], "s-",
                label="Flink 2.3 changelog")
        a2.plot(fx, [r["flink"]["e2e_ms"]["p99"] for r in fl], "s-", label="Flink p99")
        a2.plot(fx, [r["flink"]["e2e_ms"]["p50"] for r in fl], "s--", label="Flink p50")
    fe = [r for r in rows if r.get("flink_even") and "e2e_ms" in r["flink_even"]]
    if fe:
        a2.plot([r["nodes"] for r in fe], [r["flink_even"]["e2e_ms"]["p50"] for r in fe],
                "D:", label="Flink p50, even input")
    if ev:
        a2.plot([r["nodes"] for r in ev], [r["dstl_ray"]["even_input"]["e2e_ms"]["p50"]
                                           for r in ev], "v--",
                label="dstl-ray p50, even input, _metadata durable")
    a1.set(xlabel="nodes / TaskManagers", ylabel="changelog files created per checkpoint",
           xticks=xs)
    a2.set(xlabel="nodes / TaskManagers", xticks=xs,
           ylabel="checkpoint end-to-end ms (trigger to last ack)", yscale="log")
    a1.legend()
    a2.legend(fontsize=8)
    fig.suptitle("Keyed count, 20k rows/s (each second's rows at once, as Flink's datagen), "
                 "parallelism 4, checkpoint every 200 ms, file://")
    # issue 32: dstl-ray's p50 until _metadata is durable over Flink's end-to-end p50
    ratios = [{"nodes": r["nodes"], **r.pop("ratios")} for r in rows]
    write_results("vs_flink", {"ratios": ratios, "workload": {"rows_per_second": 20000, "parallelism": 4,
                                            "interval_ms": 200, "seconds": seconds,
                                            "keys": KEYS},
                               "runs": rows, "machine": machine(),
                               "command": " ".join(["python -m experiments.vs_flink",
                                                    *sys.argv[1:]])}, fig, args.out)


if __name__ == "__main__":
    main()
