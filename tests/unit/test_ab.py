"""experiments.ab: an experiment from two revisions in paired rounds, each figure's ratio
oriented so above 1 is better for head, a figure worse by more than the tolerance marked."""

from __future__ import annotations

import json
import math
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from experiments.ab import (
    Figure,
    compare,
    large_state_figures,
    main,
    renamed,
    spark_throughput_figures,
    vs_flink_figures,
)
from experiments.large_state import _kept


def test_ratios_are_oriented_by_which_way_is_better():
    base = {0: {"eps": Figure(1000, True), "ms": Figure(10, False)},
            1: {"eps": Figure(1100, True), "ms": Figure(12, False)},
            2: {"eps": Figure(900, True), "ms": Figure(10, False)}}
    head = {0: {"eps": Figure(800, True), "ms": Figure(9, False), "new": Figure(1, True)},
            1: {"eps": Figure(990, True), "ms": Figure(10, False), "new": Figure(1, True)},
            2: {"eps": Figure(810, True), "ms": Figure(10, False), "new": Figure(1, True)}}
    got = compare(base, head, tolerance=0.1)
    rows = {r["figure"]: r for r in got["figures"]}
    assert rows["eps"]["per_round"] == pytest.approx([0.8, 0.9, 0.9])
    assert rows["eps"]["ratio"] == pytest.approx(0.9) and not rows["eps"]["worse"]
    # lower is better: base over head, so a faster head is above 1
    assert rows["ms"]["per_round"] == pytest.approx([10 / 9, 1.2, 1.0])
    assert rows["ms"]["ratio"] == pytest.approx(10 / 9) and not rows["ms"]["worse"]
    assert got["only_in_head"] == ["new"] and got["worse"] == []
    assert got["missing_in_head"] == [] and got["control_drift"] is None
    tight = compare(base, head, tolerance=0.05)
    assert tight["worse"] == ["eps"]


def test_a_control_is_never_worse_and_gives_the_drift():
    base = {0: {"ours": Figure(100, True), "peer (control)": Figure(100, True)}}
    head = {0: {"ours": Figure(70, True), "peer (control)": Figure(75, True)}}
    got = compare(base, head, 0.1)
    assert got["worse"] == ["ours"]
    assert [r["worse"] for r in got["figures"]] == [True, True]
    assert got["control_drift"] == pytest.approx(0.25)


def test_no_number_from_head_or_a_figure_head_lacks_is_worse():
    nan = float("nan")
    base = {i: {"eps": Figure(100, True), "ms": Figure(10, False), "gone": Figure(5, True),
                "peer (control)": Figure(1, True)} for i in range(3)}
    head = {0: {"eps": Figure(120, True), "ms": Figure(nan, False)},
            1: {"eps": Figure(nan, True), "ms": Figure(9, False)},
            2: {"eps": Figure(130, True), "ms": Figure(9, False)}}
    got = compare(base, head, 0.1)
    rows = {r["figure"]: r for r in got["figures"]}
    # the rounds that have a number still pair; the round without one makes it worse
    assert rows["eps"]["per_round"] == pytest.approx([1.2, 1.3])
    assert rows["eps"]["head_failed_rounds"] == [1] and rows["eps"]["worse"]
    assert rows["ms"]["head_failed_rounds"] == [0] and rows["ms"]["worse"]
    assert got["missing_in_head"] == ["gone", "peer (control)"]
    assert got["worse"] == ["eps", "ms", "gone"]  # a control never is
    only_nan = compare({0: {"x": Figure(1, True)}}, {0: {"x": Figure(nan, True)}}, 0.1)
    assert only_nan["worse"] == ["x"] and only_nan["figures"][0]["per_round"] == []


def test_a_round_that_measured_one_side_only_is_not_paired():
    base = {0: {"x": Figure(100, True)}, 1: {"x": Figure(100, True)}}
    head = {1: {"x": Figure(50, True)}}
    row = compare(base, head, 0.1)["figures"][0]
    assert row["per_round"] == [0.5] and row["worse"]


