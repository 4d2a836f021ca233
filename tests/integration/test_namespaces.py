"""Security rule: node actors accept a job's requests only from the job's own Ray namespace.

Other namespaces are real driver processes connected to the session's Ray cluster."""

import json
import os
import subprocess
import sys

import pytest
import ray

from dstl_ray import KeyGroupRange, NamespaceError, StateChangelogClient

SCRIPT = """
import json, sys, ray
from dstl_ray import KeyGroupRange, NamespaceError, StateChangelogClient
address, caller_ns, tree_ns, jobs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
ray.init(address=address, namespace=caller_ns, log_to_driver=False)
out = {}
for job in jobs:
    try:
        w = StateChangelogClient(job, namespace=tree_ns).create_writer("op", KeyGroupRange(0, 0))
        w.append(0, caller_ns.encode())
        out[job] = "ok:" + w.persist_durably(after=0).result(timeout=60).segments[0].path
    except NamespaceError as e:
        out[job] = "refused:" + str(e)
print(json.dumps(out))
"""


def _driver(ray_cluster, caller_ns: str, tree_ns: str, *jobs: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT, ray_cluster.address, caller_ns, tree_ns,
                        *jobs], env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _persist(job: str, namespace: str) -> str:
    w = StateChangelogClient(job, namespace=namespace).create_writer("op", KeyGroupRange(0, 0))
    w.append(0, b"mine")
    return w.persist_durably(after=0).result(timeout=60).segments[0].path


def test_a_job_is_refused_from_another_namespace(tree_factory, namespace, ray_cluster,
                                                 tmp_path):
    tree = tree_factory(base=f"file://{tmp_path}/dfs")
    me = ray.get_runtime_context().namespace
    assert _persist("orders", namespace)
    out = _driver(ray_cluster, "intruder", namespace, "orders", "orders-2")
    assert out["orders"].startswith("refused:"), out
    assert f"'orders' belongs to Ray namespace '{me}'" in out["orders"]
    assert "'intruder'" in out["orders"]
    assert out["orders-2"].startswith("ok:"), out  # its own job is served
    assert _persist("orders", namespace)  # the owner is still served
    # nothing of the intruder reached the job directory
    data = b"".join(p.read_bytes() for p in (tmp_path / "dfs" / "orders").rglob("*.dstl"))
    assert b"intruder" not in data and b"mine" in data
    # a caller that bypasses the client (no caller identity) is refused as well
    node = ray.get_actor(tree.root, namespace=namespace)
    with pytest.raises(NamespaceError, match="names no caller namespace"):
        ray.get(node.register_writer.remote("feedface", "orders"), timeout=30)
    with pytest.raises(NamespaceError):
        ray.get(node.release.remote("orders", "x.dstl", "feedface", False), timeout=30)
    assert sum(s["namespace_refusals"] for s in tree.status()) >= 3


def test_a_restarted_driver_in_a_new_namespace_takes_the_job_over(tree_factory, namespace,
                                                                  ray_cluster, tmp_path):
    tree_factory(base=f"file://{tmp_path}/dfs")
    first = _driver(ray_cluster, "run-1", namespace, "handover")
    assert first["handover"].startswith("ok:"), first
    # run-1's driver has exited: its Ray job is dead, so the next run may take the job over
    second = _driver(ray_cluster, "run-2", namespace, "handover")
    assert second["handover"].startswith("ok:"), second
