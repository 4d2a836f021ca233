"""A client created while its node actor restarts (killed a moment ago, Ray brings it back)
waits for the restart instead of failing with Ray's ActorUnavailableError (seen between the
lives of experiments/lifecycle.py)."""

from __future__ import annotations

import ray

import dstl_ray as d


def test_a_client_made_while_its_node_restarts_attaches(tree_factory, namespace):
    tree = tree_factory()
    name = d.StateChangelogClient("restart-job", namespace=namespace).node_name
    for _ in range(3):
        ray.kill(tree.node(name), no_restart=False)
        client = d.StateChangelogClient("restart-job", namespace=namespace)  # at once
        assert client.node_name == name
        w = client.create_writer("op", d.KeyGroupRange(0, 3))
        w.append(1, b"x")
        handle = w.persist_durably(after=0).result(timeout=60)
        assert list(handle.get_state_changes(1)) == [b"x"]
        w.close()
