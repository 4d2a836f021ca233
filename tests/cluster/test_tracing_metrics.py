"""Tracing of upload paths and monitoring metrics on a 5-node tree (b=2)."""

from __future__ import annotations

import os

import ray

from dstl_ray.observability.trace_view import draw, hops, request_paths, stage_breakdown
from experiments.workload import place_writers
from topology.tree import build_tree, path_to_root


def test_spans_follow_the_tree_and_routing_skips_hops(tree_factory, namespace, tmp_path):
    tree = tree_factory(base=f"file://{tmp_path}/dfs", branching_factor=2, persist_delay_s=3.0,
                        routing_horizon=2, tracing="memory")
    status = tree.status()
    order = [s["name"] for s in sorted(status, key=lambda s: s["index"])]
    shape = build_tree(order, 2)
    actors = place_writers("traced", namespace, [s["node_id"] for s in status], per_node=1)
    node_of_actor = [s["name"] for s in status]
    for _ in range(2):
        assert all(r["ok"] for r in ray.get([a.checkpoint.remote(10, 50) for a in actors]))
    spans = [s for h in tree.nodes.values() for s in ray.get(h.spans.remote())]
    spans += [s for a in actors for s in ray.get(a.spans.remote())]
    puts = sorted((s for s in spans if s["name"] == "dstl.dfs.put"), key=lambda s: s["start_ns"])
    assert len(puts) == 2 and all(p["attributes"]["dstl.node"] == tree.root for p in puts)
    for put in puts:  # one span per DFS attempt under each put
        attempts = [s for s in spans if s["name"] == "dstl.dfs.attempt"
                    and s["parent_id"] == put["span_id"]]
        assert [a["attributes"]["dstl.attempt"] for a in attempts] == [1]
        assert put["attributes"]["dstl.attempts"] == 1
    for n, put in enumerate(puts):
        paths = request_paths(spans, put)
        assert len(paths) == len(actors)  # every writer's request reached the flushing node
        seen_writers = set()
        for path in paths:
            assert path[0]["name"] == "dstl.writer.persist"
            seen_writers.add(path[0]["attributes"]["dstl.log"])
            nodes = [s["attributes"]["dstl.node"] for s in path if s["name"] == "dstl.node"]
            expected = path_to_root(shape, nodes[0])
            if n == 0:
                assert nodes == expected  # checkpoint 1: every hop of the tree
            else:
                # checkpoint 2: routed requests go straight to the root (skipped hops)
                assert nodes == expected or nodes == [expected[0], expected[-1]]
                if len(expected) > 2:
                    assert nodes == [expected[0], expected[-1]], (nodes, expected)
                    assert path[1]["attributes"]["dstl.bypass"] is True
            assert path[-1]["attributes"]["dstl.action"] == "flush"
            assert path[-1]["attributes"]["dstl.file"] == put["attributes"]["dstl.file"]
        assert len(seen_writers) == len(actors)
    assert set(node_of_actor) >= {a for a, _ in hops(spans, puts[0])}
    summary = draw(spans, 0, str(tmp_path / "path.png"))
    assert os.path.getsize(tmp_path / "path.png") > 1000 and summary["flush_node"] == tree.root
    # the stages of each flush's slowest request add up to its persist call
    stages = stage_breakdown(spans)
    assert len(stages) == 2
    for st in stages:
        parts = [st[k] for k in ("send", "tree", "batch", "put", "reply")]
        assert all(x >= 0 for x in parts), st
        assert abs(sum(parts) - st["total"]) < 0.01, st
    assert 1 <= stages[0]["levels"] <= max(len(path_to_root(shape, n)) for n in order)


def test_metrics_count_requests_bytes_and_errors(tree_factory, namespace, tmp_path):
    tree = tree_factory(base=f"file://{tmp_path}/dfs", branching_factor=2, persist_delay_s=3.0,
                        max_attempts=1, retry_delay_s=0.0)
    status = tree.status()
    actors = place_writers("metered", namespace, [s["node_id"] for s in status], per_node=1)
    for _ in range(3):
        assert all(r["ok"] for r in ray.get([a.checkpoint.remote(10, 50) for a in actors]))
    st = {s["name"]: s for s in tree.status()}
    root = st[tree.root]["metrics"]
    assert root["flushes"] == 3 and root["dfs_request_bytes_count"] == 3
    assert root["logs_per_request_sum"] == 3 * len(actors)
    assert root["requests"] == 3 * (1 + sum(1 for s in status if s["parent"] == tree.root))
    for s in status:
        if s["parent"] is not None:
            assert st[s["name"]]["metrics"]["forwarded_bytes"] > 0
    # inject a DFS fault: the job directory cannot be created
    (tmp_path / "dfs").mkdir(exist_ok=True)
    (tmp_path / "dfs" / "metered").rename(tmp_path / "dfs" / "metered.bak")
    (tmp_path / "dfs" / "metered").write_text("not a directory")
    results = ray.get([a.checkpoint.remote(10, 50) for a in actors])
    assert not any(r["ok"] for r in results)
    assert all("PersistError" in r["error"] and "metered" in r["error"] for r in results)
    assert {s["name"]: s for s in tree.status()}[tree.root]["metrics"]["errors:dfs"] >= 1
    (tmp_path / "dfs" / "metered").unlink()
    (tmp_path / "dfs" / "metered.bak").rename(tmp_path / "dfs" / "metered")
    assert all(r["ok"] for r in ray.get([a.checkpoint.remote(10, 50) for a in actors]))


def test_metrics_reach_rays_prometheus_endpoint(tree_factory, namespace):
    """ray.util.metrics: the node's Prometheus endpoint exports dstl_* after a checkpoint."""
    import time
    import urllib.request

    from dstl_ray import KeyGroupRange, StateChangelogClient

    tree = tree_factory()
    client = StateChangelogClient("prom", namespace=namespace)
    w = client.create_writer("op", KeyGroupRange(0, 0))
    w.append(0, b"x")
    w.persist_durably(0).result(timeout=30)
    root_node = next(s["node_id"] for s in tree.status() if s["name"] == tree.root)
    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["NodeID"] == root_node)
    deadline = time.monotonic() + 60
    text = ""
    while time.monotonic() < deadline:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read(
            ).decode()
        except OSError:
            text = ""
        if f'node="{tree.root}"' in text and "ray_dstl_flushes_total" in text:
            break
        time.sleep(2)
    lines = [ln for ln in text.splitlines() if ln.startswith("ray_dstl_flushes_total")
             and f'node="{tree.root}"' in ln]
    assert lines and float(lines[0].rsplit(" ", 1)[1]) >= 1.0
    client.close()
