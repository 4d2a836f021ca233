"""FLIP-306's POC table for dstl-ray: files created and deleted over a fixed run.

8 subtasks (Ray actors spread over 4 Ray nodes) count keys from generator threads (20,000
updates/s in total) in ChangelogKeyedStateBackends; the driver takes 200 checkpoints, one every
200 ms, materialization every second, 2 checkpoints retained, ``file://``. Every file name
created under the job directory is recorded by a poller (temporary names of atomic writes
left out), so creations are counted, not survivors; deletions are the names gone at the end.

Rows:

* ``per-node, no merging``: every node actor flushes its own changelog file per checkpoint
  (FLIP-158's per-TaskManager batching, Flink's default) and every materialization is a file;
* ``tree, no merging``: the node tree meets at the root, one changelog file per checkpoint;
* ``tree + within_checkpoint``: FLIP-306 merging within checkpoints (materializations in
  subtask directories, a file closed after each checkpoint's segments);
* ``tree + across_checkpoints``: successive materializations appended to each subtask's open
  physical file, rolled at max space amplification 2.

Space amplification (bytes of merged files / live bytes) is sampled every 10 checkpoints.

Run: python -m experiments.file_merging [--quick]
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .common import count_at_rate, parser, plt, write_results
from .file_watcher import FileWatcher

NS = "file-merging"
JOB = "merging"
KEYS = 20_000
MODES = [("per-node, no merging", "none", 0), ("tree, no merging", "none", None),
         ("tree + within_checkpoint", "within_checkpoint", None),
         ("tree + across_checkpoints", "across_checkpoints", None)]


class Subtask:
    """One operator subtask: a backend counting keys, updated by a generator thread."""

    def __init__(self, index: int, parallelism: int, rate: int, mat_interval: float) -> None:
        import random

        from dstl_ray import ChangelogKeyedStateBackend, StateChangelogClient, assign_key_group
        from dstl_ray.keygroups import key_group_range_for_subtask

        client = StateChangelogClient(JOB, namespace=NS)
        kgr = key_group_range_for_subtask(128, parallelism, index)
        self.b = ChangelogKeyedStateBackend(client, "count", kgr, 128,
                                            materialization_interval=mat_interval)
        self.keys = [k for k in range(KEYS) if kgr.start <= assign_key_group(k, 128) <= kgr.end]
        self.rate, self.rng, self.stop = rate, random.Random(index), threading.Event()
        self.mailbox = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        count_at_rate(self.b.value_state("count"), self.keys, self.rng, self.rate, self.stop,
                      self.mailbox, batch=50)

    def snapshot(self, checkpoint_id: int, watermark: int) -> str:
        with self.mailbox:
            self.b.notify_checkpoint_subsumed(watermark)  # with the barrier, as Spark's tasks
            f = self.b.snapshot(checkpoint_id=checkpoint_id)
        return json.dumps(f.result(timeout=120).to_dict())

    def stats(self) -> dict[str, Any]:
        return {"materializations": self.b.materializations, **self.b.file_merging_stats()}

    def close(self) -> None:
        self.stop.set()
        with self.mailbox:
            self.b.close()


def _files(root: Path) -> set[str]:
    """Every file under ``root`` now, temporary names left out."""
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if ".tmp-" not in f}


def _kind(name: str) -> str:
    if name.endswith(".dstl"):
        return "changelog"
    if name.endswith(".dstm"):
        return "materialized"
    if name.endswith("_metadata"):
        return "metadata"
    return "other"


def run_mode(label: str, mode: str, flush_bytes: int | None, checkpoints: int,
             interval: float, work: Path) -> dict[str, Any]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dstl_ray import ChangelogConfig, CheckpointCoordinator, deploy
    from dstl_ray.state.snapshot import KeyedStateSnapshot
    from dstl_ray.testing import start_local_cluster

    base = work / mode / ("pernode" if flush_bytes == 0 else "tree")
    cluster = start_local_cluster(4, 2, NS)
    try:
        opts: dict[str, Any] = {"namespace": NS, "file_merging": mode}
        if flush_bytes is not None:
            opts["flush_bytes"] = flush_bytes
        tree = deploy(f"file://{base}", ChangelogConfig(**opts), detached=False)  # noqa: F841 - keeps the node actors alive
        node_ids = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        actor = ray.remote(num_cpus=0, max_concurrency=4)(Subtask)
        actors = [actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_ids[i % len(node_ids)], soft=False)).remote(i, 8, 2500, 1.0)
            for i in range(8)]
        coord = CheckpointCoordinator(JOB, f"file://{base}", max_parallelism=128, retained=2)
        job_dir = base / JOB
        job_dir.mkdir(parents=True, exist_ok=True)
        watcher = FileWatcher(job_dir).__enter__()  # every name created (inotify)
        amplification: list[tuple[int, float | None, int]] = []
        durations = []
        for n in range(1, checkpoints + 1):
            t0 = time.time()
            wm = coord.subsumed_watermark()
            snaps = ray.get([a.snapshot.remote(n, wm) for a in actors], timeout=120)
            coord.complete_checkpoint(n, [KeyedStateSnapshot.from_dict(json.loads(s),
                                                                        coord.base_path)
                                          for s in snaps])
            durations.append(time.time() - t0)
            if n % 10 == 0 and mode != "none":
                st = ray.get([a.stats.remote() for a in actors])
                total, live = sum(s["bytes"] for s in st), sum(s["live_bytes"] for s in st)
                amplification.append((n, total / live if live else None, total))
            time.sleep(max(0.0, interval - (time.time() - t0)))
        stats = ray.get([a.stats.remote() for a in actors])
        time.sleep(0.2)
        watcher.__exit__()
        present = _files(job_dir)
        seen = {f for f in watcher.seen if ".tmp-" not in os.path.basename(f)}
        by_kind: dict[str, dict[str, int]] = {}
        for name in seen:
            k = by_kind.setdefault(_kind(name), {"created": 0, "deleted": 0})
            k["created"] += 1
            k["deleted"] += name not in present
        ray.get([a.close.remote() for a in actors])
        return {"label": label, "file_merging": mode,
                "changelog": "per node" if flush_bytes == 0 else "tree",
                "checkpoints": checkpoints, "files_created": len(seen),
                "files_deleted": len(seen - present), "by_kind": by_kind,
                "state_files_created": sum(v["created"] for k, v in by_kind.items()
                                           if k in ("changelog", "materialized")),
                "materializations": sum(s["materializations"] for s in stats),
                "segments_written": sum(s.get("segments_written", 0) for s in stats),
                "compactions": sum(s.get("compactions", 0) for s in stats),
                "space_amplification": amplification,
                "checkpoint_s_mean": sum(durations) / len(durations)}
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--checkpoints", type=int, default=200)
    ap.add_argument("--interval", type=float, default=0.2)
    args = ap.parse_args()
    n = 40 if args.quick else args.checkpoints
    rows = []
    with tempfile.TemporaryDirectory(prefix="dstl-merging-") as tmp:
        for label, mode, flush in MODES:
            r = run_mode(label, mode, flush, n, args.interval, Path(tmp))
            print(f"[file_merging] {json.dumps(r)}", flush=True)
            rows.append(r)
    base_row = rows[0]
    for r in rows:
        r["fewer_creations_vs_no_merging"] = 1 - r["files_created"] / base_row["files_created"]
        r["fewer_deletions_vs_no_merging"] = 1 - r["files_deleted"] / max(
            1, base_row["files_deleted"])
    pyplot = plt()
    fig, (ax1, ax2) = pyplot.subplots(1, 2, figsize=(12, 4.5))
    kinds = ["changelog", "materialized", "metadata"]
    bottom = [0] * len(rows)
    for k in kinds:
        vals = [r["by_kind"].get(k, {}).get("created", 0) for r in rows]
        ax1.bar(range(len(rows)), vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax1.set_xticks(range(len(rows)), [r["label"].replace(", ", ",\n").replace(" + ", "\n+ ")
                                      for r in rows], fontsize=8)
    ax1.set_ylabel(f"files created in {n} checkpoints")
    ax1.legend()
    for r in rows:
        pts = [(c, a) for c, a, _ in r["space_amplification"] if a is not None]
        if pts:
            ax2.plot([c for c, _ in pts], [a for _, a in pts], marker="o", label=r["label"])
    ax2.axhline(2.0, color="grey", linestyle=":", label="max-space-amplification")
    ax2.set_xlabel("checkpoint")
    ax2.set_ylabel("bytes of merged files / live bytes")
    ax2.legend(fontsize=8)
    fig.suptitle("File merging (FLIP-306): 8 subtasks on 4 Ray nodes, a checkpoint every "
                 f"{int(args.interval * 1000)} ms, materialization every 1 s")
    fig.tight_layout()
    out = write_results("file_merging", {
        "workload": {"parallelism": 8, "nodes": 4, "updates_per_second": 20000,
                     "keys": KEYS, "checkpoints": n, "interval_s": args.interval,
                     "materialization_interval_s": 1.0, "retained": 2},
        "rows": rows, "command": "python -m experiments.file_merging"
        + (" --quick" if args.quick else "")}, fig, args.out)
    print(out)


if __name__ == "__main__":
    main()
