"""Incremental (changelog) vs full checkpoints (FLIP-158 "Motivation"; Flink incremental
checkpoints): a state of N keys (1M; --quick 50k), 1% of the keys updated between
checkpoints. Per checkpoint: bytes uploaded and duration with the changelog vs a full snapshot
each checkpoint; then recovery time from materialized state + changelog vs from a full
snapshot, and changelog replay MB/s.

Run: python -m experiments.incremental_vs_full [--quick] [--keys N]
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time

import dstl_ray as d
from dstl_ray.checkpoint.metadata import split_metadata_url
from dstl_ray.checkpoint.recovery import restore_backends
from dstl_ray.state.backend import RestoreSource
from dstl_ray.state.snapshot import ChangelogComponent, KeyedStateSnapshot

from .common import machine, parser, plt, summary, write_results

MAXP = 128
VALUE = 100


def _file_bytes(root: str) -> dict[str, int]:
    out = {}
    for dp, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(dp, f)
            out[p] = os.path.getsize(p)
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--keys", type=int, default=0)
    p.add_argument("--checkpoints", type=int, default=0)
    args = p.parse_args()
    n = args.keys or (50_000 if args.quick else 1_000_000)
    n_cp = args.checkpoints or (5 if args.quick else 10)
    changed = max(1, n // 100)
    rng = random.Random(1)
    tmp = tempfile.mkdtemp(prefix="dstl-ivf-")
    base = f"file://{tmp}"
    job_root = os.path.join(tmp, "job")
    try:
        client = d.StateChangelogClient("job", transport=d.DirectTransport("job", base))
        coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP, retained=1)
        (b,) = coord.restore(client, "op", 1, materialization_interval=None)
        vs = b.value_state("v")
        keys = [f"key-{i:08d}" for i in range(n)]
        t0 = time.perf_counter()
        for k in keys:
            vs.update(k, rng.randbytes(VALUE))
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        b.materialize().result()
        mat_s = time.perf_counter() - t0
        mat_bytes = sum(_file_bytes(job_root).values())
        coord.trigger_checkpoint().result()
        ser = d.TaggedSerializer()
        incr, full = [], []
        for _ in range(n_cp):
            upd = rng.sample(keys, changed)
            changed_bytes = 0
            for k in upd:
                v = rng.randbytes(VALUE)
                vs.update(k, v)
                changed_bytes += len(ser.serialize(k)) + len(ser.serialize(v))
            before = _file_bytes(job_root)
            t0 = time.perf_counter()
            cc = coord.trigger_checkpoint().result()
            dur = time.perf_counter() - t0
            after = _file_bytes(job_root)
            up = sum(s for f, s in after.items() if f not in before)
            incr.append({"uploaded_bytes": up, "changed_bytes": changed_bytes,
                         "ratio": up / changed_bytes, "duration_s": dur,
                         "metadata_bytes": cc.metadata_size})
            before = _file_bytes(job_root)
            t0 = time.perf_counter()
            sp = coord.trigger_savepoint().result()  # a full snapshot of the same state
            dur = time.perf_counter() - t0
            after = _file_bytes(job_root)
            full.append({"uploaded_bytes": sum(s for f, s in after.items() if f not in before),
                         "changed_bytes": changed_bytes, "duration_s": dur})
            if full and len(full) < n_cp:  # keep only the last full snapshot on disk
                shutil.rmtree(split_metadata_url(sp.metadata_url)[1].removeprefix("file://"))
        latest = coord.latest_checkpoint()
        want = b.dump()
        coord.shutdown()
        # recovery: materialized + changelog vs the full snapshot
        rclient = d.StateChangelogClient("job", transport=d.DirectTransport("job", base))
        t0 = time.perf_counter()
        (rb,) = restore_backends(rclient, latest, "op", 1, MAXP, materialization_interval=None)
        rec_changelog = time.perf_counter() - t0
        assert rb.dump() == want, "changelog restore differs"
        rb.close()
        spc = d.load_checkpoint(sp.metadata_url)
        t0 = time.perf_counter()
        (fb,) = restore_backends(rclient, spc, "op", 1, MAXP, materialization_interval=None)
        rec_full = time.perf_counter() - t0
        assert fb.dump() == want, "full restore differs"
        fb.close()
        # replay only: the changelog component alone
        snap = latest.metadata.snapshots[0]
        cl = [c for c in snap.components if isinstance(c, ChangelogComponent)]
        cl_bytes = sum(c.handle.state_size for c in cl)
        base_p, own = split_metadata_url(latest.metadata_url)
        src = RestoreSource(KeyedStateSnapshot("op", snap.key_group_range, tuple(cl)), base_p,
                            own, latest.metadata_url)
        t0 = time.perf_counter()
        d.ChangelogKeyedStateBackend(rclient, "op", snap.key_group_range, MAXP,
                                     restore=[src], materialization_interval=None).close()
        replay_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ratios = [c["ratio"] for c in incr]
    data = {
        "keys": n, "value_bytes": VALUE, "changed_per_checkpoint": changed,
        "checkpoints": n_cp, "load_s": load_s,
        "materialization": {"seconds": mat_s, "bytes": mat_bytes},
        "incremental": incr, "full": full,
        "incremental_uploaded_bytes": summary([c["uploaded_bytes"] for c in incr]),
        "full_uploaded_bytes": summary([c["uploaded_bytes"] for c in full]),
        "incremental_duration_s": summary([c["duration_s"] for c in incr]),
        "full_duration_s": summary([c["duration_s"] for c in full]),
        "upload_to_changed_ratio_max": max(ratios),
        "recovery": {"changelog_s": rec_changelog, "full_s": rec_full,
                     "ratio": rec_changelog / rec_full,
                     "changelog_bytes": cl_bytes, "replay_s": replay_s,
                     "replay_mb_per_s": cl_bytes / replay_s / 1e6},
        "targets": {"upload_within_2x_of_changed": max(ratios) <= 2.0,
                    "replay_at_least_100_mb_s": cl_bytes / replay_s / 1e6 >= 100,
                    "recovery_within_1_3x_of_full": rec_changelog / rec_full <= 1.3},
        "machine": machine(), "quick": args.quick,
    }
    pl = plt()
    fig, (a1, a2, a3) = pl.subplots(1, 3, figsize=(14, 4))
    xs = list(range(1, n_cp + 1))
    a1.plot(xs, [c["uploaded_bytes"] / 1e6 for c in incr], "o-", label="changelog")
    a1.plot(xs, [c["uploaded_bytes"] / 1e6 for c in full], "s-", label="full snapshot")
    a1.plot(xs, [c["changed_bytes"] / 1e6 for c in incr], "k--", label="changed bytes")
    a1.set_yscale("log")
    a1.set(xlabel="checkpoint", ylabel="MB uploaded", title="bytes per checkpoint")
    a1.legend()
    a2.plot(xs, [c["duration_s"] * 1e3 for c in incr], "o-", label="changelog")
    a2.plot(xs, [c["duration_s"] * 1e3 for c in full], "s-", label="full snapshot")
    a2.set(xlabel="checkpoint", ylabel="ms", title="checkpoint duration")
    a2.legend()
    a3.bar(["changelog\n(mat.+replay)", "full\nsnapshot"], [rec_changelog, rec_full])
    a3.set(ylabel="s", title=f"recovery ({n} keys), replay "
           f"{data['recovery']['replay_mb_per_s']:.0f} MB/s")
    fig.tight_layout()
    path = write_results("incremental_vs_full", data, fig, args.out)
    print(path)
    for k in ("incremental_uploaded_bytes", "full_uploaded_bytes", "incremental_duration_s",
              "full_duration_s", "upload_to_changed_ratio_max", "recovery", "targets"):
        print(k, data[k], flush=True)


if __name__ == "__main__":
    main()
