"""Append throughput of one writer and persist_durably latency on one node.

    python -m experiments.append_throughput [--quick]

Appends/s and MB/s for one writer at 64 B, 1 KiB and 64 KiB payloads (pre-emptive persist on,
as in production); persist_durably latency p50/p99 for 1, 8 and 32 writers attached to one node
actor writing to file:// with the default 10 ms persist delay. Targets (issue "Foundation"):
>= 1,000,000 appends/s at 64 B; persist p50 < 25 ms.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from .common import parser, plt, summary, write_results


def measure_appends(client, payload: int, n: int) -> dict[str, float]:
    from dstl_ray import KeyGroupRange

    w = client.create_writer(f"append-{payload}", KeyGroupRange(0, 127))
    value = os.urandom(payload)
    append = w.append
    t0 = time.perf_counter()
    for i in range(n):
        append(i & 127, value)
    dt = time.perf_counter() - t0
    w.wait_uploads(60)
    w.close()
    return {"payload": payload, "appends": n, "seconds": dt, "appends_per_s": n / dt,
            "mb_per_s": n * payload / dt / 1e6, "preemptive_uploads": w.preemptive_uploads}


def measure_persist(client, writers: int, checkpoints: int, changes: int) -> dict[str, object]:
    from dstl_ray import key_group_range_for_subtask

    ws = [client.create_writer(f"persist-{writers}-{i}",
                               key_group_range_for_subtask(128, writers, i))
          for i in range(writers)]
    lat = []
    value = os.urandom(100)
    warmup = 3  # the first checkpoints after start-up pay for imports and directory creation
    for i in range(checkpoints + warmup):
        for w in ws:
            kgr = w.key_group_range
            for j in range(changes):
                w.append(kgr.start + j % len(kgr), value)
        t0 = time.perf_counter()
        futures = [w.persist_durably(w.last_appended_sqn() - 1) for w in ws]
        for f in futures:
            f.result(timeout=60)
        if i >= warmup:
            lat.append((time.perf_counter() - t0) * 1000)
        # the checkpoint completed: nothing before it is needed any more
        for w in ws:
            w.truncate(before=w.last_appended_sqn())
    for w in ws:
        w.close()
    return {"writers": writers, "latency_ms": summary(lat), "samples_ms": lat}


def main() -> None:
    args = parser(__doc__).parse_args()
    import ray

    from dstl_ray import ChangelogConfig, StateChangelogClient, deploy

    n_small = 300_000 if args.quick else 3_000_000
    cps = 20 if args.quick else 100
    base = tempfile.mkdtemp(prefix="dstl-bench-")
    ray.init(namespace="dstl_bench", log_to_driver=False, include_dashboard=False)
    try:
        tree = deploy(f"file://{base}", ChangelogConfig(namespace="dstl_bench"), detached=False)
        client = StateChangelogClient("bench", namespace="dstl_bench")
        appends = [measure_appends(client, 64, n_small),
                   measure_appends(client, 1024, n_small // 4),
                   measure_appends(client, 65536, max(2000, n_small // 100))]
        for a in appends:
            print(f"append {a['payload']:>6} B: {a['appends_per_s']:>12,.0f} appends/s "
                  f"{a['mb_per_s']:>8.1f} MB/s", flush=True)
        persist = []
        for n in (1, 8, 32):
            r = measure_persist(client, n, cps, 200)
            persist.append(r)
            s = r["latency_ms"]
            print(f"persist {n:>2} writers: p50 {s['p50']:.1f} ms  p99 {s['p99']:.1f} ms",
                  flush=True)
        status = tree.status()
        tree.shutdown()
        # the same with tracing on (in-memory exporter): the cost of the tracing code when
        # off is what the figures above already include
        traced = deploy(f"file://{base}", ChangelogConfig(namespace="dstl_bench_traced",
                                                          tracing="memory"), detached=False)
        tclient = StateChangelogClient("bench", namespace="dstl_bench_traced")
        tracing_cmp = {
            "off": {"appends_per_s_64B": appends[0]["appends_per_s"],
                    "persist_8_writers_ms": persist[1]["latency_ms"]},
            "on": {"appends_per_s_64B": measure_appends(tclient, 64, n_small)["appends_per_s"],
                   "persist_8_writers_ms": measure_persist(tclient, 8, cps, 200)["latency_ms"]},
        }
        print(f"tracing on: {tracing_cmp['on']['appends_per_s_64B']:,.0f} appends/s, persist "
              f"8 writers p50 {tracing_cmp['on']['persist_8_writers_ms']['p50']:.1f} ms",
              flush=True)
        traced.shutdown()
    finally:
        ray.shutdown()
        shutil.rmtree(base, ignore_errors=True)

    pyplot = plt()
    fig, (a1, a2) = pyplot.subplots(1, 2, figsize=(11, 4))
    labels = [f"{a['payload']} B" for a in appends]
    a1.bar(labels, [a["appends_per_s"] / 1e6 for a in appends], color="#4c72b0")
    a1.axhline(1.0, color="red", ls="--", lw=1, label="target 1M/s at 64 B")
    a1.set_ylabel("million appends / s")
    a1.set_title("one writer, append()")
    for i, a in enumerate(appends):
        a1.text(i, a["appends_per_s"] / 1e6, f"{a['mb_per_s']:.0f} MB/s", ha="center",
                va="bottom")
    a1.legend()
    for r in persist:
        a2.plot(r["samples_ms"], label=f"{r['writers']} writers "
                f"(p50 {r['latency_ms']['p50']:.1f}, p99 {r['latency_ms']['p99']:.1f} ms)")
    a2.axhline(25, color="red", ls="--", lw=1, label="target p50 25 ms")
    a2.set_xlabel("checkpoint")
    a2.set_ylabel("persist_durably latency (ms)")
    a2.set_title("one node actor, file://, persist delay 10 ms")
    a2.legend(fontsize=8)
    write_results("append_throughput", {
        "quick": args.quick, "appends": appends,
        "persist": [{k: v for k, v in r.items() if k != "samples_ms"} for r in persist],
        "targets": {"appends_per_s_64B": 1_000_000, "persist_p50_ms": 25},
        "met": {"appends": appends[0]["appends_per_s"] >= 1_000_000,
                "persist_p50": all(r["latency_ms"]["p50"] < 25 for r in persist)},
        "tracing": tracing_cmp,
        "node_status": status,
    }, fig, args.out)


if __name__ == "__main__":
    main()
