"""Files per checkpoint and checkpoint latency: direct vs per-node vs tree.

    python -m experiments.file_flood [--quick] [--nodes N] [--writers W]

Same cluster (``ray.cluster_utils.Cluster``, N Ray nodes on this machine), same workload
(W writers per node, one NodeWriters actor per node), three modes:

* ``direct``   every writer writes its own file per checkpoint (no batching at all);
* ``per-node`` one file per node per checkpoint (Flink 1.15's per-TaskManager batching):
               the tree with ``flush_bytes = 0`` so every node flushes what it has;
* ``tree``     this project: nodes forward to their parent unless they hold ``flush_bytes``.

Run with small increments (the whole checkpoint below ``flush_bytes``) and large ones (every
node above it). Latency is measured from the moment every writer is asked to persist until
the last handle is back. Target: ``tree`` writes 1 file per checkpoint for small increments,
with p99 latency no worse than 2x ``per-node``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid

from .common import parser, plt, summary, write_results


def count_files(root: str) -> int:
    return sum(1 for _, _, fs in os.walk(root) for f in fs if f.endswith(".dstl"))


def run_mode(mode: str, node_ids: list[str], writers: int, checkpoints: int, changes: int,
             payload: int, flush_bytes: int) -> dict[str, object]:
    import ray

    from dstl_ray import ChangelogConfig, deploy
    from experiments.workload import place_writers, verify

    base = tempfile.mkdtemp(prefix=f"dstl-flood-{mode}-")
    ns = f"flood-{uuid.uuid4().hex[:8]}"
    tree = None
    if mode != "direct":
        cfg = ChangelogConfig(namespace=ns, branching_factor=2,
                              flush_bytes=0 if mode == "per-node" else flush_bytes)
        tree = deploy(f"file://{base}", cfg, detached=False)
    actors = place_writers("flood", ns, node_ids, writers,
                           direct_base=f"file://{base}" if mode == "direct" else None)
    lat, files = [], []
    results = []
    for _ in range(checkpoints):
        ray.get([a.append.remote(changes, payload) for a in actors])
        before = count_files(base)
        t0 = time.perf_counter()
        results = ray.get([a.persist.remote() for a in actors])
        lat.append((time.perf_counter() - t0) * 1000)
        assert all(r["ok"] for r in results), results
        files.append(count_files(base) - before)
    checked = verify(actors, [r["handles"] for r in results])
    for a in actors:
        ray.get(a.close.remote())
        ray.kill(a)
    if tree is not None:
        tree.shutdown()
    shutil.rmtree(base, ignore_errors=True)
    return {"mode": mode, "files_per_checkpoint": sum(files) / len(files),
            "files": files, "latency_ms": summary(lat), "samples_ms": lat,
            "changes_verified": checked}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--writers", type=int, default=4)
    args = p.parse_args()
    nodes = args.nodes or (4 if args.quick else 6)
    cps = 10 if args.quick else 40
    import ray

    from dstl_ray.testing import start_local_cluster

    cluster = start_local_cluster(nodes, 1)
    from topology.placement import alive_nodes, node_order

    node_ids = node_order(alive_nodes())
    flush_bytes = 1 << 20
    workloads = {
        # whole checkpoint: nodes x writers x 50 x 100 B ~ 120 KB at 6 nodes: below flush_bytes
        "small": {"changes": 50, "payload": 100},
        # per node: writers x 300 x 1 KiB ~ 1.2 MB: above flush_bytes
        "large": {"changes": 300, "payload": 1024},
    }
    results: dict[str, list[dict[str, object]]] = {}
    try:
        for wname, w in workloads.items():
            results[wname] = []
            for mode in ("direct", "per-node", "tree"):
                r = run_mode(mode, node_ids, args.writers, cps, w["changes"], w["payload"],
                             flush_bytes)
                results[wname].append(r)
                s = r["latency_ms"]
                print(f"{wname:5} {mode:8}: {r['files_per_checkpoint']:5.1f} files/checkpoint, "
                      f"p50 {s['p50']:6.1f} ms, p99 {s['p99']:6.1f} ms", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()

    pyplot = plt()
    fig, axes = pyplot.subplots(1, 2, figsize=(12, 4))
    for ax, (wname, rs) in zip(axes, results.items(), strict=True):
        modes = [r["mode"] for r in rs]
        x = range(len(modes))
        ax.bar([i - 0.2 for i in x], [r["files_per_checkpoint"] for r in rs], 0.4,
               label="files / checkpoint", color="#4c72b0")
        ax2 = ax.twinx()
        ax2.bar([i + 0.2 for i in x], [r["latency_ms"]["p50"] for r in rs], 0.4,
                label="p50 ms", color="#dd8452")
        ax2.errorbar([i + 0.2 for i in x], [r["latency_ms"]["p50"] for r in rs],
                     yerr=[[0] * len(rs), [r["latency_ms"]["p99"] - r["latency_ms"]["p50"]
                                           for r in rs]], fmt="none", ecolor="black",
                     capsize=4)
        ax.set_xticks(list(x), modes)
        ax.set_ylabel("files per checkpoint")
        ax2.set_ylabel("checkpoint latency ms (bar p50, whisker p99)")
        ax.set_title(f"{wname} increments, {nodes} Ray nodes x {args.writers} writers")
    strip = {k: [{kk: vv for kk, vv in r.items() if kk not in ("samples_ms", "files")}
                 for r in v] for k, v in results.items()}
    small = {r["mode"]: r for r in results["small"]}
    write_results("file_flood", {
        "quick": args.quick, "nodes": nodes, "writers_per_node": args.writers,
        "checkpoints": cps, "flush_bytes": flush_bytes, "workloads": workloads,
        "results": strip,
        "targets": {"tree_small_files_per_checkpoint": 1,
                    "tree_p99_vs_per_node_p99_max_ratio": 2.0},
        "met": {"tree_one_file": small["tree"]["files_per_checkpoint"] == 1.0,
                "tree_p99_ratio": small["tree"]["latency_ms"]["p99"]
                / small["per-node"]["latency_ms"]["p99"]},
    }, fig, args.out)


if __name__ == "__main__":
    main()
