"""Persist requests of any size reach node actors on every Ray node, from a plain driver and
from Ray tasks, in the tree's namespace and in another one.

A request above Ray's inline limit (100 KiB) lives in the object store and is owned by the
sending process; a node actor on another Ray node fetches it through that process. The drivers
here run with a token at hand (as on any machine where ``ray.init()`` once generated
``~/.ray/auth_token``) against the session's cluster, which runs without token authentication:
a sender that turned token mode on could not be called back, and every such fetch failed with
``OwnerDiedError`` (dstl_ray.transport.auth)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

MIB = 1 << 20

DRIVER = """
import json, os, sys
import ray
from dstl_ray import KeyGroupRange, PersistError, StateChangelogClient

address, caller_ns, tree_ns, size, nodes, ray_tasks = (sys.argv[1], sys.argv[2], sys.argv[3],
    int(sys.argv[4]), json.loads(sys.argv[5]), sys.argv[6] == "tasks")


def persist(job, node, size):
    \"\"\"ONE request of ``size`` random bytes (64 KiB values over 128 key groups) to ``node``:
    per key group a digest of what was appended and of what storage gives back, or the
    error.\"\"\"
    import hashlib, os
    from dstl_ray import KeyGroupRange, StateChangelogClient
    client = StateChangelogClient(job, namespace=tree_ns, node=node, address=address)
    w = client.create_writer("op", KeyGroupRange(0, 127))
    sent, n = {}, 0
    while n < size:
        v = os.urandom(min(64 << 10, size - n))
        kg = n // (64 << 10) % 128
        w.append(kg, v)
        sent.setdefault(kg, hashlib.sha256()).update(v)
        n += len(v)
    try:
        h = w.persist_durably(0).result(timeout=120)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        client.close()
    changes = h.read_all()
    back = {kg: hashlib.sha256(b"".join(vs)) for kg, vs in changes.items()}
    return {"node": client.node_name, "segments": len(h.segments),
            "bytes": sum(len(v) for vs in changes.values() for v in vs),
            "same": {str(k): d.hexdigest() for k, d in sent.items()}
                    == {str(k): d.hexdigest() for k, d in back.items()}}


if not ray_tasks:  # the driver itself connects through dstl_ray (its auth mode, its ns)
    from dstl_ray.log.client import ensure_ray
    ensure_ray(caller_ns, address)
    out = {node: persist(f"drv-{i}", node, size) for i, (node, _) in enumerate(nodes)}
else:  # Ray tasks, each on another Ray node than the node actor it sends to
    ray.init(address=address, namespace=caller_ns, log_to_driver=False)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    task = ray.remote(num_cpus=0)(persist)
    refs = {}
    for i, (node, node_id) in enumerate(nodes):
        other = nodes[(i + 1) % len(nodes)][1]
        refs[node] = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            other, soft=False)).remote(f"task-{i}", node, size)
    out = {node: ray.get(ref, timeout=300) for node, ref in refs.items()}
print("RESULT " + json.dumps({"mode": os.environ.get("RAY_AUTH_MODE"), "out": out}))
"""


def _run(ray_cluster, tmp_path, caller_ns: str, tree_ns: str, size: int,
         nodes: list[tuple[str, str]], ray_tasks: bool, **env_extra: str) -> dict:
    token = tmp_path / "auth_token"
    if not token.exists():
        token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_TOKEN_PATH=str(token), **env_extra)
    p = subprocess.run([sys.executable, "-c", DRIVER, ray_cluster.address, caller_ns, tree_ns,
                        str(size), json.dumps(nodes), "tasks" if ray_tasks else "driver"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _nodes(tree) -> list[tuple[str, str]]:
    """(node actor name, Ray node id) of every node actor of ``tree``."""
    return [(s["name"], s["node_id"]) for s in tree.status()]


@pytest.mark.parametrize("caller", ["tree", "other"])
def test_64_mib_requests_from_a_driver_reach_every_node(tree_factory, namespace, ray_cluster,
                                                        tmp_path, caller):
    tree = tree_factory(base=f"file://{tmp_path}/dfs")
    nodes = _nodes(tree)
    caller_ns = namespace if caller == "tree" else f"{namespace}-other"
    res = _run(ray_cluster, tmp_path, caller_ns, namespace, 64 * MIB, nodes, ray_tasks=False)
    for node, r in res["out"].items():
        assert "error" not in r, f"{node}: {r['error']}"
        assert r["node"] == node and r["bytes"] == 64 * MIB and r["same"]
    assert res["mode"] == "disabled"  # the cluster's mode, although a token is at hand
    st = {s["name"]: s for s in tree.status()}
    assert all(st[n]["requests"] >= 1 for n, _ in nodes)


def test_64_mib_requests_from_ray_tasks_in_another_namespace(tree_factory, namespace,
                                                             ray_cluster, tmp_path):
    tree = tree_factory(base=f"file://{tmp_path}/dfs")
    nodes = _nodes(tree)
    res = _run(ray_cluster, tmp_path, f"{namespace}-other", namespace, 64 * MIB, nodes,
               ray_tasks=True)
    for node, r in res["out"].items():
        assert "error" not in r, f"{node}: {r['error']}"
        assert r["node"] == node and r["bytes"] == 64 * MIB and r["same"]


def test_a_sender_the_cluster_cannot_call_back_gets_a_clear_error(tree_factory, namespace,
                                                                  ray_cluster, tmp_path):
    """A driver forced into token mode on a cluster without tokens: its large request to a
    node actor on another Ray node fails naming the authentication mode, not "owner died".
    (Ray calls only: over the local lane, which every node of this one-machine cluster
    offers, the node never calls the sender back.)"""
    tree = tree_factory(base=f"file://{tmp_path}/dfs", local_lane="off")
    st = tree.status()
    far = [(s["name"], s["node_id"]) for s in st if s["name"] != tree.root][:1]
    res = _run(ray_cluster, tmp_path, namespace, namespace, 1 * MIB, far, ray_tasks=False,
               RAY_AUTH_MODE="token")
    (err,) = [r["error"] for r in res["out"].values()]
    assert "PersistError" in err and "could not fetch this process's persist request" in err
    assert "RAY_AUTH_MODE='token'" in err and "authentication mode" in err
