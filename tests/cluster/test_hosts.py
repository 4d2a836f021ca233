"""The tree on several hosts (issue 31 item 1): three network namespaces on a bridge, each
with its own IP and a Ray node started by ``ray start`` (dstl_ray.testing.hosts). A driver
on the first host deploys a tree; a writer on every host persists through the node actor of
its own host, and reads its changes back; afterwards nothing of the hosts is left (no
namespace, link or process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dstl_ray.testing.hosts import PREFIX, HostCluster, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

DRIVER = r"""
import json, sys
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
print("RESULT " + json.dumps({"writers": got, "actors": actors}))
tree.shutdown()
"""


def _leftovers(tag: str) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    procs = subprocess.run(["pgrep", "-f", f"{PREFIX}{tag}"], capture_output=True,
                           text=True).stdout
    return ([line for line in ns.splitlines() if f"{PREFIX}-{tag}" in line]
            + [line for line in links.splitlines() if f"{PREFIX}b{tag}" in line
               or f"{PREFIX}v{tag}" in line] + procs.split())


def test_writers_on_three_hosts_persist_through_their_own_hosts_node_actor(tmp_path):
    with HostCluster(3) as hosts:
        ips = [h.ip for h in hosts.hosts]
        assert len(set(ips)) == 3 and not any(ip.startswith("127.") for ip in ips)
        out = hosts.run(hosts.hosts[0], [sys.executable, "-c", DRIVER, hosts.address,
                                         f"file://{tmp_path}/dfs"], timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.split("RESULT ", 1)[1])
        tag = hosts.tag
    writers, actors = result["writers"], result["actors"]
    assert sorted(w["ip"] for w in writers) == sorted(ips)
    for w in writers:  # every writer reached the node actor of its own host
        assert w["ok"] and actors[w["node"]] == w["ip"], (w, actors)
    assert sorted(set(actors.values())) == sorted(ips)  # a node actor on every host
    assert _leftovers(tag) == []
