"""The tree on several hosts (issue 31 item 1): three network namespaces on a bridge, each
with its own IP and a Ray node started by ``ray start`` (dstl_ray.local.hosts). A driver
on the first host deploys a tree; a writer on every host persists through the node actor of
its own host, and reads its changes back; afterwards nothing of the hosts is left (no
namespace, link or process: the session's ``hosts`` fixture, tests/cluster/conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from .hosts_util import needs_hosts

pytestmark = [needs_hosts, pytest.mark.quiet]  # `ray start` x3: not beside another's start

DRIVER = r"""
import json, sys, time
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
import dstl_ray
from dstl_ray import KeyGroupRange, StateChangelogClient

address, base = sys.argv[1], sys.argv[2]
ray.init(address=address, namespace="hosts", log_to_driver=False)
tree = dstl_ray.deploy(base, dstl_ray.ChangelogConfig(namespace="hosts"), detached=False)

@ray.remote(num_cpus=0)
def write(i):
    client = StateChangelogClient("hosts-job", namespace="hosts")
    w = client.create_writer(f"op{i}", KeyGroupRange(0, 7))
    for kg in range(8):
        w.append(kg, b"c%d-%d" % (i, kg))
    h = w.persist_durably(0, checkpoint_id=1).result(timeout=60)
    ok = [list(h.get_state_changes(kg)) for kg in range(8)] == [
        [b"c%d-%d" % (i, kg)] for kg in range(8)]
    name = client.node_name
    client.close()
    return {"ip": ray.util.get_node_ip_address(), "node": name, "ok": ok}

nodes = [n for n in ray.nodes() if n["Alive"]]
ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in nodes}
got = ray.get([write.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
    n["NodeID"], soft=False)).remote(i) for i, n in enumerate(nodes)], timeout=120)
actors = {s["name"]: ip_of[s["node_id"]] for s in tree.status()}
# a second round from the children's hosts, once their host lanes to the root are open
# (a peer opens its lane in the background on its first call, which goes by Ray)
time.sleep(1.0)
root = next(s for s in tree.status() if s["parent"] is None)
kids = [n for n in nodes if ip_of[n["NodeID"]] != actors[root["name"]]]
ray.get([write.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
    n["NodeID"], soft=False)).remote(10 + i) for i, n in enumerate(kids)], timeout=120)
status = {s["name"]: s for s in tree.status()}
print("RESULT " + json.dumps({"writers": got, "actors": actors, "root": root["name"],
                              "lanes": {k: v["lane"] for k, v in status.items()},
                              "parents": {k: v["parent"] for k, v in status.items()}}))
tree.shutdown()
"""


def test_writers_on_three_hosts_persist_through_their_own_hosts_node_actor(hosts, tmp_path):
    ips = [h.ip for h in hosts.hosts]
    assert len(set(ips)) == 3 and not any(ip.startswith("127.") for ip in ips)
    out = hosts.run(hosts.hosts[0], [sys.executable, "-c", DRIVER, hosts.address,
                                     f"file://{tmp_path}/dfs"], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    writers, actors = result["writers"], result["actors"]
    assert sorted(w["ip"] for w in writers) == sorted(ips)
    for w in writers:  # every writer reached the node actor of its own host
        assert w["ok"] and actors[w["node"]] == w["ip"], (w, actors)
    assert sorted(set(actors.values())) == sorted(ips)  # a node actor on every host
    # the children on the two other hosts reach the root over host lanes (TCP to its IP)
    root = result["root"]
    assert sorted(p for p in result["parents"].values() if p) == [root, root], result
    assert result["lanes"][root]["tcp_connections"] >= 2, result["lanes"]


PARTITION_DRIVER = r"""
import json, sys, time
import ray
import dstl_ray
from experiments.workload import place_writers, verify

address, base, healthy_ips, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
ray.init(address=address, namespace="partition", log_to_driver=False)
tree = dstl_ray.deploy(base, dstl_ray.ChangelogConfig(namespace="partition",
                                                      branching_factor=2), detached=False)
by_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
ip_of = {v: k for k, v in by_ip.items()}
levels = {ip_of[s["node_id"]]: s["level"] for s in tree.status()}
actors = place_writers("healthy", "partition", [by_ip[ip] for ip in healthy_ips.split(",")],
                       per_node=1)
print("READY " + json.dumps(levels), flush=True)
rounds, handles = [], []
end = time.time() + seconds
while time.time() < end:
    rs = ray.get([a.checkpoint.remote(10, 50) for a in actors], timeout=120)
    rounds.append({"at": time.time(), "ok": all(r["ok"] for r in rs),
                   "ms": max(r["latency_ms"] for r in rs),
                   "errors": [r.get("error") for r in rs if not r["ok"]]})
    handles = [r["handles"] for r in rs] if all(r["ok"] for r in rs) else handles
    time.sleep(0.2)
checked = verify(actors, handles) if handles else 0
print("RESULT " + json.dumps({"rounds": rounds, "checked": checked}), flush=True)
"""


def test_a_job_on_healthy_hosts_declines_nothing_while_another_host_is_partitioned(
        hosts, tmp_path):
    """Issue 31 item 2: a host's link down for 8 s (then healed) while a job whose writers
    live on the two other hosts checkpoints every 0.2 s: none of its checkpoints fails, and
    every change reads back."""
    h0, h1, victim = hosts.hosts
    proc = hosts.popen(h0, [sys.executable, "-c", PARTITION_DRIVER, hosts.address,
                            f"file://{tmp_path}/dfs", f"{h0.ip},{h1.ip}", "18"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("READY"), ready + proc.stderr.read()[-3000:]
        time.sleep(3)
        t0 = time.time()
        hosts.partition(victim)
        try:
            time.sleep(8)
        finally:  # the hosts are the session's: later tests need this one back
            hosts.heal(victim)
        t1 = time.time()
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.split("RESULT ", 1)[1])
    rounds = result["rounds"]
    during = [r for r in rounds if t0 <= r["at"] <= t1]
    assert len(during) >= 5, rounds  # the job kept checkpointing through the partition
    failed = [r for r in rounds if not r["ok"]]
    assert failed == [], (json.loads(ready.split(" ", 1)[1]), failed)
    assert result["checked"] > 0
