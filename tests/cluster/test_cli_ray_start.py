"""The operator CLI against a real `ray start --head` + `ray start --address` cluster."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=15)


def _run(args: list[str], env: dict[str, str], timeout: float = 120) -> str:
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


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


@pytest.mark.quiet  # `ray start`'s agents must come up in time: not beside another cluster's
def test_up_status_checkpoint_down_on_ray_start_cluster(tmp_path):
    port = _free_port()
    address = f"127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    # a token-authenticated cluster (Ray's default once a token exists), with the token in a
    # file of its own so the test needs no ~/.ray state; the CLI and the driver get only the
    # token path and must turn token mode on by themselves
    token = tmp_path / "auth_token"
    token.write_text(secrets.token_hex(32))
    env["RAY_AUTH_TOKEN_PATH"] = str(token)
    common = ["--num-cpus=1", "--disable-usage-stats", "--block"]
    head = subprocess.Popen([str(BIN / "ray"), "start", "--head", f"--port={port}",
                             "--include-dashboard=false", *common],
                            env=dict(env, RAY_AUTH_MODE="token"),
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    worker = None
    try:
        # joining nodes send the cluster's token
        wenv = dict(env, RAY_AUTH_MODE="token")
        deadline = time.monotonic() + 60
        while True:
            probe = subprocess.run([str(BIN / "ray"), "status", f"--address={address}"],
                                   env=wenv, capture_output=True, text=True, timeout=60)
            if probe.returncode == 0:
                break
            assert time.monotonic() < deadline, probe.stderr[-2000:]
            time.sleep(1)
        worker = subprocess.Popen([str(BIN / "ray"), "start", f"--address={address}", *common],
                                  env=wenv, start_new_session=True, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        cli = [str(BIN / "dstl-ray")]
        base = f"file://{tmp_path}/dfs"
        deadline = time.monotonic() + 60
        while True:  # wait for the second node, then deploy on both
            st = _run([str(BIN / "ray"), "status", f"--address={address}"], wenv)
            if st.count("node_") >= 2:
                break
            assert time.monotonic() < deadline, st
            time.sleep(1)
        up = _run(cli + ["up", "--address", address, "--base-path", base, "--namespace",
                         "cli_ns", "--branching", "2"], env)
        assert "deployed 2 node actors" in up
        status = json.loads(_run(cli + ["status", "--address", address, "--namespace",
                                        "cli_ns", "--json"], env))
        nodes = status["nodes"]
        assert len(nodes) == 2 and sorted(n["level"] for n in nodes) == [0, 1]
        assert status["base_path"] == base
        out = _run([sys.executable, "-c", DRIVER, address], env)
        handle = out.split("HANDLE ", 1)[1].strip()
        text = _run(cli + ["status", "--address", address, "--namespace", "cli_ns"], env)
        assert "files" in text and "forwarded B" in text
        status = json.loads(_run(cli + ["status", "--address", address, "--namespace",
                                        "cli_ns", "--json"], env))
        assert sum(n["files_flushed"] for n in status["nodes"]) == 1
        # inspect the file the checkpoint wrote
        seg = json.loads(handle)["segments"][0]["path"]
        shown = _run(cli + ["inspect", f"{tmp_path}/dfs/cli-job/{seg}"], env)
        assert "all CRC32C ok" in shown and json.loads(handle)["log_id"] in shown
        down = _run(cli + ["down", "--address", address, "--namespace", "cli_ns"], env)
        assert "stopped 2 node actors" in down
        gone = subprocess.run(cli + ["status", "--address", address, "--namespace", "cli_ns"],
                              env=env, capture_output=True, text=True, timeout=120)
        assert gone.returncode == 2 and "no dstl-ray tree" in gone.stderr
    finally:
        if worker is not None:
            _stop(worker)
        _stop(head)
