"""Fuzzing the readers of persisted data (issue "Reliability": a fuzzed reader).

    python -m experiments.fuzz [--quick]

Runs libFuzzer through atheris on every reader of persisted data (experiments/fuzz_target.py):
changelog files ("format"), handle JSON ("handle"), checkpoint ``_metadata`` through the restore
("metadata"), materialized ``.dstm`` files ("materialized") and state change records ("records"),
seeded with valid files from a real job (experiments/fuzz_seeds.py); hypothesis-style random
inputs are covered by tests/unit. Writes experiments/results/fuzz.json (+ .png): inputs tried
per target, findings (must be 0).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

from .common import parser, plt, write_results

# target -> the reader it drives (experiments/fuzz_target.py)
READERS = {
    "format": "decode_file, iter_blocks (.dstl changelog files)",
    "handle": "StateChangelogHandle.from_json",
    "metadata": "load_checkpoint + the restore's reads (_metadata JSON)",
    "materialized": "read_sections + apply_records (.dstm files)",
    "records": "apply_records vs apply_record, TaggedSerializer.deserialize",
}
TARGETS = tuple(READERS)
MAX_LEN = 16384  # bytes per input: room for the largest seed (12 KB of records) to grow


def seed_corpus(directory: str) -> dict[str, str]:
    """One seed directory per target under ``directory``, from valid files the real code wrote
    (the seed job's files stay in ``directory/dfs``); returns the environment the targets
    need (the "metadata" target loads inputs as the savepoint's ``_metadata`` there)."""
    from dstl_ray import ChangelogConfig, DirectTransport, KeyGroupRange, StateChangelogClient
    from dstl_ray.format.changelog import Changeset, assemble_file, encode_section

    from .fuzz_seeds import METADATA_ENV, build_job, write_seeds

    for target in TARGETS:
        os.makedirs(os.path.join(directory, target), exist_ok=True)
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
    job = build_job("file://" + os.path.abspath(os.path.join(directory, "dfs")))
    write_seeds(directory, job)
    return {METADATA_ENV: job.savepoint}


def run(target: str, runs: int, corpus: str, env: dict[str, str]) -> dict[str, object]:
    t0 = time.time()
    work = tempfile.mkdtemp(prefix=f"fuzz-{target}-")
    out = subprocess.run(
        [sys.executable, "-m", "experiments.fuzz_target", target, f"-runs={runs}",
         f"-max_len={MAX_LEN}", "-timeout=5", "-rss_limit_mb=2048",
         f"-artifact_prefix={work}/", work, os.path.join(corpus, target)],
        capture_output=True, text=True, timeout=3600, env={**os.environ, **env})
    text = out.stderr
    done = re.findall(r"Done (\d+) runs", text)
    cov = re.findall(r"cov: (\d+)", text)
    crash = out.returncode != 0
    return {"target": target, "reader": READERS[target], "runs": int(done[-1]) if done else None,
            "coverage_edges": int(cov[-1]) if cov else None, "seconds": time.time() - t0,
            "findings": 1 if crash else 0,
            "finding": text[-3000:] if crash else None}


def main() -> None:
    args = parser(__doc__).parse_args()
    runs = 20_000 if args.quick else 300_000
    corpus = tempfile.mkdtemp(prefix="fuzz-corpus-")
    env = seed_corpus(corpus)
    results = [run(t, runs, corpus, env) for t in TARGETS]
    for r in results:
        print(f"{r['target']:12}: {r['runs']} inputs, {r['coverage_edges']} edges, "
              f"{r['findings']} findings, {r['seconds']:.0f} s", flush=True)
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(7.5, 3.2))
    bars = ax.bar([r["target"] for r in results], [r["runs"] or 0 for r in results])
    ax.bar_label(bars, [f"{r['findings']} findings\n{r['coverage_edges']} edges"
                        for r in results], fontsize=8)
    ax.set_ylabel("inputs tried (atheris/libFuzzer)")
    ax.margins(y=0.25)
    ax.set_title(f"fuzzed readers of persisted data: "
                 f"{sum(r['findings'] for r in results)} findings")
    write_results("fuzz", {"quick": args.quick, "results": results}, fig, args.out)
    if any(r["findings"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