def test_figures_of_the_experiments_json():
    tp = {"rows": [{"system": "Spark groupBy().agg()", "events_per_batch": 10000, "keys": 1000,
                    "events_per_s": 5000.0},
                   {"system": "kept", "events_per_batch": 1, "keys": 1, "events_per_s": 9.0,
                    "from_run": "2026-11-24 05:33:25"}]}
    tp["rows"].append({"system": "dstl-ray vectorized", "events_per_batch": 10000,
                       "keys": 1000, "events_per_s": 6000.0})
    assert spark_throughput_figures(tp) == {  # not the row kept from an earlier run
        "Spark groupBy().agg() @ 10000/1000 events/s (control)": Figure(5000.0, True),
        "dstl-ray vectorized @ 10000/1000 events/s": Figure(6000.0, True)}
    no_number = spark_throughput_figures({"rows": [{"system": "s", "events_per_batch": 1,
                                                     "keys": 1, "events_per_s": None}]})
    assert math.isnan(no_number["s @ 1/1 events/s"].value)
    vf = {"runs": [{"nodes": 2, "dstl_ray": {"e2e_ms": {"p50": 9.0}, "ack_ms": {"p50": 5.0}},
                    "flink": {"e2e_ms": {"p50": 14.0}},
                    "per_round": {"even": [{"e2e_ms_p50": 21.0}, {"e2e_ms_p50": 25.0},
                                           {"e2e_ms_p50": 23.0}]}}]}
    assert vs_flink_figures(vf) == {
        "dstl-ray e2e_ms p50 @ 2 nodes": Figure(9.0, False),
        "dstl-ray ack_ms p50 @ 2 nodes": Figure(5.0, False),
        "dstl-ray even e2e_ms p50 @ 2 nodes": Figure(23.0, False),
        "Flink e2e_ms p50 @ 2 nodes (control)": Figure(14.0, False)}



def test_large_state_figures_are_this_runs_rows_and_spark_is_a_control(tmp_path):
    doc = {"rows": [{"backend": "rocksdb", "ckpt_ms_p50": 17.9, "recovery_s": 0.33,
                     "peak_rss_mb": None},
                    {"backend": "heap", "ckpt_ms_p50": 20.7, "from_run": "2026-11-24"},
                    {"backend": "spark-rocksdb", "batch_ms_p50": 17149.0},
                    {"backend": "dstl-ray-operator-rocksdb", "batch_ms_p50": 3945.0,
                     "restart_first_batch_ms": 3833, "peak_rss_mb_per_executor": 7170.0}],
           "long_run": {"backend": "rocksdb", "mat_ms_p50": 23.7}}
    got = large_state_figures(doc)
    nan = got.pop("rocksdb peak_rss_mb")
    assert math.isnan(nan.value) and not nan.higher_is_better
    assert got == {"rocksdb ckpt_ms_p50": Figure(17.9, False),
                   "rocksdb recovery_s": Figure(0.33, False),
                   "spark-rocksdb batch_ms_p50 (control)": Figure(17149.0, False),
                   "dstl-ray-operator-rocksdb batch_ms_p50": Figure(3945.0, False),
                   "dstl-ray-operator-rocksdb restart_first_batch_ms": Figure(3833.0, False),
                   "dstl-ray-operator-rocksdb peak_rss_mb_per_executor": Figure(7170.0, False),
                   "rocksdb long mat_ms_p50": Figure(23.7, False)}
    # a run of some rows (--only) keeps the others and the long run, marked: not its figures
    earlier = tmp_path / "large_state.json"
    earlier.write_text(json.dumps({**doc, "machine": {"date": "2026-11-29 04:42:48"}}))
    rows, long_run = _kept(str(earlier), {"operator"})
    assert {r["backend"] for r in rows} == {"rocksdb", "heap", "spark-rocksdb"}
    assert large_state_figures({"rows": rows, "long_run": long_run}) == {}

TOY = '''"""A stand-in spark_throughput: rows from its own revision's dstl_ray package."""
import json, os, sys
from pathlib import Path
from dstl_ray.marker import ROWS, NAME
assert sys.argv[1:3] == ["--events", "10"], sys.argv
out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
with open(os.environ["AB_TOY_LOG"], "a") as f:
    f.write(" ".join([NAME, *sys.argv[3:sys.argv.index("--out")]]) + "\\n")
rows = [{"system": s, "events_per_batch": 10, "keys": 1, "events_per_s": v}
        for s, v in ROWS.items()]
(out / "spark_throughput.json").write_text(json.dumps({"rows": rows}))
'''


def _commit(repo: Path, rows: dict[str, float], name: str) -> str:
    (repo / "experiments" / "spark_throughput.py").write_text(TOY)
    (repo / "dstl_ray" / "marker.py").write_text(f"ROWS = {rows!r}\nNAME = {name!r}\n")
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-qm", name], check=True)
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()


