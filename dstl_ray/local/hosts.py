"""Several hosts on one machine: Linux network namespaces on a bridge, each with an IP and a
network stack of its own and a Ray node started in it with ``ray start`` (the head in the
first). Traffic between them goes over the bridge to these addresses only; a host can be
partitioned (its link down) and healed, or lost (every process in it killed at once) and
replaced by a fresh one, as machines of a real cluster are.

Needs root and the ``ip`` tool (:func:`unavailable` says why not). Every name carries
:data:`PREFIX` and the cluster's tag, and :func:`remove_stale` removes what an earlier run
left (namespaces, links, the processes in them), also after a crash:

>>> with HostCluster(3) as hosts:                                     # doctest: +SKIP
...     hosts.run(hosts.hosts[0], [sys.executable, "driver.py", hosts.address])

A driver must run on a Ray node: :meth:`HostCluster.run` runs a command inside a host's
namespace (its Ray node is local there).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "dstlh"  # namespaces dstlh-<tag>-<i>; links dstlb<tag> (bridge), dstlv<tag><i>
HEAD_PORT = 6379
SPEC_ENV = "DSTL_HOSTS"  # the cluster's hosts, for a driver run inside one (HostLinks)


def unavailable() -> str | None:
    """Why hosts cannot be made here (None: they can): not root, or no ``ip`` tool."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip tool (iproute2) is not installed"
    return None


