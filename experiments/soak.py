"""Soak: a long run of checkpoints on a 3-node tree with materialization and file merging on,
sampling everything that could grow without bound (design: "Nothing grows without bound over a
long run").

Three subtasks (Ray actors, one per Ray node) update a fixed key set (the state size stays
constant), and each checkpoint is one round: every subtask applies its updates and snapshots,
the driver completes the checkpoint (``complete_checkpoint``, as the Spark operator does).
Materialization runs every ``--mat-every`` checkpoints (by count, so the work per checkpoint
does not depend on how fast checkpoints are), merged files across checkpoints are on
(materialized state and node changelog files). Every ``--sample-every`` checkpoints the run
samples: node actor RSS and table sizes (writers, sources, per-job entries, merged files,
namespace bindings), subtask RSS and backend tables, driver RSS, the shared state registry's
tables, files in the job directory, and the checkpoint latency.

Growth of a series: a least-squares line through the samples after warm-up (the first
``--warmup`` fraction), its rise over that span relative to the series' mean there. The run
passes when no series rises more than 5%.

Run: python -m experiments.soak [--quick] [--checkpoints 10000]
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from typing import Any

from .common import parser, plt, summary, write_results

NS = "soak"
JOB = "soak"
MAXP = 64
PAR = 3


class Subtask:
    """One subtask: a fixed key set, ``updates`` of them rewritten per checkpoint."""

    def __init__(self, index: int, keys: int, updates: int, mat_every: int,
                 incarnation: str) -> None:
        from dstl_ray import ChangelogKeyedStateBackend, StateChangelogClient, assign_key_group
        from dstl_ray.keygroups import key_group_range_for_subtask

        kgr = key_group_range_for_subtask(MAXP, PAR, index)
        self.b = ChangelogKeyedStateBackend(
            StateChangelogClient(JOB, namespace=NS), "op", kgr, MAXP,
            materialization_interval=None, incarnation=incarnation)
        self.mat_every = mat_every
        self.keys = [k for k in range(keys) if kgr.start <= assign_key_group(k, MAXP) <= kgr.end]
        self.state = self.b.value_state("v")
        self.rng = random.Random(index)
        self.updates = updates
        for k in self.keys:
            self.state.update(k, 0)

    def step(self, checkpoint_id: int, watermark: int) -> str:
        for _ in range(self.updates):
            k = self.rng.choice(self.keys)
            self.state.update(k, checkpoint_id)  # same size: the state never grows
        self.b.notify_checkpoint_subsumed(watermark)
        if checkpoint_id % self.mat_every == 0:  # by count: the same work at any speed
            self.b.materialize()
        return json.dumps(self.b.snapshot(checkpoint_id).result(timeout=120).to_dict())

    def stats(self) -> dict[str, Any]:
        from dstl_ray.node import current_rss_kb

        w = self.b.writer
        return {"rss_kb": current_rss_kb(), "materializations": self.b.materializations,
                "writer_changesets": len(w.retained_sqns()),
                "segment_files": len(self.b._segment_files),
                "merged_files": self.b._merging.size() if self.b._merging else 0}


def growth(xs: list[float], ys: list[float]) -> float:
    """Rise of the least-squares line over the span, relative to the mean (0.05 = 5%)."""
    n = len(xs)
    if n < 3:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0 or my == 0:
        return 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return slope * (max(xs) - min(xs)) / abs(my)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--checkpoints", type=int, default=0)
    p.add_argument("--keys", type=int, default=30_000)
    p.add_argument("--updates", type=int, default=300, help="per subtask and checkpoint")
    p.add_argument("--mat-every", type=int, default=40, help="checkpoints per materialization")
    p.add_argument("--sample-every", type=int, default=0)
    p.add_argument("--warmup", type=float, default=0.2)
    args = p.parse_args()
    n = args.checkpoints or (300 if args.quick else 10_000)
    every = args.sample_every or max(10, n // 200)

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dstl_ray import ChangelogConfig, CheckpointCoordinator, deploy
    from dstl_ray.node import current_rss_kb
    from dstl_ray.state.snapshot import KeyedStateSnapshot
    from dstl_ray.testing import start_local_cluster

    base = tempfile.mkdtemp(prefix="dstl-soak-")
    cluster = start_local_cluster(3, namespace=NS)
    samples: list[dict[str, Any]] = []
    latencies: list[float] = []
    t_start = time.time()
    try:
        tree = deploy(f"file://{base}", ChangelogConfig(
            namespace=NS, file_merging="across_checkpoints", persist_delay_s=0.005),
            detached=False)
        coord = CheckpointCoordinator(JOB, f"file://{base}", max_parallelism=MAXP, retained=2)
        coord.restore(None, "op", 0)
        nodes = sorted(x["NodeID"] for x in ray.nodes() if x["Alive"])
        actor = ray.remote(num_cpus=0)(Subtask)
        subtasks = [actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            nodes[i % len(nodes)], soft=False)).remote(
                i, args.keys, args.updates, args.mat_every, str(coord.incarnation))
            for i in range(PAR)]
        print(f"[soak] {n} checkpoints, {args.keys} keys, {args.updates} updates per subtask "
              f"and checkpoint, sample every {every}", flush=True)
        for cid in range(1, n + 1):
            t0 = time.perf_counter()
            wm = coord.subsumed_watermark()
            snaps = ray.get([s.step.remote(cid, wm) for s in subtasks], timeout=300)
            coord.complete_checkpoint(cid, [KeyedStateSnapshot.from_dict(json.loads(x),
                                                                         coord.base_path)
                                            for x in snaps])
            latencies.append((time.perf_counter() - t0) * 1000)
            if cid % every == 0 or cid == n:
                samples.append(_sample(cid, tree, subtasks, coord, base, latencies[-every:],
                                       current_rss_kb()))
                if cid % (every * 20) == 0:
                    s = samples[-1]
                    print(f"[soak] {cid}: node rss {s['node_rss_mb']} MB, files "
                          f"{s['job_files']}, registry {s['registry_entries']}, "
                          f"p50 {s['ckpt_ms_p50']:.0f} ms", flush=True)
        coord.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(base, ignore_errors=True)
    report(args, n, every, samples, latencies, time.time() - t_start)


def _sample(cid: int, tree: Any, subtasks: list[Any], coord: Any, base: str,
            recent_ms: list[float], driver_rss_kb: int) -> dict[str, Any]:
    import ray

    st = [s for s in tree.status() if "error" not in s]
    sub = ray.get([s.stats.remote() for s in subtasks], timeout=60)
    reg = coord.registry.size()
    files = sum(len(fs) for _, _, fs in os.walk(os.path.join(base, JOB)))
    node_entries = sum(sum(s["entries"].values()) for s in st)
    return {"checkpoint": cid, "t": time.time(),
            "node_rss_mb": round(max(s["rss_kb"] for s in st) / 1024, 1),
            "node_py_blocks": max(s["py_blocks"] for s in st),
            "subtask_rss_mb": round(max(x["rss_kb"] for x in sub) / 1024, 1),
            "driver_rss_mb": round(driver_rss_kb / 1024, 1),
            "registry_entries": sum(reg.values()), "registry": reg,
            "node_entries": node_entries,
            "node_tables": {k: sum(s["entries"][k] for s in st) for k in st[0]["entries"]},
            "subtask_tables": sum(x["writer_changesets"] + x["segment_files"]
                                  + x["merged_files"] for x in sub),
            "subtask_table_sizes": {k: sum(x[k] for x in sub) for k in (
                "writer_changesets", "segment_files", "merged_files")},
            "materializations": sum(x["materializations"] for x in sub),
            "job_files": files, "ckpt_ms_p50": summary(recent_ms)["p50"]}


SERIES = ("node_rss_mb", "node_py_blocks", "subtask_rss_mb", "driver_rss_mb", "registry_entries",
          "node_entries", "subtask_tables", "job_files")


def report(args: Any, n: int, every: int, samples: list[dict[str, Any]],
           latencies: list[float], seconds: float) -> None:
    after = [s for s in samples if s["checkpoint"] > args.warmup * n]
    growths = {k: round(growth([s["checkpoint"] for s in after], [s[k] for s in after]), 4)
               for k in SERIES}
    data = {"checkpoints": n, "keys": args.keys, "updates_per_subtask": args.updates,
            "materialize_every_checkpoints": args.mat_every, "nodes": 3, "subtasks": PAR,
            "file_merging": "across_checkpoints", "seconds": round(seconds, 1),
            "checkpoint_ms": summary(latencies), "warmup_fraction": args.warmup,
            "growth_after_warmup": growths,
            "max_growth": max(growths.values()), "passed": max(growths.values()) <= 0.05,
            "samples": samples}
    pyplot = plt()
    fig, axes = pyplot.subplots(3, 3, figsize=(14, 9))
    xs = [s["checkpoint"] for s in samples]
    for ax, k in zip(axes.flat, (*SERIES, "ckpt_ms_p50"), strict=True):
        ax.plot(xs, [s[k] for s in samples], lw=1)
        ax.axvline(args.warmup * n, color="grey", ls=":", lw=1)
        g = growths.get(k)
        ax.set_title(k + (f" (growth {g * 100:+.1f}%)" if g is not None else ""), fontsize=9)
        ax.set_xlabel("checkpoint", fontsize=8)
        ax.set_ylim(bottom=0)
    fig.suptitle(f"Soak: {n} checkpoints on 3 Ray nodes, materialization + file merging "
                 f"across checkpoints ({seconds / 60:.0f} min)")
    fig.tight_layout()
    write_results("soak", data, fig, args.out)
    print(json.dumps({"growth_after_warmup": growths, "passed": data["passed"]}), flush=True)


if __name__ == "__main__":
    main()
