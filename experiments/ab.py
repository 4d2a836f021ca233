"""One experiment, two revisions of this repository, in paired rounds: did a change make a
figure worse?

A figure taken from an earlier run's JSON says little on a machine whose speed drifts by a
quarter and more between minutes (the native aggregation's own speed varied 4x in one day
here). So each round runs the experiment once from each revision, one right after the other,
their order reversed every other round (:mod:`experiments.paired_rounds`); a figure's ratio is
the median of the rounds' paired ratios (an odd number of rounds), oriented so that above 1
means ``head`` is better. A figure is worse when that median is below ``1 - tolerance``, when
``head`` gave no number for it in a round, or when ``head``'s runs lack it altogether (a
system dropped, renamed or broken). Peer systems' figures are controls: never worse, their
spread is the noise floor. Each revision runs from a git worktree of its own
(``git worktree add --detach``: committed code only), its packages first on ``PYTHONPATH``
(the Ray cluster and Spark the experiment starts inherit it), with this interpreter, so both
revisions see the same installed dependencies. Pick arguments both revisions' experiment
takes (absolute paths: each run starts in its worktree), and one experiment at a time on
the machine.

Figures are read from each run's ``<module>.json`` by :data:`FIGURES` (the rows of
``spark_throughput`` the run measured, the checkpoint latencies of ``vs_flink``, each
``large_state`` row's times, bytes and memory); another
experiment needs an entry there.

Where head's experiment changed: ``--head-args`` gives head's runs more arguments (an option
base does not know, such as one that leaves out a row base never had; a later option of the
same name wins; write it ``--head-args=--opt``, as argparse takes a lone ``--opt`` for an
option), and ``--head-names NEW=OLD`` compares a system head renamed with base's
under its old name (head's figures whose names start with NEW are read as starting with OLD).

Run: python -m experiments.ab --base REV [--head REV] [--rounds 3] [--tolerance 0.1]
[--timeout S] [--out DIR] [--head-args="ARGS"] [--head-names NEW=OLD ...] -- MODULE [ARGS...]
(writes ab_MODULE.json and .png)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import RESULTS, plt, run_in_group, write_results
from .paired_rounds import median_item, median_ratio, round_order

REPO = Path(__file__).resolve().parent.parent
# a peer system's figure, run by the same experiment: its ratio between the paired runs is
# mostly the machine's drift, the noise floor of the others' (mostly: it runs through this
# repository's harness, e.g. spark_glue.start_spark, so a change there can move it too)
CONTROL = " (control)"


@dataclass(frozen=True)
class Figure:
    """One number of a run, and which way is better."""

    value: float
    higher_is_better: bool


def spark_throughput_figures(doc: dict[str, Any]) -> dict[str, Figure]:
    """Events/s of every system and size the run measured (each row: the system's median
    round; a row kept from an earlier run, ``from_run``, is not this run's); Spark's own
    systems are controls."""
    return {f"{r['system']} @ {r['events_per_batch']}/{r['keys']} events/s"
            f"{CONTROL if r['system'].startswith('Spark ') else ''}":
            Figure(float(r.get("events_per_s") or math.nan), True)
            for r in doc.get("rows", []) if "from_run" not in r}


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
        even = [x["e2e_ms_p50"] for x in (run.get("per_round") or {}).get("even", [])
                if x.get("e2e_ms_p50") is not None]
        if even:
            out[f"dstl-ray even e2e_ms p50 @ {n} nodes"] = Figure(median_item(even, float),
                                                                   False)
        flink = run.get("flink") or {}
        if isinstance(flink.get("e2e_ms"), dict):
            out[f"Flink e2e_ms p50 @ {n} nodes{CONTROL}"] = Figure(
                float(flink["e2e_ms"]["p50"]), False)
    return out


# large_state: each row's figures (all lower-is-better); Spark's own row is a control
LARGE_STATE_FIGURES = ("ckpt_ms_p50", "ckpt_ms_p99", "mat_ms_p50", "mat_upload_bytes",
                       "peak_rss_mb", "peak_rss_mb_per_executor", "recovery_s",
                       "batch_ms_p50", "restart_first_batch_ms")


def large_state_figures(doc: dict[str, Any]) -> dict[str, Figure]:
    """Per backend row the run measured (a row kept from an earlier run, ``from_run``, is
    not this run's): checkpoint p50/p99, materialization time and upload bytes, peak RSS,
    recovery time, and the operator's update-batch and restart-first-batch times, each lower
    is better; Spark's RocksDB store's row is a control. The long run's row too, as
    ``rocksdb long``."""
    rows = [r for r in doc.get("rows", []) if "from_run" not in r]
    long_run = doc.get("long_run")
    if isinstance(long_run, dict) and "from_run" not in long_run:
        rows.append({**long_run, "backend": f"{long_run.get('backend')} long"})
    return {f"{r['backend']} {name}{CONTROL if r['backend'].startswith('spark') else ''}":
            Figure(float(r[name]) if r[name] is not None else math.nan, False)
            for r in rows for name in LARGE_STATE_FIGURES if name in r}


# experiment module -> its figures, from the JSON it writes
FIGURES: dict[str, Callable[[dict[str, Any]], dict[str, Figure]]] = {
    "spark_throughput": spark_throughput_figures,
    "vs_flink": vs_flink_figures,
    "large_state": large_state_figures,
}


def compare(base: dict[int, dict[str, Figure]], head: dict[int, dict[str, Figure]],
            tolerance: float) -> dict[str, Any]:
    """Every figure both revisions measured: the median of its paired ratios (``head`` over
    ``base`` when higher is better, ``base`` over ``head`` when lower is; an odd number of
    rounds, or the lower middle is taken), each round's, and whether it is worse: by more
    than ``tolerance``, or ``head`` gave no number (NaN, infinite) in a round, or no round
    has both. A figure ``base`` has and ``head`` never gave (a system it dropped, renamed
    or broke) is worse too (``missing_in_head``); one only ``head`` has is apart
    (``only_in_head``). Controls (:data:`CONTROL`) are never worse: their largest distance
    from 1 is ``control_drift`` (a figure that moved less may not have moved at all), and
    those past the tolerance are ``controls_moved``."""
    names = {n for runs in (base, head) for figs in runs.values() for n in figs}
    rows, missing, new = [], [], []
    for name in sorted(names):
        b = {i: f[name] for i, f in base.items() if name in f}
        h = {i: f[name] for i, f in head.items() if name in f}
        if not h or not b:
            (missing if b else new).append(name)
            continue
        higher = next(iter(b.values())).higher_is_better
        failed = sorted(i for i, f in h.items() if not math.isfinite(f.value))
        bv = {i: f.value for i, f in b.items() if math.isfinite(f.value)}
        hv = {i: f.value for i, f in h.items() if math.isfinite(f.value)}
        got = median_ratio(hv, bv) if higher else median_ratio(bv, hv)
        ratio = got["median"] if got is not None else math.nan
        rows.append({"figure": name, "higher_is_better": higher, "ratio": ratio,
                     "per_round": got["per_round"] if got is not None else [],
                     "worse": bool(failed) or got is None or ratio < 1 - tolerance,
                     "head_failed_rounds": failed,
                     "base": [b[i].value for i in sorted(b)],
                     "head": [h[i].value for i in sorted(h)]})
    controls = [r for r in rows if r["figure"].endswith(CONTROL)]
    drift = [abs(1 - r["ratio"]) for r in controls if math.isfinite(r["ratio"])]
    return {"figures": rows, "missing_in_head": missing, "only_in_head": new,
            "worse": [r["figure"] for r in rows
                      if r["worse"] and not r["figure"].endswith(CONTROL)]
            + [n for n in missing if not n.endswith(CONTROL)],
            "control_drift": max(drift) if drift else None,
            "controls_moved": [r["figure"] for r in controls if r["worse"]]}


def git(repo: Path, *args: str) -> str:
    got = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if got.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {repo} failed: {got.stderr.strip()}")
    return got.stdout.strip()


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


def figures_of(module: str, doc: dict[str, Any], side: str, i: int) -> dict[str, Figure]:
    try:
        return FIGURES[module](doc)
    except (KeyError, TypeError, ValueError) as e:
        raise RuntimeError(f"the JSON of {side}'s run {i} of experiments.{module} is not "
                           f"what experiments.ab.FIGURES reads ({type(e).__name__}: {e})"
                           ) from e


def renamed(figures: dict[str, Figure], names: Sequence[tuple[str, str]]
            ) -> dict[str, Figure]:
    """``figures`` with each name that starts with a ``new`` of ``names`` starting with its
    ``old`` instead (``--head-names``: a system head renamed, compared with base's under
    its old name); the longest ``new`` that matches wins (``dstl-ray vectorized + map-side
    combine`` before ``dstl-ray vectorized``). A pair that renames none of the figures (a
    mistyped name) and two figures given one name are errors, not a comparison of
    something else."""
    pairs = sorted(names, key=lambda p: len(p[0]), reverse=True)
    out: dict[str, Figure] = {}
    used: set[str] = set()
    for name, fig in figures.items():
        for new, old in pairs:
            if name.startswith(new):
                name = old + name[len(new):]
                used.add(new)
                break
        if name in out:
            raise ValueError(f"--head-names gives two of head's figures the name {name!r}")
        out[name] = fig
    unused = [new for new, _old in pairs if new not in used]
    if unused:
        raise ValueError(f"--head-names: no figure of head's run starts with {unused} "
                         f"(its figures: {sorted(figures)})")
    return out


def _name_pairs(given: Sequence[str]) -> list[tuple[str, str]]:
    pairs = []
    for g in given:
        new, sep, old = g.partition("=")
        if not sep or not new or not old:
            raise ValueError(f"--head-names takes NEW=OLD, got {g!r}")
        pairs.append((new, old))
    return pairs


def remove_worktrees(repo: Path, trees: Sequence[Path]) -> None:
    for tree in trees:
        got = subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force",
                              str(tree)], capture_output=True, text=True)
        if got.returncode != 0:
            print(f"[ab] worktree {tree} not removed: {got.stderr.strip()}", file=sys.stderr,
                  flush=True)
    subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base", required=True, help="the revision to compare against")
    p.add_argument("--head", default="HEAD",
                   help="the revision under test (a commit: uncommitted changes are not in it)")
    p.add_argument("--rounds", type=int, default=3, help="an odd number of paired rounds")
    p.add_argument("--tolerance", type=float, default=0.1,
                   help="a figure is worse when its median ratio is below 1 - this")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per run")
    p.add_argument("--out", default=RESULTS, help="directory for ab_MODULE.json and .png")
    p.add_argument("--repo", default=str(REPO), help="the git repository (this one)")
    p.add_argument("--head-args", default="",
                   help="more arguments for head's runs only (shell words): an option base's "
                        "experiment does not know, e.g. to leave out a row base never had")
    p.add_argument("--head-names", action="append", default=[], metavar="NEW=OLD",
                   help="compare head's figures whose names start with NEW with base's that "
                        "start with OLD (a system renamed since base; repeatable)")
    args = p.parse_args(ours)
    if not rest:
        p.error("name the experiment after --: -- MODULE [ARGS...]")
    module, margs = rest[0], rest[1:]
    if module not in FIGURES:
        p.error(f"no figures are defined for experiment {module!r} (experiments.ab.FIGURES "
                f"has {sorted(FIGURES)})")
    extra = shlex.split(args.head_args)
    try:
        names = _name_pairs(args.head_names)
    except ValueError as e:
        p.error(str(e))
    if any(a == "--out" or a.startswith("--out=") for a in [*margs, *extra]):
        p.error("--out goes before --: each run's output directory is ab's to choose")
    if args.rounds < 1 or args.rounds % 2 == 0:
        p.error(f"--rounds must be odd (a median of paired rounds), got {args.rounds}")
    repo = Path(args.repo)
    revs = {"base": git(repo, "rev-parse", "--verify", f"{args.base}^{{commit}}"),
            "head": git(repo, "rev-parse", "--verify", f"{args.head}^{{commit}}")}
    if args.head == "HEAD" and git(repo, "status", "--porcelain", "--untracked-files=no"):
        print("[ab] the working tree has uncommitted changes: head is the last commit, "
              "without them", file=sys.stderr, flush=True)
    work = Path(tempfile.mkdtemp(prefix="dstl-ab-"))
    trees: list[Path] = []
    runs: dict[str, dict[int, dict[str, Figure]]] = {"base": {}, "head": {}}
    done = False
    try:
        for side, rev in revs.items():
            trees.append(work / side)
            git(repo, "worktree", "add", "--detach", str(work / side), rev)
        for i in range(args.rounds):
            for side in round_order(["base", "head"], i):
                out = work / f"{side}-{i}"
                print(f"[ab] round {i}: {side} ({revs[side][:10]})", flush=True)
                doc = run_once(work / side, module,
                               [*margs, *(extra if side == "head" else [])], out,
                               work / f"{side}-{i}.log", args.timeout)
                figs = figures_of(module, doc, side, i)
                runs[side][i] = renamed(figs, names) if side == "head" else figs
        done = True
    finally:
        remove_worktrees(repo, trees)
        if done:
            shutil.rmtree(work, ignore_errors=True)
        else:  # the runs' logs and JSON stay for a look
            print(f"[ab] the runs' logs are kept in {work}", file=sys.stderr, flush=True)
    result = compare(runs["base"], runs["head"], args.tolerance)
    for r in result["figures"]:
        print(f"[ab] {r['figure']}: {r['ratio']:.2f}x "
              f"({', '.join(f'{x:.2f}' for x in r['per_round'])})"
              f"{'  WORSE' if r['figure'] in result['worse'] else ''}", flush=True)
    for name in result["missing_in_head"]:
        print(f"[ab] {name}: base has it, head gave none", flush=True)
    for name in result["only_in_head"]:
        print(f"[ab] {name}: head has it, base gave none", flush=True)
    if result["control_drift"] is not None:
        print(f"[ab] the controls moved by up to {result['control_drift']:.0%}", flush=True)
    data = {"command": f"python -m experiments.ab {shlex.join(argv)}", "revisions": revs,
            "rounds": args.rounds, "tolerance": args.tolerance, **result}
    write_results(f"ab_{module}", data,
                  plot(result, f"{module}: {revs['head'][:10]} vs {revs['base'][:10]}, "
                               f"{args.rounds} paired rounds"), args.out)
    return data


if __name__ == "__main__":
    main()
