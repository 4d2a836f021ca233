"""One experiment, two revisions of this repository, in paired rounds: did a change make a
figure worse?

A figure taken from an earlier run's JSON says little on a machine whose speed drifts by a
quarter and more between minutes (the native aggregation's own speed varied 4x in one day
here). So each round runs the experiment once from each revision, one right after the other,
their order reversed every other round (:mod:`experiments.paired_rounds`); a figure's ratio is
the median of the rounds' paired ratios, oriented so that above 1 means ``head`` is better,
and a figure whose median is below ``1 - tolerance`` is marked worse. Each revision runs from
a git worktree of its own (``git worktree add --detach``), its packages first on
``PYTHONPATH`` (the Ray cluster and Spark the experiment starts inherit it), with this
interpreter, so both revisions see the same installed dependencies. Pick arguments both
revisions' experiment takes, and one experiment at a time on the machine.

Figures are read from each run's ``<module>.json`` by :data:`FIGURES` (the rows of
``spark_throughput``, the checkpoint latencies of ``vs_flink``); another experiment needs an
entry there. A figure only one revision's run has (a system it does not know) is listed
apart, not compared.

Run: python -m experiments.ab --base REV [--head REV] [--rounds 3] [--tolerance 0.1]
[--timeout S] -- MODULE [ARGS...] (writes ab_MODULE.json and .png under --out)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import parser, plt, run_in_group, write_results
from .paired_rounds import median_ratio, round_order

REPO = Path(__file__).resolve().parent.parent
# a figure no change of this repository moves (a peer system's, run by the same experiment):
# its ratio between the paired runs is the machine's drift, the noise floor of the others'
CONTROL = " (control)"


@dataclass(frozen=True)
class Figure:
    """One number of a run, and which way is better."""

    value: float
    higher_is_better: bool


def spark_throughput_figures(doc: dict[str, Any]) -> dict[str, Figure]:
    """Events/s of every system and size (each row: the system's median round); Spark's own
    systems are controls."""
    return {f"{r['system']} @ {r['events_per_batch']}/{r['keys']} events/s"
            f"{CONTROL if r['system'].startswith('Spark ') else ''}":
            Figure(float(r["events_per_s"]), True) for r in doc.get("rows", [])
            if r.get("events_per_s")}


def vs_flink_figures(doc: dict[str, Any]) -> dict[str, Figure]:
    """Per node count: dstl-ray's p50 until ``_metadata`` is durable and until the last
    acknowledgement, the even input's e2e p50 (median over the run's rounds), and Flink's
    e2e p50 as a control (no change of ours moves it: its ratio shows the machine's
    drift between the paired runs)."""
    out: dict[str, Figure] = {}
    for run in doc.get("runs", []):
        n = run["nodes"]
        ours = run.get("dstl_ray") or {}
        for name in ("e2e_ms", "ack_ms"):
            if isinstance(ours.get(name), dict):
                out[f"dstl-ray {name} p50 @ {n} nodes"] = Figure(float(ours[name]["p50"]), False)
        even = sorted(x["e2e_ms_p50"] for x in (run.get("per_round") or {}).get("even", [])
                      if x.get("e2e_ms_p50") is not None)
        if even:
            out[f"dstl-ray even e2e_ms p50 @ {n} nodes"] = Figure(even[(len(even) - 1) // 2],
                                                                   False)
        flink = run.get("flink") or {}
        if isinstance(flink.get("e2e_ms"), dict):
            out[f"Flink e2e_ms p50 @ {n} nodes{CONTROL}"] = Figure(
                float(flink["e2e_ms"]["p50"]), False)
    return out


# experiment module -> its figures, from the JSON it writes
FIGURES: dict[str, Callable[[dict[str, Any]], dict[str, Figure]]] = {
    "spark_throughput": spark_throughput_figures,
    "vs_flink": vs_flink_figures,
}


def compare(base: dict[int, dict[str, Figure]], head: dict[int, dict[str, Figure]],
            tolerance: float) -> dict[str, Any]:
    """Every figure both revisions measured in some round: the median of its paired ratios
    (``head`` over ``base`` when higher is better, ``base`` over ``head`` when lower is), each
    round's, and whether it is worse by more than ``tolerance``; the figures only one
    revision had; the figures worse but for the controls, and the controls' largest
    distance from 1 (``control_drift``: a figure that moved less than it may not have moved
    at all)."""
    names = {n for runs in (base, head) for figs in runs.values() for n in figs}
    rows, apart = [], []
    for name in sorted(names):
        b = {i: f[name] for i, f in base.items() if name in f}
        h = {i: f[name] for i, f in head.items() if name in f}
        higher = next(iter({**b, **h}.values())).higher_is_better
        up, down = (h, b) if higher else (b, h)
        got = median_ratio({i: f.value for i, f in up.items()},
                           {i: f.value for i, f in down.items()})
        if got is None:
            apart.append(name)
            continue
        rows.append({"figure": name, "higher_is_better": higher, "ratio": got["median"],
                     "per_round": got["per_round"], "worse": got["median"] < 1 - tolerance,
                     "base": [b[i].value for i in sorted(b)],
                     "head": [h[i].value for i in sorted(h)]})
    drift = [abs(1 - r["ratio"]) for r in rows if r["figure"].endswith(CONTROL)]
    return {"figures": rows, "only_one_revision": apart,
            "worse": [r["figure"] for r in rows if r["worse"]
                      and not r["figure"].endswith(CONTROL)],
            "control_drift": max(drift) if drift else None}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def run_once(tree: Path, module: str, args: Sequence[str], out: Path, log: Path,
             timeout_s: float) -> dict[str, Any]:
    """One run of ``experiments.<module>`` from ``tree``; its JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    rc = run_in_group([sys.executable, "-m", f"experiments.{module}", *args, "--out", str(out)],
                      str(log), timeout_s, env, str(tree))
    path = out / f"{module}.json"
    if rc != 0 or not path.exists():
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"experiments.{module} from {tree} "
                           f"{'timed out' if rc is None else f'exited with {rc}'} "
                           f"(log {log}):\n{tail}")
    return json.loads(path.read_text())


