"""Hops between hosts (issue 31 item 4): what a call from one host to a node actor on another
costs as a Ray actor call, and over a TCP lane (the Unix lane's protocol on a TCP socket:
the hello and token first, then frames of the lane codec, ``dstl_ray.transport.lane_codec``,
never pickle), between two network namespaces with their own IPs on a bridge
(``dstl_ray.local.hosts``).

The calls are the ones a lane carries: a writer's ``mark`` (a few hundred bytes), a writer's
``persist_many`` (one request of 16 KiB: a subtask's changes between checkpoints) and a
node's ``persist_batch`` to its parent (256 KiB and 4 MiB: a child's batch). Over Ray the
requests are the same ``PersistRequest`` objects, pickled by Ray (above its 100 KiB inline
limit they go through the object store, fetched from the caller's host). The receiver is an
async actor on the second host that decodes each call (the lane server decodes every field;
Ray unpickles) and answers; the caller on the first host times each call from send to the
answer read, one at a time (``--calls`` per kind), after ``WARMUP`` untimed ones. The same
Ray calls to a receiver on the caller's own host (``ray_same_host``), and the Unix lane to
it (``unix_lane_same_host``), give what crossing hosts adds to each carrier.

Run (as root): python -m experiments.host_hops [--quick] [--calls N]. Writes
experiments/results/host_hops.json (+ .png); ``experiments.tree_scale_sim`` takes its hop
costs from it.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

from .common import parser, plt, summary, write_results

KINDS = (("mark", 0), ("persist_many", 16 << 10), ("persist_batch", 256 << 10),
         ("persist_batch", 4 << 20))
WARMUP = 20
ROOT = Path(__file__).resolve().parent.parent


def requests(nbytes: int) -> list[Any]:
    """One persist request of ``nbytes`` of changes (a section of one block)."""
    from dstl_ray.format.changelog import BlockIndex, EncodedSection
    from dstl_ray.transport.base import PersistRequest
    from dstl_ray.transport.sender import Caller

    log = bytes(range(16))
    body = b"x" * nbytes
    section = EncodedSection(log, body, (BlockIndex(log, 1, 1, 1, 0, len(body)),), 1, 1, 0)
    return [PersistRequest("job", section, "writer-0", (), 7, Caller("hops"), 4, "inc", 6)]


def args_of(method: str, nbytes: int) -> tuple[Any, ...]:
    from dstl_ray.transport.sender import Caller

    if method == "mark":
        return ("job", "writer-0", 7, Caller("hops"), 3)
    if method == "persist_many":
        return (requests(nbytes),)
    return (requests(nbytes), "node-child", 2.0, time.time())


class Receiver:
    """The far end: Ray methods for each call, and a TCP lane server on this host's IP."""

    def __init__(self) -> None:
        import secrets

        self.token = secrets.token_hex(16)
        self.port = 0

    async def start_lane(self, unix: bool = False) -> tuple[str, str]:
        """Listen on this host's IP (the host lane), or on a Unix socket (the local lane);
        returns the address and the token."""
        import asyncio
        import tempfile

        import ray

        if unix:
            path = f"{tempfile.mkdtemp(prefix='hops-')}/lane.sock"
            self._server = await asyncio.start_unix_server(self._serve, path=path)
            return path, self.token
        ip = ray.util.get_node_ip_address()
        self._server = await asyncio.start_server(self._serve, host=ip, port=0)
        return f"tcp://{ip}:{self._server.sockets[0].getsockname()[1]}", self.token

    async def _serve(self, reader: Any, writer: Any) -> None:
        import hmac

        from dstl_ray.transport.lane_codec import (
            _LEN,
            decode_call,
            encode_answer,
            frame,
            hello_bytes,
        )

        want = hello_bytes(self.token)
        got = await reader.readexactly(len(want))
        if not hmac.compare_digest(got, want):
            writer.close()
            return
        try:
            while True:
                (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                call_id, _method, _args = decode_call(await reader.readexactly(n))
                writer.write(frame(encode_answer(call_id, True, None)))
                await writer.drain()
        except Exception:  # noqa: BLE001 - the caller closed its lane
            writer.close()

    async def mark(self, *args: Any) -> None:
        return None

    async def persist_many(self, requests: list[Any]) -> None:
        return None

    async def persist_batch(self, requests: list[Any], *args: Any) -> None:
        return None


class TcpLane:
    """The caller's end of a lane (``tcp://ip:port``, or a Unix socket's path): one call at
    a time, answered in order."""

    def __init__(self, address: str, token: str) -> None:
        from dstl_ray.transport.lane_codec import hello_bytes

        if address.startswith("tcp://"):
            ip, _, port = address[len("tcp://"):].rpartition(":")
            self.sock = socket.create_connection((ip, int(port)))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(address)
        self.sock.sendall(hello_bytes(token))
        self.ids = 0

    def _read(self, n: int) -> bytes:
        parts, left = [], n
        while left:
            b = self.sock.recv(min(left, 1 << 20))
            if not b:
                raise ConnectionError("the lane closed")
            parts.append(b)
            left -= len(b)
        return b"".join(parts)

    def call(self, method: str, args: tuple[Any, ...]) -> None:
        from dstl_ray.transport.lane_codec import _LEN, decode_answer, encode_call, frame

        self.ids += 1
        self.sock.sendall(frame(encode_call(self.ids, method, args)))
        (n,) = _LEN.unpack(self._read(_LEN.size))
        call_id, ok, value = decode_answer(self._read(n))
        if call_id != self.ids or not ok:
            raise RuntimeError(f"lane call {self.ids} answered {call_id} {ok} {value}")


def drive(address: str, calls: int) -> dict[str, Any]:
    """In the first host's namespace: the receiver on another host, each kind timed."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=address, namespace="hops", log_to_driver=False)
    here = ray.get_runtime_context().get_node_id()
    other = next(n for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
    recv = ray.remote(num_cpus=0)(Receiver).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(other["NodeID"], soft=False)).remote()
    near = ray.remote(num_cpus=0)(Receiver).options(  # the same call on one host, to compare
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()
    address, token = ray.get(recv.start_lane.remote())
    lane = TcpLane(address, token)
    local = TcpLane(*ray.get(near.start_lane.remote(unix=True)))
    out: dict[str, Any] = {"from": ray.util.get_node_ip_address(), "to": address, "kinds": []}
    for method, nbytes in KINDS:
        row: dict[str, Any] = {"method": method, "bytes": nbytes}
        for carrier in ("ray", "tcp_lane", "ray_same_host", "unix_lane_same_host"):
            ms = []
            for i in range(WARMUP + calls):
                args = args_of(method, nbytes)  # (as a caller builds each call)
                t0 = time.perf_counter()
                if carrier.endswith("lane") or carrier == "unix_lane_same_host":
                    (lane if carrier == "tcp_lane" else local).call(method, args)
                else:
                    ray.get(getattr(recv if carrier == "ray" else near, method).remote(*args))
                if i >= WARMUP:
                    ms.append((time.perf_counter() - t0) * 1000)
            row[carrier] = summary(ms)
            row[f"{carrier}_ms"] = [round(x, 3) for x in ms]
        out["kinds"].append(row)
    return out


def plot(kinds: list[dict[str, Any]]) -> Any:
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(9, 4))
    labels = [f"{k['method']}\n{k['bytes'] >> 10} KiB" for k in kinds]
    x = range(len(kinds))
    for off, carrier, color in ((-0.2, "ray", "tab:orange"), (0.2, "tcp_lane", "tab:blue")):
        p50 = [k[carrier]["p50"] for k in kinds]
        p99 = [k[carrier]["p99"] for k in kinds]
        ax.bar([i + off for i in x], p50, width=0.38, color=color,
               label=f"{'Ray actor call' if carrier == 'ray' else 'TCP lane'} p50")
        ax.scatter([i + off for i in x], p99, color="black", marker="_", s=200,
                   label="p99" if carrier == "ray" else None)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels)
    ax.set_yscale("log")
    ax.set_ylabel("ms per call, between two hosts")
    ax.set_title("A call to a node actor on another host: Ray vs a TCP lane")
    ax.legend(fontsize=8)
    return fig


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--driver", default="", help=argparse_hidden())
    args = p.parse_args()
    calls = 50 if args.quick else args.calls
    if args.driver:
        print("RESULT " + json.dumps(drive(args.driver, calls)), flush=True)
        return
    from dstl_ray.local.hosts import HostCluster, unavailable

    reason = unavailable()
    if reason:
        raise SystemExit(f"experiments.host_hops cannot run here: {reason}")
    with HostCluster(2) as hc:
        out = hc.run(hc.hosts[0], [sys.executable, "-m", "experiments.host_hops",
                                   "--driver", hc.address, "--calls", str(calls)],
                     timeout=1800, cwd=ROOT)
    if out.returncode != 0 or "RESULT " not in out.stdout:
        raise SystemExit(f"the driver failed: {out.stderr[-3000:]}")
    res = json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])
    wins = {f"{k['method']}_{k['bytes']}": k["tcp_lane"]["p50"] < k["ray"]["p50"]
            and k["tcp_lane"]["p99"] < k["ray"]["p99"] for k in res["kinds"]}
    for k in res["kinds"]:
        print(f"{k['method']:14s} {k['bytes']:>8} B  ray p50 {k['ray']['p50']:.3f} "
              f"p99 {k['ray']['p99']:.3f}  tcp lane p50 {k['tcp_lane']['p50']:.3f} "
              f"p99 {k['tcp_lane']['p99']:.3f} ms")
    write_results("host_hops", {"calls": calls, **res, "tcp_lane_wins_p50_and_p99": wins},
                  plot(res["kinds"]), args.out)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
