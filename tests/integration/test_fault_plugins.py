"""Node actors inject the faults a test asks for although no runtime module imports
dstl_ray.testing: the tree's config names it in option ``plugins``, so each node actor's
process imports it and its fault injection wraps the node's storage (docs/architecture.md
"Test support")."""

from __future__ import annotations

import json

import ray

from dstl_ray import KeyGroupRange, StateChangelogClient


def test_node_actors_load_fault_injection_through_plugins(tree_factory, namespace, tmp_path):
    tree = tree_factory(base=f"file://{tmp_path}/dfs", plugins="dstl_ray.testing",
                        persist_delay_s=0.01, retry_delay_s=0.01, max_attempts=3)
    spec = json.dumps({"script": ["5xx", "5xx"], "match": ".dstl"})  # then the writes land
    ray.get([tree.node(n).set_fault_spec.remote(spec) for n in tree.nodes], timeout=30)
    with StateChangelogClient("jobf", namespace=namespace) as client:
        w = client.create_writer("op", KeyGroupRange(0, 0))
        w.append(0, b"a")
        h = w.persist_durably(0).result(timeout=60)
        assert list(h.get_state_changes(0)) == [b"a"]
    retries = sum(s.get("upload_retries", 0) for s in tree.status() if "error" not in s)
    assert retries == 2  # the flushing node's first two attempts met the injected 503s
