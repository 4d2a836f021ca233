"""Fuzzing the readers of persisted data (issue "Reliability": a fuzzed reader).

    python -m experiments.fuzz [--quick]

Runs libFuzzer through atheris on the changelog file format and handle JSON, seeded with valid
files and handles, and hypothesis-style random inputs are covered by tests/unit. Writes
experiments/results/fuzz.json (+ .png): inputs tried per target, findings (must be 0).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

from .common import parser, plt, write_results


def seed_corpus(directory: str) -> None:
    from dstl_ray import ChangelogConfig, DirectTransport, KeyGroupRange, StateChangelogClient
    from dstl_ray.format import Changeset, assemble_file, encode_section

    os.makedirs(os.path.join(directory, "format"), exist_ok=True)
    os.makedirs(os.path.join(directory, "handle"), exist_ok=True)
    for i, comp in enumerate(("none", "zstd")):
        secs = [encode_section(bytes([j + 1]) * 16,
                               [Changeset(s, tuple((kg, b"v" * kg) for kg in range(4)))
                                for s in (1, 2)], comp) for j in range(2)]
        data, _ = assemble_file(secs)
        with open(os.path.join(directory, "format", f"seed{i}.dstl"), "wb") as f:
            f.write(data)
    t = DirectTransport("fuzz", f"memory://fuzz-seed-{os.getpid()}", ChangelogConfig())
    w = StateChangelogClient("fuzz", transport=t).create_writer("op", KeyGroupRange(0, 3))
    w.append(1, b"x")
    h = w.persist_durably(0).result(timeout=10)
    with open(os.path.join(directory, "handle", "seed.json"), "w") as f:
        f.write(h.to_json())


def run(target: str, runs: int, corpus: str) -> dict[str, object]:
    t0 = time.time()
    work = tempfile.mkdtemp(prefix=f"fuzz-{target}-")
    out = subprocess.run(
        [sys.executable, "-m", "experiments.fuzz_target", target, f"-runs={runs}",
         "-timeout=5", "-rss_limit_mb=2048", f"-artifact_prefix={work}/", work,
         os.path.join(corpus, target)],
        capture_output=True, text=True, timeout=3600)
    text = out.stderr
    done = re.findall(r"Done (\d+) runs", text)
    cov = re.findall(r"cov: (\d+)", text)
    crash = out.returncode != 0
    return {"target": target, "runs": int(done[-1]) if done else None,
            "coverage_edges": int(cov[-1]) if cov else None, "seconds": time.time() - t0,
            "findings": 1 if crash else 0,
            "finding": text[-3000:] if crash else None}


def main() -> None:
    args = parser(__doc__).parse_args()
    runs = 20_000 if args.quick else 300_000
    corpus = tempfile.mkdtemp(prefix="fuzz-corpus-")
    seed_corpus(corpus)
    results = [run(t, runs, corpus) for t in ("format", "handle")]
    for r in results:
        print(f"{r['target']:7}: {r['runs']} inputs, {r['coverage_edges']} edges, "
              f"{r['findings']} findings, {r['seconds']:.0f} s", flush=True)
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(6, 3))
    ax.bar([r["target"] for r in results], [r["runs"] or 0 for r in results])
    ax.set_ylabel("inputs tried (atheris/libFuzzer)")
    ax.set_title("fuzzed readers: findings " + ", ".join(
        f"{r['target']}={r['findings']}" for r in results))
    write_results("fuzz", {"quick": args.quick, "results": results}, fig, args.out)
    if any(r["findings"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