def _ip(*args: str, check: bool = True, netns: str = "") -> subprocess.CompletedProcess[str]:
    """``ip ARGS``, in network namespace file ``netns`` if given (``nsenter``)."""
    enter = ["nsenter", f"--net={netns}"] if netns else []
    out = subprocess.run([*enter, "ip", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in network namespace ``ns`` (a host lost at once)."""
    for _ in range(5):  # processes may fork while being killed
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def remove_stale(tag: str = "") -> list[str]:
    """Remove the namespaces (killing their processes) and links of host clusters with
    ``tag`` (every one when empty): what a crashed run left. Returns what was removed."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if ns.startswith(f"{PREFIX}-{tag}"):
            _kill_namespace(ns)
            _ip("netns", "del", ns, check=False)
            gone.append(ns)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith((f"{PREFIX}b{tag}", f"{PREFIX}v{tag}")):
            _ip("link", "del", name, check=False)
            gone.append(name)
    return gone


def _outer_env() -> dict[str, str]:
    """This process's environment without Ray's variables (a test session's own cluster
    address and settings are not the hosts')."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}


@dataclass(frozen=True)
class Host:
    """One host: its namespace, IP, and the bridge side of its link."""

    index: int
    namespace: str
    ip: str
    link: str


@dataclass
class HostCluster:
    """``n`` hosts on one bridge, a Ray node each (``cpus`` CPUs; the head on the first).
    Use as a context manager, or :meth:`start` and :meth:`stop`."""

    n: int
    cpus: int = 1
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    env: dict[str, str] = field(default_factory=dict)  # for every Ray process and run()
    hosts: list[Host] = field(default_factory=list)
    _next: int = 0

    def __post_init__(self) -> None:
        # 10.<a>.<b>.0/24 from the tag: clusters of concurrent runs do not share addresses
        t = int(self.tag, 16)
        self.subnet = f"10.{200 + t % 50}.{(t // 50) % 250}"
        self.bridge = f"{PREFIX}b{self.tag}"
        self.temp = Path(f"/tmp/{PREFIX}{self.tag}")  # short: Ray's socket paths are limited

    @property
    def address(self) -> str:
        """The head's GCS address (``ray start --address`` / ``ray.init``)."""
        return f"{self.hosts[0].ip}:{HEAD_PORT}"

    def __enter__(self) -> HostCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> HostCluster:
        reason = unavailable()
        if reason:
            raise RuntimeError(f"cannot make hosts: {reason}")
        remove_stale(self.tag)
        # a token-authenticated cluster, as a real one across machines: the cluster's own
        # token, given to every Ray process and driver started here
        self.temp.mkdir(parents=True, exist_ok=True)
        token = self.temp / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), **self.env}
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for _ in range(self.n):
                self.add_host()
        except BaseException:
            self.stop()
            raise
        return self

    def add_host(self) -> Host:
        """A fresh host joins: a namespace, its link, its Ray node (the head if first)."""
        i = self._next
        self._next += 1
        host = Host(i, f"{PREFIX}-{self.tag}-{i}", f"{self.subnet}.{i + 2}",
                    f"{PREFIX}v{self.tag}{i}")
        peer = f"{PREFIX}p{self.tag}{i}"
        _ip("netns", "add", host.namespace)
        _ip("link", "add", host.link, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", host.namespace)
        _ip("link", "set", host.link, "master", self.bridge)
        _ip("link", "set", host.link, "up")
        inside = ("netns", "exec", host.namespace, "ip")
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "link", "set", peer, "name", "eth0")
        _ip(*inside, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        self.hosts.append(host)
        self._ray_start(host, head=not self.hosts[:-1])
        return host

    def _ray_start(self, host: Host, head: bool) -> None:
        ray = str(Path(sys.executable).parent / "ray")
        argv = [ray, "start", f"--node-ip-address={host.ip}", f"--num-cpus={self.cpus}",
                f"--temp-dir={self.temp / str(host.index)}", "--disable-usage-stats"]
        argv += (["--head", f"--port={HEAD_PORT}", "--include-dashboard=false"] if head
                 else [f"--address={self.address}"])
        out = self.run(host, argv, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"ray start on {host.namespace} ({host.ip}) failed: "
                               f"{out.stderr[-2000:]}")

    def run(self, host: Host, argv: list[str], timeout: float | None = None,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``host``'s namespace (its Ray node is local there)."""
        env = {**_outer_env(), **self.env, **kwargs.pop("env", {})}
        return subprocess.run(["ip", "netns", "exec", host.namespace, *argv], env=env,
                              capture_output=True, text=True, timeout=timeout, **kwargs)

    def popen(self, host: Host, argv: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        """:meth:`run`, started in the background."""
        env = {**_outer_env(), **self.env, **kwargs.pop("env", {})}
        return subprocess.Popen(["ip", "netns", "exec", host.namespace, *argv], env=env,
                                text=True, **kwargs)

    def spec(self) -> dict[str, Any]:
        """What a driver run inside a host needs to cut the others' links
        (:class:`HostLinks`): the hosts, and the network namespace their links are in (this
        process's)."""
        return {"address": self.address, "netns": f"/proc/{os.getpid()}/ns/net",
                "hosts": [{"namespace": h.namespace, "ip": h.ip, "link": h.link}
                          for h in self.hosts]}

    def rerun(self, host: Host, argv: list[str], cwd: str | Path | None = None) -> int:
        """Run ``argv`` inside ``host`` with this process's terminal (a driver of the
        cluster, as ``dstl-ray demo --hosts N`` and ``experiments.chaos_spark --hosts N``
        run themselves), the hosts in ``DSTL_HOSTS``; returns its exit code."""
        proc = self.popen(host, argv, cwd=cwd, env={SPEC_ENV: json.dumps(self.spec())})
        try:
            return proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def partition(self, host: Host) -> None:
        """Cut ``host`` off: its link goes down (its processes live on, unreachable)."""
        _ip("link", "set", host.link, "down")

    def heal(self, host: Host) -> None:
        _ip("link", "set", host.link, "up")

    def lose(self, host: Host) -> None:
        """Every process of ``host`` killed at once, its namespace and link gone."""
        _kill_namespace(host.namespace)
        _ip("netns", "del", host.namespace, check=False)
        _ip("link", "del", host.link, check=False)
        self.hosts = [h for h in self.hosts if h != host]

    def stop(self) -> None:
        """Every host lost, the bridge gone: nothing left (see :func:`remove_stale`)."""
        for host in list(self.hosts):
            self.lose(host)
        remove_stale(self.tag)
        shutil.rmtree(self.temp, ignore_errors=True)


def without_hosts_flag(argv: list[str]) -> list[str]:
    """``argv`` without its ``--hosts N`` (or ``--hosts=N``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--hosts":
            skip = True
        elif not a.startswith("--hosts="):
            out.append(a)
    return out


def rerun_on_hosts(hosts: int, command: list[str], say: Any = print) -> int:
    """Run this program again as the driver of ``hosts`` hosts (root): a
    :class:`HostCluster` of one CPU per host is made, ``command`` plus this process's
    arguments without ``--hosts``, plus ``--ray-address ADDRESS``, runs in the first host
    (with ``DSTL_HOSTS``, so it can cut the others' links: :class:`HostLinks`), and the
    cluster is torn down when it exits. Returns its exit code. ``dstl-ray demo --hosts N``
    and ``experiments.chaos_spark --hosts N`` run this way."""
    reason = unavailable()
    if reason:
        raise RuntimeError(f"--hosts {hosts}: cannot make hosts here: {reason}")
    if hosts < 2:
        raise ValueError(f"--hosts must be at least 2, got {hosts}")
    with HostCluster(hosts) as hc:
        say(f"[hosts] {hosts} hosts (network namespaces): {', '.join(h.ip for h in hc.hosts)}"
            f"; Ray's head and the driver in {hc.hosts[0].ip}")
        return hc.rerun(hc.hosts[0], [*command, *without_hosts_flag(sys.argv[1:]),
                                      "--ray-address", hc.address], cwd=os.getcwd())


@dataclass(frozen=True)
class HostLinks:
    """The hosts' links as a driver inside one of them sees them (:meth:`HostCluster.rerun`
    gives it ``DSTL_HOSTS``): it partitions and heals another host as the cluster's owner
    does, entering the owner's network namespace (``nsenter``; root)."""

    address: str
    netns: str
    hosts: tuple[Host, ...]

    @classmethod
    def from_env(cls) -> HostLinks | None:
        """The hosts this process runs among, or None outside a :class:`HostCluster`."""
        raw = os.environ.get(SPEC_ENV)
        if not raw:
            return None
        spec = json.loads(raw)
        return cls(spec["address"], spec["netns"], tuple(
            Host(i, h["namespace"], h["ip"], h["link"]) for i, h in enumerate(spec["hosts"])))

    def partition(self, host: Host) -> None:
        """Cut ``host`` off (its link down), as :meth:`HostCluster.partition`."""
        _ip("link", "set", host.link, "down", netns=self.netns)

    def heal(self, host: Host) -> None:
        _ip("link", "set", host.link, "up", netns=self.netns)
