"""A partitioned driver that still holds its job's lease (issue 31 item 2): driver A runs on
one host and checkpoints to S3 (a real S3 server on the hosts' bridge), its host is cut off
(link down) with its requests in flight; driver B on another host watches A's lease
unchanged for a full TTL, takes the job over and checkpoints on. When the link is back, A's
held-up renewal and writes land late: A is fenced for good, completes no checkpoint and
deletes nothing, and none of its late writes replaces B's ``_metadata``
(checkpoint/metadata_write.py). Every retained checkpoint reads back with B's state."""

from __future__ import annotations

from dstl_ray.testing.lease_process import DriverProcess, assert_reads_back, until
from dstl_ray.testing.s3server import LoopbackS3

from .hosts_util import needs_hosts

pytestmark = needs_hosts

TTL_S = 3.0


def test_a_partitioned_driver_holding_the_lease_is_fenced_after_the_heal(
        hosts, tmp_path, monkeypatch):
    h1, h2 = hosts.hosts[1], hosts.hosts[2]
    with LoopbackS3(host=f"{hosts.subnet}.1") as s3:  # the bridge: every host reaches it
        base, job = s3.url("dfs"), "partitioned"

        def driver(name: str, host) -> DriverProcess:
            return DriverProcess(base, job, TTL_S, tmp_path, name,
                                 ["ip", "netns", "exec", host.namespace], s3.env())

        a, b = driver("a", h1), driver("b", h2)
        try:
            a.ready()
            b.ready()
            assert a.ask("start")["ok"]
            a.ask("run")
            until(lambda: a.ask("status")["done"] >= 5, 60)
            hosts.partition(h1)  # A keeps running, cut off from S3 with calls in flight
            try:
                took = b.ask("start", timeout=120)
                assert took["ok"] and took["waited_s"] >= TTL_S, took
                b.ask("run")
                until(lambda: b.ask("status")["done"] >= 5, 60)
                a_done = a.ask("status")["done"]
            finally:
                hosts.heal(h1)
            # A's late renewal and writes land now: it learns it was taken over
            until(lambda: a.ask("status")["fenced"], 150)
            st = a.ask("status")
            assert st["done"] == a_done, st  # nothing of A completed after the takeover
            until(lambda: b.ask("status")["done"] >= 15, 60)  # B goes on, undisturbed
            assert b.ask("status")["declined"] == 0
            assert a.ask("stop", timeout=150)["ok"]  # a fenced shutdown deletes nothing
            final = b.ask("stop", timeout=60)["checkpointed"]
        finally:
            a.close()
            b.close()
        for k, v in s3.env().items():
            monkeypatch.setenv(k, v)
        retained = assert_reads_back(base, job, final)
        assert all(c.metadata.epoch == retained[-1].metadata.epoch for c in retained)
