"""Lane directories of dead node actors are removed (dstl_ray.node.lane_server
``remove_dead_lanes``), judged by an owner record (process table: host, boot and pid
namespace; pid; process start time), never by a host name and a pid alone: a directory
of another PID namespace sharing the temp directory is never taken for dead, and one
whose pid was reused by a later process is not taken for alive."""

from __future__ import annotations

import json
import os
import subprocess

from dstl_ray.node.lane_server import DIR_PREFIX, OWNER_FILE, owner_record, remove_dead_lanes


def _lane_dir(root, name: str, owner: dict | None):
    d = root / f"{DIR_PREFIX}{name}"
    d.mkdir()
    (d / "lane.sock").write_bytes(b"")
    if owner is not None:
        (d / OWNER_FILE).write_text(json.dumps(owner))
    return d


def _gone_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_dead_owner_removed_live_one_kept(tmp_path):
    me = owner_record()
    gone = _gone_pid()
    dead = _lane_dir(tmp_path, f"{gone}-a", dict(me, pid=gone, start=1))
    alive = _lane_dir(tmp_path, f"{os.getpid()}-b", me)
    assert remove_dead_lanes(str(tmp_path)) == 1
    assert not dead.exists() and alive.exists()


def test_a_reused_pid_does_not_keep_a_dead_lane(tmp_path):
    """Before the fix a live process with the dead actor's pid kept its directory forever."""
    me = owner_record()
    reused = _lane_dir(tmp_path, f"{os.getpid()}-r", dict(me, start=me["start"] - 7))
    assert remove_dead_lanes(str(tmp_path)) == 1 and not reused.exists()


def test_another_pid_namespace_is_never_judged_here(tmp_path):
    """Before the fix a directory named with a pid that is free HERE was deleted, though its
    owner lives in another PID namespace sharing the directory (its socket unlinked)."""
    gone = _gone_pid()
    other = dict(owner_record(), machine=owner_record()["machine"] + "-other-ns", pid=gone)
    theirs = _lane_dir(tmp_path, f"{gone}-ns", other)
    unrecorded = _lane_dir(tmp_path, f"{gone}-old", None)  # being made, or an older version's
    assert remove_dead_lanes(str(tmp_path)) == 0
    assert theirs.exists() and unrecorded.exists()


def test_a_server_records_its_owner(tmp_path):
    import asyncio

    from dstl_ray.node.lane_server import LaneServer

    async def run():
        server = LaneServer("node-o", {})
        await server.start()
        with open(os.path.join(os.path.dirname(server.path), OWNER_FILE)) as f:
            rec = json.load(f)
        assert rec == owner_record() and rec["start"]
        remove_dead_lanes()  # another actor's sweep of the same temp directory
        assert os.path.exists(server.path)
        await server.close()

    asyncio.run(run())


def test_an_owner_record_is_whole_or_absent(tmp_path, monkeypatch):
    """The record is written under a temporary name and renamed into place. Before the fix it
    was written in place: a start that failed (or a process killed) half way left a
    directory whose ``owner.json`` was half written."""
    import asyncio
    import tempfile

    from dstl_ray.node import lane_server

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def dies_half_way(record, f):
        f.write(json.dumps(record)[:10])
        f.flush()
        raise OSError("no space left on device")

    monkeypatch.setattr(lane_server.json, "dump", dies_half_way)
    server = lane_server.LaneServer("node-h", {})
    try:
        asyncio.run(server.start())
    except OSError:
        pass
    half = [d for d in tmp_path.iterdir() if (d / OWNER_FILE).exists()]
    assert half == [], "a half written owner record"
    assert server.path is None and not list(tmp_path.iterdir())  # its directory went too
