"""Planning past one machine: the tree at 10, 100 and 1,000 nodes, in simulation.

    python -m experiments.tree_scale_sim [--quick]

Uses the real tree-building (``topology.tree.build_tree``) and forward-or-flush decision
(``topology.routing.should_flush``) with modelled latencies:

* writers' persist requests reach their node with a skew uniform in [0, 5 ms];
* a node sends its batch when every source arrived (the all-pending trigger), or after
  ``persist_delay * (1 + height)`` from its first request;
* a hop costs 0.5 ms + bytes / 1 GB/s; DFS put latency is drawn from the FLIP-158 S3 table for
  5 MB objects (p50 459, p90 740, p95 833, p99 1039, p999 3202 ms), scaled by object size
  (0.2 + 0.8 * min(1, size / 5 MB)) plus size beyond 5 MB at 50 MB/s;
* handles return down the same hops.

Modes: ``tree`` (branching b), ``per-node`` (every node flushes its own batch), ``direct``
(every writer writes its own file). Reports files per checkpoint, hops to the flushing node,
and checkpoint latency p50/p99 (the slowest writer of each checkpoint).

A second model, ``measured``, takes its costs from the stage breakdown of ``make compare``
(``experiments/results/vs_flink.json``, the traced runs on this machine, ``file://``): the
writer's send to its node, a hop between node actors, the fsynced put and the reply, each
drawn around its measured p50 (uniform in [0.5, 1.5] x). It shows what the tree's hops would
cost at 100 and 1,000 nodes if each cost what it costs here.

A third model, ``hosts``, is ``measured`` with every hop between node actors crossing hosts:
each hop up (a child's batch) and down (the answer) adds what a host lane call between two
hosts costs over a Unix lane call within one, drawn from the calls ``experiments.host_hops``
timed between network namespaces (``experiments/results/host_hops.json``: its whole
distribution, tails included, less the same-host median); ``hosts-ray`` is the same with
Ray calls between hosts (``host_lane="off"``).
"""

from __future__ import annotations

import bisect
import json
import os
import random
from dataclasses import dataclass

from topology.routing import should_flush
from topology.tree import build_tree

from .common import parser, percentile, plt, write_results

FLIP_QUANTILES = [(0.0, 250.0), (0.5, 459.0), (0.9, 740.0), (0.95, 833.0), (0.99, 1039.0),
                  (0.999, 3202.0), (1.0, 4500.0)]
MB = 1 << 20


def dfs_latency(rng: random.Random, size: int) -> float:
    u = rng.random()
    qs = [q for q, _ in FLIP_QUANTILES]
    i = max(1, bisect.bisect_left(qs, u))
    (q0, v0), (q1, v1) = FLIP_QUANTILES[i - 1], FLIP_QUANTILES[i]
    base = v0 + (v1 - v0) * (u - q0) / (q1 - q0)
    return base * (0.2 + 0.8 * min(1.0, size / (5 * MB))) + max(0, size - 5 * MB) / (50 * MB) \
        * 1000


def hop(size: int) -> float:
    return 0.5 + size / 1e9 * 1000


@dataclass(frozen=True)
class Measured:
    """Per-stage p50 (ms) from the traced vs_flink runs."""

    send: float  # writer -> its node actor
    hop: float  # node actor -> parent node actor (one level, its batching included)
    put: float  # the fsynced file write
    reply: float  # put done -> writer's persist done, at one level
    reply_hop: float  # each further level on the way back

    @classmethod
    def load(cls, path: str) -> Measured | None:
        if not os.path.exists(path):
            return None
        with open(path) as f:
            data = json.load(f)
        runs = {r["nodes"]: r["dstl_ray"].get("trace", {}).get("stages_ms_p50")
                for r in data["runs"]}
        one, two = runs.get(1), runs.get(2)
        if not one or not two:
            return None
        return cls(send=one["send"], hop=max(0.1, two["tree"]), put=one["put"],
                   reply=one["reply"], reply_hop=max(0.0, two["reply"] - one["reply"])
                   or two["tree"])


