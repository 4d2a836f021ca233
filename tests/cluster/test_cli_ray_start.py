"""The operator CLI against a real ``ray start`` cluster: the session's three hosts
(tests/cluster/conftest.py), a token-authenticated cluster of ``ray start --head`` and
``ray start --address`` nodes, each in a network namespace with an IP of its own. The CLI
and the driver run on the first host and get only the token's path (``RAY_AUTH_TOKEN_PATH``,
not ``RAY_AUTH_MODE``): they must turn token mode on by themselves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .hosts_util import needs_hosts

pytestmark = [needs_hosts, pytest.mark.quiet]  # `ray start` x3: not beside another's start

BIN = Path(sys.executable).parent

DRIVER = """
import sys
from dstl_ray import StateChangelogClient, KeyGroupRange
client = StateChangelogClient("cli-job", namespace="cli_ns", address=sys.argv[1])
w = client.create_writer("op", KeyGroupRange(0, 7))
for kg in range(8):
    w.append(kg, b"change-%d" % kg)
h = w.persist_durably(0).result(timeout=60)
assert [list(h.get_state_changes(kg)) for kg in range(8)] == [[b"change-%d" % kg] for kg in range(8)]
print("HANDLE", h.to_json())
"""


def test_up_status_checkpoint_down_on_ray_start_cluster(hosts, tmp_path):
    address, first = hosts.address, hosts.hosts[0]

    def run(*argv: str, code: int = 0) -> subprocess.CompletedProcess[str]:
        out = hosts.run(first, ["env", "-u", "RAY_AUTH_MODE", *argv], timeout=120)
        assert out.returncode == code, f"{argv} exited {out.returncode}:\n" \
                                       f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out

    cli = str(BIN / "dstl-ray")
    base = f"file://{tmp_path}/dfs"
    up = run(cli, "up", "--address", address, "--base-path", base, "--namespace", "cli_ns",
             "--branching", "2").stdout
    assert f"deployed {len(hosts.hosts)} node actors" in up
    status = json.loads(run(cli, "status", "--address", address, "--namespace", "cli_ns",
                            "--json").stdout)
    nodes = status["nodes"]
    assert sorted(n["level"] for n in nodes) == [0, 1, 1]  # branching 2 over three hosts
    assert status["base_path"] == base
    handle = run(sys.executable, "-c", DRIVER, address).stdout.split("HANDLE ", 1)[1].strip()
    text = run(cli, "status", "--address", address, "--namespace", "cli_ns").stdout
    assert "files" in text and "forwarded B" in text
    status = json.loads(run(cli, "status", "--address", address, "--namespace", "cli_ns",
                            "--json").stdout)
    assert sum(n["files_flushed"] for n in status["nodes"]) == 1
    # inspect the file the checkpoint wrote
    seg = json.loads(handle)["segments"][0]["path"]
    shown = run(cli, "inspect", f"{tmp_path}/dfs/cli-job/{seg}").stdout
    assert "all CRC32C ok" in shown and json.loads(handle)["log_id"] in shown
    down = run(cli, "down", "--address", address, "--namespace", "cli_ns").stdout
    assert f"stopped {len(hosts.hosts)} node actors" in down
    gone = run(cli, "status", "--address", address, "--namespace", "cli_ns", code=2)
    assert "no dstl-ray tree" in gone.stderr
