"""Node actors emit no deprecation warnings: after a tree ran checkpoints with merged
changelog files, a materialization, tracing and up-front routing, the log of no node actor's
process holds a DeprecationWarning or FutureWarning (the session's Ray workers print every
one, once per place: WORKER_WARNINGS in tests/conftest.py). Such warnings are raised inside
Ray worker processes, where the test run's own warning filters (pyproject.toml) do not
reach.

Also: a node actor knows whether Ray restarted it (dstl_ray.node.dead_writer_check
``restarted_at``, which reads Ray's actor table without the deprecated
``RuntimeContext.actor_id``)."""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path

import ray

import dstl_ray as d

WARNING = re.compile(r"^\S+:\d+: (\w*(?:DeprecationWarning|FutureWarning)): (.*)$", re.M)
MAXP = 16
NO_SUCH_RAY_JOB = "ffffffff"  # fenced to read a node's restart time; no writer has it


def _logs_dir() -> Path:
    return Path(ray._private.worker._global_node.get_logs_dir_path())


def _warnings_of(pid: int) -> list[str]:
    """The deprecation warnings in the stderr log of Ray worker process ``pid``."""
    logs = list(_logs_dir().glob(f"worker-*-{pid}.err"))
    assert logs, f"no log of worker process {pid} in {_logs_dir()}"
    return [f"{m.group(1)}: {m.group(2)}" for log in logs
            for m in WARNING.finditer(log.read_text(errors="replace"))]


@ray.remote(num_cpus=0)
def _warn() -> int:
    warnings.warn("a deprecated call in a Ray worker", DeprecationWarning, stacklevel=1)
    import os

    return os.getpid()


def test_worker_logs_show_deprecation_warnings(ray_cluster):
    """The check below sees what it looks for: a DeprecationWarning from a module other
    than __main__ (hidden by Python's default filters) reaches a worker's log."""
    pid = ray.get(_warn.remote(), timeout=60)
    deadline = time.monotonic() + 10
    while not _warnings_of(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert any("a deprecated call in a Ray worker" in w for w in _warnings_of(pid))


def _started(handle) -> float:
    return ray.get(handle.fence_ray_job.remote(NO_SUCH_RAY_JOB), timeout=60)["started"]


def _pid(handle) -> int | None:
    try:
        return ray.get(handle.status.remote(), timeout=30)["pid"]
    except ray.exceptions.RayError:
        return None  # restarting


def test_node_actors_emit_no_deprecation_warnings(tree_factory, namespace, tmp_path):
    base = f"file://{tmp_path}/x"
    tree = tree_factory(base=base, file_merging="across_checkpoints", dead_writer_check_s=1.0,
                        tracing="memory", routing_horizon=2)
    client = d.StateChangelogClient("warn-job", namespace=namespace)
    coord = d.CheckpointCoordinator("warn-job", base, max_parallelism=MAXP, retained=2)
    backends = coord.restore(client, "op", 2, materialization_interval=None)
    for round_ in range(3):
        for k in range(20):
            key = f"k{k}"
            kg = d.assign_key_group(key, MAXP)
            b = next(b for b in backends if kg in b.key_group_range)
            b.value_state("v").update(key, round_)
        coord.trigger_checkpoint().result(timeout=60)
        if round_ == 1:
            for b in backends:
                b.materialize().result(timeout=60)
    coord.shutdown()
    statuses = tree.status()
    assert not [s for s in statuses if "error" in s]
    assert sum(s["files_flushed"] for s in statuses) >= 3  # the checkpoints went through
    found = {s["name"]: _warnings_of(s["pid"]) for s in statuses}
    assert not {name: w for name, w in found.items() if w}
    # a node actor Ray did not restart says so; one it restarted knows when
    name = next((n for n in tree.nodes if n != tree.root), tree.root)
    handle = tree.node(name)
    assert _started(handle) == 0.0
    pid = _pid(handle)
    before = time.time()
    ray.kill(handle, no_restart=False)
    deadline = time.monotonic() + 60
    while _pid(handle) in (pid, None):  # ray.kill returns before the process is gone
        assert time.monotonic() < deadline, f"Ray did not restart node actor {name}"
        time.sleep(0.5)
    assert _started(handle) >= before