def test_two_revisions_of_a_repository_run_in_worktrees_and_a_slower_one_is_marked(
        tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    for pkg in ("experiments", "dstl_ray"):  # (this project's dstl_ray has no marker)
        (repo / pkg).mkdir(parents=True)
        (repo / pkg / "__init__.py").write_text("")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    old = _commit(repo, {"slower": 1000.0, "faster": 500.0}, "base")
    new = _commit(repo, {"slower": 800.0, "faster": 600.0}, "head")
    log = tmp_path / "runs.log"
    monkeypatch.setenv("AB_TOY_LOG", str(log))
    out = tmp_path / "out"
    data = main(["--repo", str(repo), "--base", old[:8], "--rounds", "3", "--out", str(out),
                 "--head-args", "--new-only 'a b'", "--", "spark_throughput", "--events", "10"])
    # each revision's own packages, in alternating order; head's runs get --head-args
    head = "head --new-only a b"
    assert log.read_text().splitlines() == ["base", head, head, "base", "base", head]
    assert data["revisions"] == {"base": old, "head": new}
    rows = {r["figure"]: r for r in data["figures"]}
    assert rows["slower @ 10/1 events/s"]["ratio"] == pytest.approx(0.8)
    assert rows["faster @ 10/1 events/s"]["ratio"] == pytest.approx(1.2)
    assert data["worse"] == ["slower @ 10/1 events/s"]
    written = json.loads((out / "ab_spark_throughput.json").read_text())
    assert "--new-only 'a b'" in shlex.split(written["command"])  # a shell's words again
    assert written["worse"] == data["worse"] and (out / "ab_spark_throughput.png").exists()
    # the worktrees are gone
    trees = subprocess.run(["git", "-C", str(repo), "worktree", "list"], check=True,
                           capture_output=True, text=True).stdout.strip().splitlines()
    assert len(trees) == 1


def test_an_experiment_without_figures_or_a_failing_run_is_an_error(tmp_path, capsys):
    for bad, says in ((["--", "no_such_experiment"], "no figures are defined"),
                      (["--rounds", "2", "--", "spark_throughput"], "--rounds must be odd"),
                      (["--", "spark_throughput", "--out", "x"], "--out goes before --")):
        with pytest.raises(SystemExit):
            main(["--base", "HEAD", *bad])
        assert says in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="no-such-revision"):
        main(["--base", "no-such-revision", "--out", str(tmp_path / "o"), "--",
              "spark_throughput"])
    repo = tmp_path / "repo"
    (repo / "experiments").mkdir(parents=True)
    (repo / "experiments" / "__init__.py").write_text("")
    (repo / "experiments" / "spark_throughput.py").write_text("raise SystemExit(3)\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-qm", "x"], check=True)
    with pytest.raises(RuntimeError, match="exited with 3") as e:
        main(["--repo", str(repo), "--base", "HEAD", "--rounds", "1",
              "--out", str(tmp_path / "out"), "--", "spark_throughput"])
    log = Path(str(e.value).split("(log ")[1].split(")")[0])
    assert log.exists()  # kept for a look; the worktrees are not
    shutil.rmtree(log.parent)
    assert len(subprocess.run(["git", "-C", str(repo), "worktree", "list"], check=True,
                              capture_output=True, text=True).stdout.strip().splitlines()) == 1


def test_head_names_compare_a_renamed_system_with_its_old_name(capsys):
    figs = {"new sys @ 10/1 events/s": Figure(1.0, True), "other @ 10/1 events/s":
            Figure(2.0, True)}
    got = renamed(figs, [("new sys", "old sys")])
    assert got == {"old sys @ 10/1 events/s": Figure(1.0, True),
                   "other @ 10/1 events/s": Figure(2.0, True)}
    with pytest.raises(ValueError, match="two of head's figures"):
        renamed(figs, [("new sys", "other")])
    with pytest.raises(ValueError, match=r"no figure of head's run starts with \['nwe sys'\]"):
        renamed(figs, [("nwe sys", "old sys")])  # mistyped: not silently left as it is
    # the longest name that matches wins, whatever the order given
    figs = {"sys @ 1": Figure(1.0, True), "sys + more @ 1": Figure(2.0, True)}
    assert renamed(figs, [("sys", "a"), ("sys + more", "b")]) == {
        "a @ 1": Figure(1.0, True), "b @ 1": Figure(2.0, True)}
    with pytest.raises(SystemExit):
        main(["--base", "HEAD", "--head-names", "no-equals", "--", "spark_throughput"])
    assert "NEW=OLD" in capsys.readouterr().err
