"""Request hedging against FLIP-158's S3 latency table, on a real S3 server on loopback.

    python -m experiments.hedging [--quick] [--requests N] [--scale S] [--nodes N]

Part 1, requests: uploads through dstl-ray's Uploader (retry policy + hedging) to moto's S3
server on 127.0.0.1, with latency injected client-side (dstl_ray.testing.faults) from the FLIP-158
distribution (p50 459, p90 740, p95 833, p99 1039, p999 3202 ms), scaled by ``--scale`` to keep
the run short; latencies are reported scaled back to FLIP-158's milliseconds (the server's own
time per put, measured without injection, is in the JSON). The server runs in a child process. Each policy runs
the same number of requests: no hedging, hedging after a fixed delay, hedging at a quantile of
recent latencies. "extra" is the share of requests that started a hedged attempt.

Part 2, checkpoints: a tree of 4+ Ray nodes (ray.cluster_utils.Cluster) flushing to the same
server under the same injected latency; writers on every node; checkpoint latency (all persist
futures resolved) without and with hedging. Every node flushes its own file per checkpoint
(flush_bytes=0), so a checkpoint waits for the slowest of N uploads, where tails matter most.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from typing import Any

from dstl_ray import ChangelogConfig, Uploader
from dstl_ray.storage.registry import storage_for
from dstl_ray.testing.faults import FLIP158_QUANTILES_MS
from dstl_ray.testing.s3server import LoopbackS3

from .common import parser, percentile, plt, write_results

QS = (50, 90, 95, 99, 99.9)
FLIP_BASE = dict(zip(QS, (459, 740, 833, 1039, 3202), strict=True))
FLIP_HEDGED = dict(zip(QS, (495, 733, 807, 937, 1689), strict=True))


def _pcts(values_ms: list[float]) -> dict[str, float]:
    return {f"p{q:g}": round(percentile(values_ms, q), 1) for q in QS}


def policies(scale: float) -> list[tuple[str, dict[str, Any]]]:
    p90 = 740 / 1000 * scale
    return [
        ("no hedging", {}),
        ("hedge fixed 833 ms (FLIP p95)", {"hedge_delay_s": 833 / 1000 * scale}),
        ("hedge at p95 of recent", {"hedge_quantile": 0.95, "hedge_delay_s": p90 * 1.1}),
        ("hedge at p90 of recent", {"hedge_quantile": 0.90, "hedge_delay_s": p90}),
        ("hedge at p85 of recent", {"hedge_quantile": 0.85, "hedge_delay_s": p90}),
    ]


def put_overhead_ms(s3: LoopbackS3, size: int, n: int = 200) -> dict[str, float]:
    """What the loopback server itself adds to each request (no injected latency)."""
    cfg = ChangelogConfig(**s3.config_options())
    st = storage_for(s3.url("overhead"), cfg)
    payload = os.urandom(size)
    lat = []
    for k in range(n):
        t0 = time.monotonic()
        st.write_file(s3.url(f"overhead/{k}.dstl"), payload)
        lat.append((time.monotonic() - t0) * 1000)
    return {"p50": round(percentile(lat, 50), 2), "p99": round(percentile(lat, 99), 2)}


def run_requests(s3: LoopbackS3, n: int, scale: float, concurrency: int, size: int,
                 seed: int) -> list[dict[str, Any]]:
    payload = os.urandom(size)
    out = []
    for i, (name, opts) in enumerate(policies(scale)):
        spec = json.dumps({"latency": {"dist": "flip158", "scale": scale}, "seed": seed + i})
        # per-attempt timeout well above the slowest injected latency: we measure hedging,
        # not the retry policy (which would itself cut requests at upload_timeout_s)
        cfg = ChangelogConfig(**s3.config_options(), fault_spec=spec,
                              upload_timeout_s=max(1.0, 6.0 * scale), hedge_min_samples=50,
                              hedge_window=1000, **opts)
        up = Uploader(storage_for(s3.url("req"), cfg), cfg, max_workers=2 * concurrency + 8)
        lat: list[float] = []

        def one(k: int, up: Uploader = up, lat: list[float] = lat, i: int = i) -> None:
            t0 = time.monotonic()
            up.write(s3.url(f"req/p{i}/{k:06d}.dstl"), payload)
            lat.append((time.monotonic() - t0) * 1000 / scale)  # in FLIP-158's ms

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(n)))
        wall = time.monotonic() - t0
        time.sleep(6.0 * scale)  # late losers land and are deleted
        s = up.stats
        row = {"policy": name, "options": opts, "requests": n, **_pcts(lat),
               "extra_requests": round(s.hedged / n, 4), "hedged": s.hedged,
               "hedge_wins": s.hedge_wins, "attempts": s.attempts,
               "losers_deleted": s.losers_deleted, "failures": s.failures,
               "wall_s": round(wall, 1), "latencies_ms": [round(x, 1) for x in lat]}
        stray = len(s3.keys(f"req/p{i}/")) - n
        row["stray_objects"] = stray
        up.close()
        print(f"{name:32s} " + " ".join(f"{k}={row[k]:7.1f}" for k in _pcts(lat))
              + f"  extra={row['extra_requests']:.3f} wins={s.hedge_wins} stray={stray}",
              flush=True)
        out.append(row)
    base = out[0]["p99.9"]
    for row in out:
        row["p999_cut"] = round(1 - row["p99.9"] / base, 3)
    return out


def run_checkpoints(s3: LoopbackS3, nodes: int, checkpoints: int, scale: float,
                    writers_per_node: int, value_bytes: int) -> list[dict[str, Any]]:
    import ray

    import dstl_ray
    from dstl_ray import KeyGroupRange, StateChangelogClient
    from dstl_ray.testing import start_local_cluster

    cluster = start_local_cluster(nodes, 1, "hedging-exp")
    for k, v in s3.env().items():  # this process reads nothing back, but stays consistent
        os.environ[k] = v
    out = []
    try:
        p90 = 740 / 1000 * scale
        for j, (name, opts) in enumerate([("no hedging", {}),
                                          ("hedge at p90 of recent",
                                           {"hedge_quantile": 0.9, "hedge_delay_s": p90})]):
            spec = json.dumps({"latency": {"dist": "flip158", "scale": scale},
                               "match": ".dstl"})
            ns = f"hedging-{j}"
            cfg = ChangelogConfig(namespace=ns, flush_bytes=0, persist_delay_s=0.05,
                                  membership_interval_s=0.0, fault_spec=spec,
                                  plugins="dstl_ray.testing",
                                  upload_timeout_s=max(1.0, 6.0 * scale), hedge_min_samples=10,
                                  **s3.config_options(), **opts)
            tree = dstl_ray.deploy(s3.url(f"cp{j}"), cfg, detached=False)
            clients, writers = [], []
            for n_i, node in enumerate(sorted(tree.nodes)):
                c = StateChangelogClient("job", namespace=ns, node=node)
                clients.append(c)
                writers += [c.create_writer(f"op{n_i}-{w}", KeyGroupRange(0, 15))
                            for w in range(writers_per_node)]
            lat = []
            sqn = 0
            for cp in range(checkpoints + 3):
                for w in writers:
                    for kg in range(16):
                        w.append(kg, os.urandom(value_bytes))
                t0 = time.monotonic()
                futs = [w.persist_durably(sqn) for w in writers]
                for f in futs:
                    f.result(timeout=120)
                if cp >= 3:  # warm-up checkpoints excluded
                    lat.append((time.monotonic() - t0) * 1000 / scale)
                sqn = writers[0].last_appended_sqn()
                for w in writers:
                    w.truncate(w.last_appended_sqn())
            st = tree.status()
            hedged = sum(s.get("upload", {}).get("hedged", 0) for s in st)
            uploads = sum(s.get("upload", {}).get("uploads", 0) for s in st)
            row = {"policy": name, "options": opts, "nodes": len(tree.nodes),
                   "writers": len(writers), "checkpoints": len(lat), **_pcts(lat),
                   "mean": round(sum(lat) / len(lat), 1), "uploads": uploads,
                   "extra_requests": round(hedged / max(1, uploads), 4),
                   "latencies_ms": [round(x, 1) for x in lat]}
            print(f"checkpoints, {name:24s} " + " ".join(f"{k}={row[k]:7.1f}"
                                                         for k in _pcts(lat))
                  + f" mean={row['mean']:.1f} extra={row['extra_requests']:.3f}", flush=True)
            out.append(row)
            for c in clients:
                c.close()
            tree.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--requests", type=int, default=0)
    p.add_argument("--scale", type=float, default=0.0,
                   help="injected latency = FLIP-158 latency x scale")
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--nodes", type=int, default=0)
    p.add_argument("--checkpoints", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    n = args.requests or (500 if args.quick else 3000)
    scale = args.scale or (0.2 if args.quick else 0.5)
    nodes = args.nodes or (4 if args.quick else 5)
    cps = args.checkpoints or (15 if args.quick else 40)
    size = 64 * 1024
    with LoopbackS3(process=True) as s3:
        overhead = put_overhead_ms(s3, size)
        print(f"loopback put without injected latency: p50 {overhead['p50']:.1f} ms, "
              f"p99 {overhead['p99']:.1f} ms", flush=True)
        reqs = run_requests(s3, n, scale, args.concurrency, size, args.seed)
        cps_rows = run_checkpoints(s3, nodes, cps, scale, 2, 256)

    plot = plt()
    fig, (a1, a2) = plot.subplots(1, 2, figsize=(13, 4.8))
    xs = range(len(QS))
    a1.plot(xs, [FLIP_BASE[q] for q in QS], "k--", marker="x", label="FLIP-158 measured")
    a1.plot(xs, [FLIP_HEDGED[q] for q in QS], "k:", marker="x", label="FLIP-158 hedged")
    for r in reqs:
        a1.plot(xs, [r[f"p{q:g}"] for q in QS], marker="o",
                label=f"{r['policy']} (extra {100 * r['extra_requests']:.1f}%)")
    a1.set_xticks(list(xs), [f"p{q:g}" for q in QS])
    a1.set_yscale("log")
    a1.set_ylabel("request latency (ms, FLIP-158 scale)")
    a1.set_title(f"{n} uploads to loopback S3, injected latency x{scale:g}")
    a1.legend(fontsize=7)
    for r in cps_rows:
        a2.plot(xs, [r[f"p{q:g}"] for q in QS], marker="o",
                label=f"{r['policy']} (extra {100 * r['extra_requests']:.1f}%)")
    a2.set_xticks(list(xs), [f"p{q:g}" for q in QS])
    a2.set_ylabel("checkpoint latency (ms, FLIP-158 scale)")
    a2.set_title(f"checkpoints, {nodes} Ray nodes, every node flushes")
    a2.legend(fontsize=7)
    write_results("hedging", {
        "quick": args.quick, "requests": n, "scale": scale, "concurrency": args.concurrency,
        "request_bytes": size, "loopback_put_ms_without_injection": overhead,
        "distribution_quantiles_ms": FLIP158_QUANTILES_MS,
        "flip158": {"measured": FLIP_BASE, "hedged": FLIP_HEDGED},
        "command": "python -m experiments.hedging" + (" --quick" if args.quick else ""),
        "request_table": reqs, "checkpoint_table": cps_rows,
    }, fig, args.out)


if __name__ == "__main__":
    main()