def plot(result: dict[str, Any], title: str) -> Any:
    pyplot = plt()
    rows = result["figures"]
    fig, ax = pyplot.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    ax.barh([r["figure"] for r in rows], [r["ratio"] for r in rows],
            color=["tab:gray" if r["figure"].endswith(CONTROL) else "tab:red"
                   if r["worse"] else "tab:blue" for r in rows])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xlabel("head vs base (median of paired rounds; > 1: head better)")
    ax.set_title(title, fontsize=9)
    ax.invert_yaxis()
    return fig


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    p = parser(__doc__)
    p.add_argument("--base", required=True, help="the revision to compare against")
    p.add_argument("--head", default="HEAD", help="the revision under test")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tolerance", type=float, default=0.1,
                   help="a figure is worse when its median ratio is below 1 - this")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per run")
    p.add_argument("--repo", default=str(REPO), help="the git repository (this one)")
    args = p.parse_args(ours)
    if not rest:
        p.error("name the experiment after --: -- MODULE [ARGS...]")
    module, margs = rest[0], rest[1:]
    if module not in FIGURES:
        p.error(f"no figures are defined for experiment {module!r} (experiments.ab.FIGURES "
                f"has {sorted(FIGURES)})")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    repo = Path(args.repo)
    revs = {"base": git(repo, "rev-parse", "--verify", f"{args.base}^{{commit}}"),
            "head": git(repo, "rev-parse", "--verify", f"{args.head}^{{commit}}")}
    work = Path(tempfile.mkdtemp(prefix="dstl-ab-"))
    trees = {}
    runs: dict[str, dict[int, dict[str, Figure]]] = {"base": {}, "head": {}}
    done = False
    try:
        for side, rev in revs.items():
            trees[side] = work / side
            git(repo, "worktree", "add", "--detach", str(trees[side]), rev)
        for i in range(args.rounds):
            for side in round_order(["base", "head"], i):
                out = work / f"{side}-{i}"
                print(f"[ab] round {i}: {side} ({revs[side][:10]})", flush=True)
                doc = run_once(trees[side], module, margs, out, work / f"{side}-{i}.log",
                               args.timeout)
                runs[side][i] = FIGURES[module](doc)
        done = True
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force",
                            str(tree)], capture_output=True)
        if done:
            shutil.rmtree(work, ignore_errors=True)
        else:  # the runs' logs and JSON stay for a look
            print(f"[ab] the runs' logs are kept in {work}", file=sys.stderr, flush=True)
    result = compare(runs["base"], runs["head"], args.tolerance)
    for r in result["figures"]:
        print(f"[ab] {r['figure']}: {r['ratio']:.2f}x "
              f"({', '.join(f'{x:.2f}' for x in r['per_round'])})"
              f"{'  WORSE' if r['figure'] in result['worse'] else ''}", flush=True)
    if result["control_drift"] is not None:
        print(f"[ab] the controls moved by up to {result['control_drift']:.0%}", flush=True)
    data = {"command": " ".join(["python -m experiments.ab", *argv]), "revisions": revs,
            "rounds": args.rounds, "tolerance": args.tolerance, **result}
    write_results(f"ab_{module}", data,
                  plot(result, f"{module}: {revs['head'][:10]} vs {revs['base'][:10]}, "
                               f"{args.rounds} paired rounds"), args.out)
    return data


if __name__ == "__main__":
    main()
