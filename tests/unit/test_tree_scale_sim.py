"""The between-hosts model of experiments.tree_scale_sim, without hosts: what crossing hosts
adds comes from host_hops' samples (less the same-host median), by the size of the call, and
a tree whose hops cross hosts is slower than the same tree on one machine's costs, by about
what its levels' crossings add."""

from __future__ import annotations

import json
import random

from experiments.tree_scale_sim import BetweenHosts, Measured, simulate


def hops_file(tmp_path) -> str:
    def kind(nbytes, between, same_p50):
        return {"method": "m", "bytes": nbytes, "tcp_lane_ms": between,
                "unix_lane_same_host": {"p50": same_p50},
                "ray_ms": [x * 10 for x in between], "ray_same_host": {"p50": same_p50}}

    path = tmp_path / "host_hops.json"
    path.write_text(json.dumps({"kinds": [kind(16 << 10, [3.0, 3.0], 1.0),
                                          kind(0, [2.0, 0.5], 1.0),
                                          kind(256 << 10, [11.0], 1.0)]}))
    return str(path)


def test_the_extra_cost_is_the_samples_of_the_nearest_size_at_or_above_less_same_host(
        tmp_path):
    hosts = BetweenHosts.load(hops_file(tmp_path))
    assert hosts is not None
    rng = random.Random(1)
    assert {hosts.extra(rng, 0) for _ in range(50)} == {1.0, 0.0}  # never below zero
    assert hosts.extra(rng, 1000) == 2.0  # 16 KiB's samples
    assert hosts.extra(rng, 200 << 10) == 10.0
    assert hosts.extra(rng, 512 << 10) == 20.0  # beyond the largest: scaled by size
    assert BetweenHosts.load(str(tmp_path / "absent.json")) is None
    by_ray = BetweenHosts.load(hops_file(tmp_path), "ray")  # Ray's calls between hosts
    assert by_ray is not None and by_ray.extra(rng, 1000) == 29.0


def test_a_tree_across_hosts_is_slower_by_its_crossings(tmp_path):
    m = Measured(send=1.0, hop=2.0, put=5.0, reply=1.0, reply_hop=1.0)
    hosts = BetweenHosts.load(hops_file(tmp_path))

    def p50(h):
        lat = sorted(simulate(100, 4, 4, 10_000, 4 << 20, "tree", random.Random(7), m=m,
                              hosts=h)[1] for _ in range(40))
        return lat[20]

    one, across = p50(None), p50(hosts)
    # 100 nodes at branching 4: 3 levels of hops up and down, each crossing adding 2 ms
    # (up, 16 KiB... 256 KiB batches: 2-10 ms) and 0-1 ms (down)
    assert 6.0 <= across - one <= 45.0, (one, across)