@dataclass(frozen=True)
class BetweenHosts:
    """What crossing hosts adds to a call (ms), per size of call: samples of the Ray call
    between two hosts less the same-host p50 (``experiments.host_hops``)."""

    by_bytes: tuple[tuple[int, tuple[float, ...]], ...]  # (call bytes, extra ms samples)

    @classmethod
    def load(cls, path: str, carrier: str = "tcp_lane") -> BetweenHosts | None:
        """From ``host_hops.json``: the host lane's calls between hosts less the Unix lane's
        p50 within one (``tcp_lane``, the default carrier between hosts), or Ray's calls less
        Ray's p50 within one (``ray``: ``host_lane="off"``)."""
        if not os.path.exists(path):
            return None
        same = {"tcp_lane": "unix_lane_same_host", "ray": "ray_same_host"}[carrier]
        with open(path) as f:
            kinds = json.load(f)["kinds"]
        if any(same not in k for k in kinds):
            return None
        return cls(tuple(sorted(
            (k["bytes"], tuple(max(0.0, x - k[same]["p50"]) for x in k[f"{carrier}_ms"]))
            for k in kinds)))

    def extra(self, rng: random.Random, size: int) -> float:
        """One draw for a call of ``size`` bytes: the samples of the nearest measured size
        at or above it (the largest, scaled, beyond it)."""
        for nbytes, samples in self.by_bytes:
            if size <= nbytes:
                return rng.choice(samples)
        nbytes, samples = self.by_bytes[-1]
        return rng.choice(samples) * size / nbytes


def simulate(n: int, b: int, writers: int, per_writer: int, flush_bytes: int, mode: str,
             rng: random.Random, delay_ms: float = 10.0, m: Measured | None = None,
             hosts: BetweenHosts | None = None) -> tuple[int, float, int]:
    """One checkpoint: (files, latency ms, max hops); with ``m``, the measured costs, and
    with ``hosts``, every hop between node actors crossing hosts."""
    def jit(x: float) -> float:
        return x * rng.uniform(0.5, 1.5)

    def cross(size: int) -> float:
        return hosts.extra(rng, size) if hosts else 0.0

    def arrive() -> float:
        return jit(m.send) if m else rng.uniform(0, 5)

    def put(size: int) -> float:
        return jit(m.put) + size / 500e6 * 1000 if m else dfs_latency(rng, size)

    def up(size: int) -> float:
        return jit(m.hop) + size / 1e9 * 1000 + cross(size) if m else hop(size)

    def down() -> float:
        return jit(m.reply_hop) + cross(0) if m else hop(64 * writers)

    if mode == "direct":
        lat = max(arrive() + put(per_writer) + (jit(m.reply) if m else 0)
                  for _ in range(n * writers))
        return n * writers, lat, 0
    order = [f"n{i}" for i in range(n)]
    tree = build_tree(order, b if mode == "tree" else n)
    # bottom-up: children have larger indices than their parents
    ready: dict[str, float] = {}
    size: dict[str, int] = {}
    incoming: dict[str, list[tuple[float, int, str]]] = {o: [] for o in order}
    flushed_at: dict[str, float] = {}  # node -> time its handles are ready at that node
    route: dict[str, str] = {}  # node -> node that flushed its data
    files = 0
    for name in reversed(order):
        pos = tree[name]
        own = [arrive() for _ in range(writers)]
        arrivals = own + [t for t, _, _ in incoming[name]]
        first = min(arrivals)
        deadline = first + delay_ms * (1 + pos.height)
        ready[name] = min(max(arrivals), deadline) if mode == "tree" else max(own)
        size[name] = writers * per_writer + sum(s for _, s, _ in incoming[name])
        has_parent = pos.parent is not None and mode == "tree"
        if should_flush(has_parent, size[name], flush_bytes):
            files += 1
            flushed_at[name] = ready[name] + put(size[name])
            route[name] = name
        else:
            incoming[pos.parent].append((ready[name] + up(size[name]), size[name], name))
    latency = 0.0
    max_hops = 0
    for name in order:  # top-down: handles travel back
        pos = tree[name]
        if name not in route:
            parent = pos.parent
            route[name] = route[parent]
            flushed_at[name] = flushed_at[parent] + down()
        hops = tree[name].level - tree[route[name]].level
        max_hops = max(max_hops, hops)
        latency = max(latency, flushed_at[name] + (jit(m.reply) if m else 0))
    return files, latency, max_hops


def _plot_measured(ax_small: object, ax_large: object, rows: list[dict], sizes: list[int]
                   ) -> None:
    """The measured model (solid) and the hosts model (dashed, every hop between hosts):
    checkpoint p50 by branching, per cluster size."""
    for ax, wname in ((ax_small, "small"), (ax_large, "large")):
        for n in sizes:
            for model, style in (("measured", "-"), ("hosts", "--")):
                rs = [r for r in rows if r["model"] == model and r["workload"] == wname
                      and r["nodes"] == n and r["mode"] == "tree"]
                if rs:
                    ax.plot([r["branching"] for r in rs], [r["latency_p50_ms"] for r in rs],
                            marker="o", ls=style,
                            label=f"tree p50, {n} nodes" + (", hosts" if model == "hosts"
                                                            else ""))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("branching factor")
        ax.set_title(f"{wname} increments, measured per-stage costs (file://): p50 (ms)",
                     fontsize=9)
        ax.legend(fontsize=7)


