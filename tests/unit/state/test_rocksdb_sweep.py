"""The sweep of RocksDB working directories left by killed processes (state/rocksdb_local
``sweep_stale``): a dead owner's directory goes; a live owner's stays, also when its pid means
another process here (another pid namespace sharing the directory); a pid reused by another
process does not keep a dead owner's directory. Real child processes throughout; the pid
namespaces are real ones (``unshare``), where the test can choose the pids."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import time
from functools import cache
from pathlib import Path

import pytest

from dstl_ray.keygroups import KeyGroupRange
from dstl_ray.process_identity import MACHINE, ProcessId, pid_alive, start_time
from dstl_ray.state.rocksdb import RocksDBStateTable
from dstl_ray.state.rocksdb_local import OWNER_FILE, WORKDIR_PREFIX, sweep_stale

KGS = KeyGroupRange(0, 3)
UNSHARE = ["unshare", "--pid", "--fork", "--map-root-user", "--mount-proc"]


def workdirs(local: Path) -> list[str]:
    return sorted(n for n in os.listdir(local) if n.startswith(WORKDIR_PREFIX))


def table_script(local: Path, then: str) -> str:
    """A process that makes a RocksDB table in ``local``, prints its pid and directory, then
    runs ``then`` (never closing the table)."""
    return textwrap.dedent(f"""
        import os, sys
        from dstl_ray.keygroups import KeyGroupRange
        from dstl_ray.state.rocksdb import RocksDBStateTable
        t = RocksDBStateTable(KeyGroupRange(0, 3), {str(local)!r})
        print(os.getpid(), t.path, flush=True)
        {then}
    """)


def owner_of(path: str) -> dict:
    with open(os.path.join(path, OWNER_FILE)) as f:
        return json.load(f)


# ------------------------------------------------------------------ one pid namespace


def test_a_dead_owners_directory_goes_a_live_ones_stays(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    dead = subprocess.run([sys.executable, "-c", table_script(local, "os._exit(9)")],
                          capture_output=True, text=True, timeout=60, check=False)
    dead_path = dead.stdout.split()[1]
    live = subprocess.Popen([sys.executable, "-c", table_script(
        local, "sys.stdin.read(); os._exit(9)")], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    try:
        live_pid, live_path = live.stdout.readline().split()
        rec = owner_of(live_path)
        assert rec == {"machine": MACHINE, "pid": int(live_pid),
                       "start": start_time(int(live_pid))}
        mine = RocksDBStateTable(KGS, str(local))  # sweeps first
        assert not os.path.exists(dead_path)
        assert os.path.exists(live_path) and os.path.exists(mine.path)
        assert sweep_stale(str(local)) == []  # this process's own table stays too
    finally:
        live.stdin.close()
        live.wait(timeout=30)
    assert sweep_stale(str(local)) == [live_path]  # its owner is gone now
    assert workdirs(local) == [os.path.basename(mine.path)]
    mine.close()
    assert workdirs(local) == []


def _dead_pid() -> int:
    while True:
        pid = random.randint(200_000, 4_000_000)
        if not pid_alive(pid):
            return pid


def test_records_a_sweep_cannot_judge_are_left_alone(tmp_path):
    """Another machine or pid namespace (its pid says nothing here), a record of an older
    version (no pid namespace in it), a record being written: none is swept."""
    local = tmp_path / "local"
    records = {
        "foreign-ns": json.dumps({"machine": MACHINE.rsplit("/", 1)[0] + "/pid:[1]",
                                  "pid": _dead_pid(), "start": 1}),
        "foreign-host": json.dumps({"machine": "elsewhere/" + MACHINE.split("/", 1)[1],
                                    "pid": _dead_pid(), "start": None}),
        "old-version": f"{os.uname().nodename} {_dead_pid()}",
        "torn": '{"machine": "',
        "no-owner": None,
    }
    for name, text in records.items():
        d = local / f"{WORKDIR_PREFIX}{name}"
        d.mkdir(parents=True)
        if text is not None:
            (d / OWNER_FILE).write_text(text)
    ours = local / f"{WORKDIR_PREFIX}ours"  # the same record of this machine goes
    ours.mkdir()
    (ours / OWNER_FILE).write_text(json.dumps(
        {"machine": MACHINE, "pid": _dead_pid(), "start": 1}))
    assert sweep_stale(str(local)) == [str(ours)]
    assert workdirs(local) == sorted(f"{WORKDIR_PREFIX}{n}" for n in records)


def test_process_identity_tells_a_reused_pid_and_a_zombie_from_the_owner():
    me = ProcessId.current()
    assert me.start is not None and not me.dead()
    # the pid of a live process, started at another time than the recorded owner
    assert ProcessId(MACHINE, os.getpid(), me.start - 1).dead()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        start = None
        deadline = time.time() + 30
        while time.time() < deadline:  # its start time, while it still runs or is a zombie
            start = start or start_time(zombie.pid)
            with open(f"/proc/{zombie.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        assert pid_alive(zombie.pid)  # kill(pid, 0) still answers for a zombie
        assert ProcessId(MACHINE, zombie.pid, start).dead()
    finally:
        zombie.wait()
    assert ProcessId(MACHINE, zombie.pid, start).dead()  # reaped
    assert not ProcessId(MACHINE + "x", zombie.pid, start).dead()  # not this machine
    assert ProcessId.from_dict(me.to_dict()) == me
    for bad in (None, "x", {"machine": MACHINE}, {"machine": MACHINE, "pid": True},
                {"machine": MACHINE, "pid": 5, "start": "1"}, {"machine": "", "pid": 5}):
        assert ProcessId.from_dict(bad) is None


# ------------------------------------------------------------------ real pid namespaces


@cache
def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        out = subprocess.run([*UNSHARE, sys.executable, "-c",
                              "import os; open('/proc/sys/kernel/ns_last_pid', 'w')"
                              ".write('999'); print(os.getpid())"],
                             capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and out.stdout.strip() == "1"


needs_pid_namespaces = pytest.mark.skipif(
    not _unshare_works(), reason="cannot make pid namespaces here (unshare --pid)")


def _in_new_pid_namespace(code: str, **kw) -> subprocess.Popen:
    """Run ``code`` as pid 1 of a new pid namespace (children get the pids it chooses
    through ``ns_last_pid``)."""
    return subprocess.Popen([*UNSHARE, sys.executable, "-c", textwrap.dedent(code)],
                            text=True, cwd=os.getcwd(), **kw)


def _next_pid_code() -> str:
    return ("def next_pid(n):\n"
            "    with open('/proc/sys/kernel/ns_last_pid', 'w') as f:\n"
            "        f.write(str(n - 1))\n")


@needs_pid_namespaces
def test_a_live_table_of_another_pid_namespace_is_not_swept(tmp_path):
    """Regression: another container sharing the directory (same host name, its own pid
    namespace) has a live table whose pid is no process here; the sweep deleted it."""
    local = tmp_path / "local"
    local.mkdir()
    pid = _dead_pid()
    inner = _next_pid_code() + textwrap.dedent(f"""
        import subprocess, sys
        next_pid({pid})
        sys.exit(subprocess.call([sys.executable, "-c", {table_script(
            local, "sys.stdin.read(); os._exit(0)")!r}]))
    """)
    p = _in_new_pid_namespace(inner, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        their_pid, path = p.stdout.readline().split()
        assert int(their_pid) == pid and not pid_alive(pid)  # no such process here
        assert owner_of(path)["machine"] != MACHINE  # another pid namespace
        assert sweep_stale(str(local)) == []
        t = RocksDBStateTable(KGS, str(local))  # a table of this namespace, same directory
        assert os.path.exists(path)
        t.close()
    finally:
        p.stdin.close()
        p.wait(timeout=30)
    # even with its owner gone it stays: from here, nothing tells its pid is free there
    assert sweep_stale(str(local)) == [] and os.path.exists(path)


@needs_pid_namespaces
def test_a_reused_pid_does_not_keep_a_dead_owners_directory(tmp_path):
    """Regression: a killed worker's pid, given by the kernel to a later process, kept the
    worker's directory as if its owner lived (a leak for as long as that process runs)."""
    local = tmp_path / "local"
    local.mkdir()
    pid = random.randint(20_000, 30_000)
    inner = _next_pid_code() + textwrap.dedent(f"""
        import json, os, subprocess, sys, time
        next_pid({pid})
        owner = subprocess.run([sys.executable, "-c", {table_script(local, "os._exit(9)")!r}],
                               capture_output=True, text=True)
        time.sleep(0.1)  # the next process starts some clock ticks later
        next_pid({pid})
        reuse = subprocess.Popen(["sleep", "60"])
        from dstl_ray.state.rocksdb_local import sweep_stale
        gone = sweep_stale({str(local)!r})
        print(json.dumps({{"owner": owner.stdout.split(), "reuse": reuse.pid,
                          "gone": gone}}))
        reuse.kill()
        reuse.wait()
    """)
    p = _in_new_pid_namespace(inner, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    res = json.loads(out.strip().splitlines()[-1])
    owner_pid, owner_path = res["owner"]
    assert int(owner_pid) == res["reuse"] == pid  # the same pid, another process
    assert res["gone"] == [owner_path]
    assert workdirs(local) == []
