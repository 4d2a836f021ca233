"""``dstl-ray demo`` / ``make demo``: the changelog end to end on a local Ray.

Starts a local Ray, deploys the tree on ``file://`` under ./demo-data, runs writers over a few
checkpoints without materialization: each checkpoint persists everything after the truncation
point, and every other checkpoint the writers truncate up to the checkpoint before (as a
backend would once state up to there is materialized). At the end it restores every writer's
changes from its last handle and checks them against what was appended after the truncation
point. Exits non-zero if any change is missing or wrong.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import time


def run_demo(args: argparse.Namespace) -> int:
    import ray

    from .. import ChangelogConfig, KeyGroupRange, StateChangelogClient, deploy
    from ..keygroups import key_group_range_for_subtask

    base = os.path.abspath(args.base_path or "demo-data")
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    print(f"[demo] starting a local Ray and deploying the changelog tree on file://{base}",
          flush=True)
    ray.init(namespace="dstl_demo", log_to_driver=False, include_dashboard=False)
    try:
        cfg = ChangelogConfig(namespace="dstl_demo")
        tree = deploy(f"file://{base}", cfg, detached=False)
        client = StateChangelogClient("demo-job", namespace="dstl_demo")
        max_par, n = 128, args.writers
        writers = [client.create_writer(f"op-{i}", key_group_range_for_subtask(max_par, n, i))
                   for i in range(n)]
        # appended[i]: (sqn, key group, value) of writer i, to check restores against
        appended: list[list[tuple[int, int, bytes]]] = [[] for _ in writers]
        after = [0] * n  # truncation point per writer
        cp_sqn: list[list[int]] = [[] for _ in writers]
        handles = []
        latencies = []
        truncated = 0
        rng = random.Random(7)
        for cp in range(1, args.checkpoints + 1):
            for i, w in enumerate(writers):
                kgr: KeyGroupRange = w.key_group_range
                for j in range(2000):
                    kg = rng.randint(kgr.start, kgr.end)
                    v = f"cp{cp}-w{i}-{j}".encode() * rng.randint(1, 4)
                    w.append(kg, v)
                    appended[i].append((cp, kg, v))
            t0 = time.perf_counter()
            futures = [w.persist_durably(after=after[i]) for i, w in enumerate(writers)]
            handles = [f.result(timeout=60) for f in futures]
            latencies.append((time.perf_counter() - t0) * 1000)
            for i, h in enumerate(handles):
                cp_sqn[i].append(h.sqn_to)
            files = {p for h in handles for p in h.file_paths()}
            print(f"[demo] checkpoint {cp}: {n} writers persisted in {latencies[-1]:.1f} ms; "
                  f"handles span {len(files)} file(s)", flush=True)
            if cp % 2 == 0:  # state up to the previous checkpoint counts as materialized
                for i, w in enumerate(writers):
                    after[i] = cp_sqn[i][-2]
                    w.truncate(before=after[i])
                truncated = cp - 1
        expected: list[dict[int, list[bytes]]] = [{} for _ in writers]
        for i in range(n):
            for cp, kg, v in appended[i]:
                if cp > truncated:
                    expected[i].setdefault(kg, []).append(v)
        # restore every writer from its last handle and compare
        bad = 0
        changes = 0
        for i, h in enumerate(handles):
            restored = h.read_all()
            restored = {kg: v for kg, v in restored.items() if v}
            changes += sum(len(v) for v in restored.values())
            if restored != expected[i]:
                bad += 1
                print(f"[demo] writer {i}: restored changes differ from what was appended!")
        status = tree.status()
        dstl_files = [f for _, _, fs in os.walk(base) for f in fs if f.endswith(".dstl")]
        print("\n[demo] summary", flush=True)
        print(f"  writers               {n}")
        print(f"  checkpoints           {args.checkpoints}")
        print(f"  persist latency       p50 {statistics.median(latencies):.1f} ms, "
              f"max {max(latencies):.1f} ms")
        print(f"  changelog files       {len(dstl_files)} "
              f"({sum(s.get('files_flushed', 0) for s in status)} flushed by the tree)")
        print(f"  bytes flushed         {sum(s.get('bytes_flushed', 0) for s in status)}")
        print(f"  changes restored      {changes}")
        print(f"  check                 {'OK' if bad == 0 else f'FAILED for {bad} writers'}",
              flush=True)
        client.close()
        tree.shutdown()
        return 0 if bad == 0 else 1
    finally:
        sys.stdout.flush()
        ray.shutdown()
