"""Shared fixtures: ONE Ray cluster per test session (several Ray nodes on this machine via
``ray.cluster_utils.Cluster``), shared by integration and cluster tests; start-up is the slow
part. Every test deploys its own tree in its own namespace, so tests do not see each other.

Tests under ``tests/cluster`` and ``tests/spark`` get the ``cluster`` and ``spark`` markers
from their directory, so ``pytest -m "not spark"`` leaves the Spark tests out.

Order: the unit tests first (no cluster is up while they run), then integration, cluster and
Spark. ``make test`` stops there. ``tests/runs`` (``make test-runs``, which CI runs after
``make test``) holds the experiments in CI size that bring a cluster of their own (the quick
chaos runs, the demo, the Flink comparison's dstl-ray side: ``@pytest.mark.background(NAME)``,
runs listed in ``RUNS``); they start in the background when their session starts, one at a
time (``tests/background.py``; DSTL_TEST_OVERLAP=0: each when its test asks), and their tests
read what they left. Beside the other tiers on two cores they made timing tests late and Spark
tests time out. Tests marked ``quiet`` (timing bounds) run last, once no run is going."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from background import BackgroundRuns, Finished, Run  # tests/background.py

from dstl_ray.local.hosts import unavailable as hosts_unavailable
from dstl_ray.testing import start_local_cluster, stop_local_cluster

N_NODES = int(os.environ.get("DSTL_TEST_NODES", "5"))
# Ray's worker processes (node actors, tasks, Spark's executors) inherit this from the raylets
# the session starts: each prints every DeprecationWarning and FutureWarning, once per place,
# to its log, where tests/integration/test_node_warnings.py looks for them
WORKER_WARNINGS = "default::DeprecationWarning,default::FutureWarning"
TESTS = Path(__file__).resolve().parent
MARKED_DIRS = {"cluster": TESTS / "cluster", "spark": TESTS / "spark", "runs": TESTS / "runs"}
TIERS = ("unit", "integration", "cluster", "spark", "runs")  # the order tests run in
PY = sys.executable
CHAOS = ("-m", "experiments.chaos", "--quick", "--out", "{out}")
# the Spark chaos run on 3 hosts of their own where they can be made (root), else on one
SPARK_HOSTS = ("--hosts", "3") if hosts_unavailable() is None else ()


def _ci_chaos_kinds() -> str:
    from experiments.chaos import KINDS, LIFE_KINDS

    return ",".join(k for k in KINDS if k not in LIFE_KINDS)


# the order they run in: each before the tests that read it, by TIERS
RUNS = (
    Run("chaos", (PY, *CHAOS, "--seed", "5", "--kinds", _ci_chaos_kinds())),
    Run("chaos_merged", (PY, *CHAOS, "--seed", "3", "--storage", "file", "--kinds",
                         "node_kill,writer_kill,dfs_torn,coordinator_restart,rescale,"
                         "job_restart", "--file-merging", "across_checkpoints")),
    Run("vs_flink", (PY, "-m", "experiments.vs_flink", "--no-flink", "--nodes", "2",
                     "--seconds", "4", "--input", "even", "--out", "{out}"), 600.0),
    Run("chaos_spark", (PY, "-m", "experiments.chaos_spark", "--quick", "--seed", "3",
                        *SPARK_HOSTS, "--out", "{out}")),
    Run("demo", (str(Path(PY).parent / "dstl-ray"), "demo", "--duration", "14",
                 "--window", "5", "--before-checkpoints", "3", "--base-path", "{out}/demo"),
        600.0),
)
_RUNS = BackgroundRuns(RUNS)


def _tier(item: pytest.Item) -> int:
    path = Path(str(item.path)).resolve()
    for i, tier in enumerate(TIERS):
        if path.is_relative_to(TESTS / tier):
            return i
    return len(TIERS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test by the directory it lives in (the markers are declared in
    pyproject.toml), put the tiers in order (a stable sort: within a tier, the collected
    order, with the tests that read a background run at its end)."""
    for item in items:
        path = Path(str(item.path)).resolve()
        for marker, directory in MARKED_DIRS.items():
            if path.is_relative_to(directory):
                item.add_marker(getattr(pytest.mark, marker))
        if item.get_closest_marker("background") is not None:  # may wait for its run
            item.add_marker(pytest.mark.timeout(1800))
    # within a tier, the tests reading a background run last: the run gets the most time;
    # the quiet tests after every other, when the background runs are over
    items.sort(key=lambda item: (item.get_closest_marker("quiet") is not None, _tier(item),
                                 item.get_closest_marker("background") is not None))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the background runs the selected tests (after ``-k`` and ``-m``) read, one at a
    time on a thread, while the tests that need none run in the foreground
    (DSTL_TEST_OVERLAP=0: each run goes when its test asks for it). A test that needs the
    machine to itself (a timing bound: a hedge that must win within 1.4 s, a `ray start`
    cluster whose agents must come up in time) is marked ``quiet``: it runs at the end of
    the session and waits until no run is going (:func:`pytest_runtest_setup`)."""
    if os.environ.get("DSTL_TEST_OVERLAP", "1") == "0":
        return
    wanted = {name for item in session.items for m in item.iter_markers("background")
              for name in m.args}
    if wanted and not session.config.option.collectonly:
        _RUNS.start([r.name for r in RUNS if r.name in wanted])


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A quiet test waits until no background run is going."""
    if item.get_closest_marker("quiet") is not None:
        _RUNS.wait_idle()


