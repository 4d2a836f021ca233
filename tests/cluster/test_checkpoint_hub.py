"""Checkpoints of subtasks hosted by Ray actors on several Ray nodes, triggered through the
checkpoint hub (dstl_ray/checkpoint/hub.py), their changelogs going through the tree: a
killed host declines the checkpoint, its replacement restores from the latest complete one
under the same name, and the job's state reads back exactly."""

from __future__ import annotations

import time

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import dstl_ray as d
from dstl_ray.checkpoint.recovery import assign_sources, load_checkpoint
from dstl_ray.keygroups import key_group_range_for_subtask

MAXP, P = 32, 4


@ray.remote(num_cpus=0)
class Host:
    """One process hosting some subtasks of operator ``op``, taking part in the hub's
    checkpoints."""

    def __init__(self, name, address, job, namespace, indices, restore_url):
        client = d.StateChangelogClient(job, namespace=namespace)
        self.bs = [d.ChangelogKeyedStateBackend(
            client, "op", key_group_range_for_subtask(MAXP, P, i), MAXP,
            restore=assign_sources(load_checkpoint(restore_url), "op", P)[i]
            if restore_url else [], materialization_interval=None) for i in indices]
        self.p = d.HubParticipant(address, name, lambda n: [b.snapshot(n) for b in self.bs])

    def put(self, keys, value):
        for k in keys:
            kg = d.assign_key_group(k, MAXP)
            for b in self.bs:
                if kg in b.key_group_range:
                    b.value_state("v").update(k, value)

    def dump(self):
        out = {}
        for b in self.bs:
            out.update(b.dump().get("v", {}))
        return out


def test_hosts_on_two_nodes_checkpoint_through_the_hub_and_one_restarts(
        tree_factory, namespace, tmp_path):
    base = f"file://{tmp_path}/dfs"
    tree_factory(base=base)
    job = "hub-job"
    coord = d.CheckpointCoordinator(job, base, max_parallelism=MAXP, retained=2)
    hub = d.CheckpointHub(coord, host=ray.util.get_node_ip_address())
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])[:2]

    def host(i, restore_url=None):
        return Host.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            nodes[i], soft=False)).remote(f"host-{i}", hub.address, job, namespace,
                                          [2 * i, 2 * i + 1], restore_url)

    keys = list(range(200))
    try:
        hosts = [host(0), host(1)]
        hub.wait_for(["host-0", "host-1"], timeout_s=60)
        for n, value in ((1, 1), (2, 2)):
            ray.get([h.put.remote(keys, value) for h in hosts])
            assert hub.checkpoint(n, ["host-0", "host-1"]).checkpoint_id == n
        ray.get([h.put.remote(keys, 3) for h in hosts])  # lost with host 1
        ray.kill(hosts[1])
        # (ray.kill returns before the actor is gone: until then it may still answer)
        with pytest.raises(ray.exceptions.RayActorError):
            for _ in range(200):
                ray.get(hosts[1].dump.remote(), timeout=30)
                time.sleep(0.05)
        try:
            hub.checkpoint(3, ["host-0", "host-1"], timeout_s=30)
            raise AssertionError("a checkpoint without host-1 completed")
        except d.CheckpointDeclinedError as e:
            assert "host-1" in str(e)
        assert coord.latest_checkpoint().checkpoint_id == 2
        # host-1 comes back from checkpoint 2 under its name; host-0 still holds value 3
        hosts[1] = host(1, coord.latest_checkpoint().metadata_url)
        hub.wait_for(["host-1"], timeout_s=60)
        assert set(ray.get(hosts[1].dump.remote()).values()) == {2}
        assert hub.checkpoint(4, ["host-0", "host-1"]).checkpoint_id == 4
        got = {}
        for b in coord.restore(d.StateChangelogClient(job, namespace=namespace), "op", 2,
                               materialization_interval=None):
            got.update(b.dump()["v"])
        assert len(got) == len(keys)
        assert {k for k, v in got.items() if v == 2} == set(ray.get(hosts[1].dump.remote()))
        assert {k for k, v in got.items() if v == 3} == set(ray.get(hosts[0].dump.remote()))
    finally:
        hub.close()
        coord.shutdown()