def main() -> None:
    args = parser(__doc__).parse_args()
    samples = 40 if args.quick else 200
    sizes = [10, 100] if args.quick else [10, 100, 1000]
    branchings = [2, 4, 8, 16, 32]
    flush_bytes = 4 * MB
    workloads = {"small": 10_000, "large": 2 * MB}  # bytes per writer per checkpoint
    rng = random.Random(158)
    measured = Measured.load(os.path.join(os.path.dirname(__file__), "results",
                                          "vs_flink.json"))
    hops = os.path.join(os.path.dirname(__file__), "results", "host_hops.json")
    models: dict[str, tuple[Measured | None, BetweenHosts | None]] = {"s3-flip": (None, None)}
    if measured is not None:
        models["measured"] = (measured, None)
        for name, carrier in (("hosts", "tcp_lane"), ("hosts-ray", "ray")):
            between = BetweenHosts.load(hops, carrier)
            if between is not None:
                models[name] = (measured, between)
    rows = []
    for model, (m, hosts) in models.items():
        for wname, per_writer in workloads.items():
            for n in sizes:
                configs = [("direct", 0), ("per-node", 0)] + [("tree", b) for b in branchings]
                for mode, b in configs:
                    runs = [simulate(n, b, 4, per_writer, flush_bytes, mode, rng, m=m,
                                     hosts=hosts)
                            for _ in range(samples)]
                    lat = [r[1] for r in runs]
                    row = {"model": model, "workload": wname, "nodes": n, "mode": mode,
                           "branching": b,
                           "files_per_checkpoint": sum(r[0] for r in runs) / samples,
                           "max_hops": max(r[2] for r in runs),
                           "latency_p50_ms": percentile(lat, 50),
                           "latency_p99_ms": percentile(lat, 99)}
                    rows.append(row)
                    print(f"{model:8} {wname:5} n={n:5} {mode:8} b={b:2}: "
                          f"{row['files_per_checkpoint']:7.1f} files, hops {row['max_hops']}, "
                          f"p50 {row['latency_p50_ms']:7.1f} ms, "
                          f"p99 {row['latency_p99_ms']:7.1f} ms", flush=True)
    pyplot = plt()
    fig, axes = pyplot.subplots(2, 3, figsize=(17, 8))
    if measured is not None:
        _plot_measured(axes[0][2], axes[1][2], rows, sizes)
    for col, wname in enumerate(workloads):
        ax_f, ax_l = axes[0][col], axes[1][col]
        for n in sizes:
            rs = [r for r in rows if r["workload"] == wname and r["nodes"] == n
                  and r["mode"] == "tree" and r["model"] == "s3-flip"]
            ax_f.plot([r["branching"] for r in rs], [r["files_per_checkpoint"] for r in rs],
                      marker="o", label=f"tree, {n} nodes")
            ax_l.plot([r["branching"] for r in rs], [r["latency_p99_ms"] for r in rs],
                      marker="o", label=f"tree p99, {n} nodes")
            pn = next(r for r in rows if r["workload"] == wname and r["nodes"] == n
                      and r["mode"] == "per-node" and r["model"] == "s3-flip")
            ax_l.axhline(pn["latency_p99_ms"], ls="--", lw=0.8,
                         color=ax_l.lines[-1].get_color(), label=f"per-node p99, {n} nodes")
        ax_f.set_xscale("log", base=2)
        ax_l.set_xscale("log", base=2)
        ax_f.set_yscale("log")
        ax_f.set_title(f"{wname} increments: files per checkpoint")
        ax_l.set_title(f"{wname} increments: checkpoint latency p99 (ms)")
        ax_l.set_xlabel("branching factor")
        ax_f.legend(fontsize=7)
        ax_l.legend(fontsize=7)
    write_results("tree_scale_sim", {"quick": args.quick, "samples": samples,
                                     "flush_bytes": flush_bytes, "workloads": workloads,
                                     "writers_per_node": 4,
                                     "measured_costs_ms": measured.__dict__ if measured else None,
                                     "rows": rows}, fig, args.out)


if __name__ == "__main__":
    main()