_TIER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each test's setup, call and teardown time to its tier's."""
    tier = report.nodeid.split("/")[1] if report.nodeid.startswith("tests/") else "other"
    _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Time per tier (the tests' own time: a test waiting for its background run counts
    the wait), and each experiment run's wall time (counted in its test's only when it did
    not run in the background: DSTL_TEST_OVERLAP=0)."""
    if not _TIER_SECONDS:
        return
    tiers = ", ".join(f"{t} {_TIER_SECONDS[t]:.0f} s" for t in (*TIERS, "other")
                      if t in _TIER_SECONDS)
    terminalreporter.write_line(f"time per tier: {tiers}")
    if _RUNS.seconds:
        runs = ", ".join(f"{n} {s:.0f} s" for n, s in _RUNS.seconds.items())
        terminalreporter.write_line(f"experiment runs (wall time): {runs}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _RUNS.close()


@pytest.fixture(scope="session")
def background_run():
    """``background_run(NAME)``: the :class:`tests.background.Finished` of run NAME (waits
    for it; runs it now if the session had not started it)."""
    def result(name: str) -> Finished:
        return _RUNS.result(name)

    return result


@pytest.fixture(scope="session")
def ray_cluster():
    """A Ray cluster of N_NODES nodes (head + workers), each with 1 logical CPU, whose
    worker processes show deprecation warnings (WORKER_WARNINGS; only they: processes this
    one starts later keep the usual filters)."""
    before = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = ",".join(w for w in (before, WORKER_WARNINGS) if w)
    try:
        cluster = start_local_cluster(N_NODES, cpus=1, namespace="dstl_tests")
    finally:
        if before is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = before
    try:
        yield cluster
    finally:
        stop_local_cluster(cluster)


@pytest.fixture
def namespace() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def tree_factory(ray_cluster, tmp_path, namespace):
    """Deploy trees in this test's namespace; shut them down afterwards."""
    import dstl_ray

    trees = []

    def make(base=None, **options):
        cfg = dstl_ray.ChangelogConfig(namespace=namespace, **options)
        tree = dstl_ray.deploy(base or f"file://{tmp_path}/dstl", cfg, detached=False)
        trees.append(tree)
        return tree

    yield make
    for t in trees:
        t.shutdown()
