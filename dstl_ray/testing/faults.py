"""Fault and latency injection for tests and experiments (``dstl_ray.testing.faults``).

:class:`FaultyStorage` wraps any :class:`~dstl_ray.storage.base.Storage` (typically s3fs in front of
a real S3 server on loopback) and, on each ``write_file`` whose path contains ``match``, first
waits a latency drawn from a distribution, then may inject a fault:

``5xx``      the store answers 503 SlowDown: nothing is written;
``timeout``  the request hangs ``hang_s`` seconds, then fails: nothing is written;
``reset``    the connection is reset before the request completes: nothing is written;
``torn``     half of the bytes land under the name, then the connection resets (a store
             without atomic puts; readers must detect it by CRC, the uploader cleans it up);
``slow:S``   the request takes S seconds more, then succeeds (a straggler);
``ok``       no fault.

It is configured by a picklable JSON string, the ``fault_spec`` option, so node actors in other
processes inject the same faults (their config's ``plugins`` option names ``dstl_ray.testing``,
so they import this module, which registers the wrapper: the runtime never imports it)::

    {"latency": {"dist": "flip158", "scale": 0.1},   # or {"fixed_s": 0.05}
     "error_rate": 0.01, "timeout_rate": 0, "reset_rate": 0, "torn_rate": 0,
     "hang_s": 30, "script": ["5xx", "timeout", "ok", "slow:0.8"],
     "match": ".dstl", "seed": 1}

``script`` applies to the first matching writes in order, then the rates apply. The latency
distribution ``flip158`` reproduces FLIP-158's measured S3 write latencies (p50 459 ms, p90 740,
p95 833, p99 1039, p999 3202 ms) exactly at those quantiles, interpolated log-linearly between
them; ``scale`` multiplies every latency (0.1 for fast tests).
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..config import register_option_check
from ..errors import ConfigError, DstlError
from ..storage.base import Storage
from ..storage.registry import register_storage_wrapper

# (quantile, latency ms): FLIP-158 "DFS write latency" plus the two ends we chose
FLIP158_QUANTILES_MS: tuple[tuple[float, float], ...] = (
    (0.0, 250.0), (0.5, 459.0), (0.9, 740.0), (0.95, 833.0), (0.99, 1039.0),
    (0.999, 3202.0), (1.0, 4500.0))

KINDS = ("ok", "5xx", "timeout", "reset", "torn")


class InjectedFault(DstlError):
    """A fault injected by :class:`FaultyStorage` (stands for a store's or network's error)."""


class LatencyDistribution:
    """A latency distribution given by its quantile function: points (q, ms), log-linear in
    between; sampling is inverse-CDF, so the given quantiles are matched exactly."""

    def __init__(self, quantiles_ms: tuple[tuple[float, float], ...] = FLIP158_QUANTILES_MS,
                 scale: float = 1.0) -> None:
        qs = [q for q, _ in quantiles_ms]
        if qs != sorted(qs) or qs[0] != 0.0 or qs[-1] != 1.0:
            raise ValueError("quantiles must rise from 0 to 1")
        if any(ms <= 0 for _, ms in quantiles_ms) or scale <= 0:
            raise ValueError("latencies and scale must be > 0")
        self.points = tuple(quantiles_ms)
        self.scale = scale

    @classmethod
    def flip158(cls, scale: float = 1.0) -> LatencyDistribution:
        return cls(FLIP158_QUANTILES_MS, scale)

    def quantile_ms(self, u: float) -> float:
        u = min(1.0, max(0.0, u))
        pts = self.points
        for (q0, m0), (q1, m1) in zip(pts, pts[1:], strict=False):
            if u <= q1:
                f = 0.0 if q1 == q0 else (u - q0) / (q1 - q0)
                return math.exp(math.log(m0) + f * (math.log(m1) - math.log(m0))) * self.scale
        return pts[-1][1] * self.scale

    def sample_s(self, rng: random.Random) -> float:
        return self.quantile_ms(rng.random()) / 1000.0


@dataclass(frozen=True)
class FaultSpec:
    latency: LatencyDistribution | None = None
    fixed_latency_s: float = 0.0
    error_rate: float = 0.0
    timeout_rate: float = 0.0
    reset_rate: float = 0.0
    torn_rate: float = 0.0
    hang_s: float = 30.0
    script: tuple[str, ...] = ()
    match: str = ""
    seed: int | None = None
    text: str = field(default="", compare=False)

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """Parse the ``fault_spec`` option; a bad spec raises ConfigError naming the key."""
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"option fault_spec must be a JSON object: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError("option fault_spec must be a JSON object")
        known = {"latency", "error_rate", "timeout_rate", "reset_rate", "torn_rate", "hang_s",
                 "script", "match", "seed"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"option fault_spec: unknown key(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known))}")
        kw: dict[str, Any] = {"text": text}
        lat = d.get("latency")
        if lat is not None:
            if not isinstance(lat, dict):
                raise ConfigError("option fault_spec: latency must be an object")
            if "fixed_s" in lat:
                kw["fixed_latency_s"] = _num("latency.fixed_s", lat["fixed_s"], 0, 3600)
            elif lat.get("dist", "flip158") == "flip158":
                kw["latency"] = LatencyDistribution.flip158(
                    _num("latency.scale", lat.get("scale", 1.0), 1e-6, 1000))
            else:
                raise ConfigError("option fault_spec: latency.dist must be flip158")
        for k in ("error_rate", "timeout_rate", "reset_rate", "torn_rate"):
            if k in d:
                kw[k] = _num(k, d[k], 0, 1)
        if "hang_s" in d:
            kw["hang_s"] = _num("hang_s", d["hang_s"], 0, 3600)
        script = d.get("script", [])
        if not isinstance(script, list) or not all(isinstance(s, str) for s in script):
            raise ConfigError("option fault_spec: script must be a list of strings")
        for s in script:
            _check_kind(s)
        kw["script"] = tuple(script)
        if not isinstance(d.get("match", ""), str):
            raise ConfigError("option fault_spec: match must be a string")
        kw["match"] = d.get("match", "")
        seed = d.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ConfigError("option fault_spec: seed must be an integer")
        kw["seed"] = seed
        return cls(**kw)


def _num(key: str, v: Any, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ConfigError(f"option fault_spec: {key} must be a number in [{lo:g}, {hi:g}], "
                          f"got {v!r}")
    return float(v)


def _check_kind(s: str) -> None:
    if s in KINDS:
        return
    if s.startswith("slow:"):
        try:
            if float(s[5:]) >= 0:
                return
        except ValueError:
            pass
    raise ConfigError(f"option fault_spec: script entry {s!r} must be one of "
                      f"{', '.join(KINDS)} or slow:SECONDS")


class FaultyStorage:
    """A :class:`Storage` that injects latency and faults into ``write_file`` of ``inner``."""

    def __init__(self, inner: Storage, spec: FaultSpec | str) -> None:
        self.inner = inner
        self.spec = FaultSpec.parse(spec) if isinstance(spec, str) else spec
        self.protocol = getattr(inner, "protocol", "")
        self._rng = random.Random(self.spec.seed)
        self._lock = threading.Lock()
        self._script = list(self.spec.script)
        self.injected: Counter[str] = Counter()

    def _next(self) -> tuple[str, float]:
        """(fault kind, latency s) of the next matching write."""
        s = self.spec
        with self._lock:
            latency = s.fixed_latency_s
            if s.latency is not None:
                latency += s.latency.sample_s(self._rng)
            if self._script:
                kind = self._script.pop(0)
            else:
                u = self._rng.random()
                kind = "ok"
                for k, rate in (("5xx", s.error_rate), ("timeout", s.timeout_rate),
                                ("reset", s.reset_rate), ("torn", s.torn_rate)):
                    if u < rate:
                        kind = k
                        break
                    u -= rate
            self.injected[kind.split(":")[0]] += 1
        return kind, latency

    def write_file(self, path: str, data: bytes) -> None:
        if self.spec.match not in path:
            self.inner.write_file(path, data)
            return
        kind, latency = self._next()
        if latency:
            time.sleep(latency)
        if kind == "ok":
            self.inner.write_file(path, data)
        elif kind.startswith("slow:"):
            time.sleep(float(kind[5:]))
            self.inner.write_file(path, data)
        elif kind == "5xx":
            raise InjectedFault(f"injected 503 SlowDown (Please reduce your request rate) "
                                f"on PUT {path}")
        elif kind == "timeout":
            time.sleep(self.spec.hang_s)
            raise InjectedFault(f"injected timeout: no answer to PUT {path} within "
                                f"{self.spec.hang_s:g}s")
        elif kind == "reset":
            raise InjectedFault(f"injected connection reset by peer during PUT {path}")
        elif kind == "torn":
            self.inner.write_file(path, data[:len(data) // 2])
            raise InjectedFault(f"injected torn upload: {len(data) // 2} of {len(data)} bytes "
                                f"of {path} landed, then the connection reset")

    def append_file(self, path: str, data: bytes) -> int:
        """The same faults for appends (merged files, FLIP-306): a torn append leaves half
        the bytes at the end of the file."""
        if self.spec.match not in path:
            return self.inner.append_file(path, data)  # type: ignore[attr-defined]
        kind, latency = self._next()
        if latency:
            time.sleep(latency)
        if kind.startswith("slow:"):
            time.sleep(float(kind[5:]))
        if kind == "ok" or kind.startswith("slow:"):
            return self.inner.append_file(path, data)  # type: ignore[attr-defined]
        if kind == "timeout":
            time.sleep(self.spec.hang_s)
        if kind == "torn":
            self.inner.append_file(path, data[:len(data) // 2])  # type: ignore[attr-defined]
        raise InjectedFault(f"injected {kind} on append to {path}")

    def read_file(self, path: str) -> bytes:
        return self.inner.read_file(path)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        return self.inner.read_range(path, offset, length)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def list_dirs(self, path: str) -> list[str]:
        listing = getattr(self.inner, "list_dirs", None)
        return listing(path) if listing is not None else []

    def make_dirs(self, path: str) -> None:
        make = getattr(self.inner, "make_dirs", None)
        if make is not None:
            make(path)

    def delete_dir(self, path: str) -> None:
        remove = getattr(self.inner, "delete_dir", None)
        if remove is not None:
            remove(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def list_files(self, prefix: str) -> list[str]:
        return self.inner.list_files(prefix)


# wired from here, never from the runtime: importing this module (or naming dstl_ray.testing in
# option plugins, for processes such as node actors) makes fault_spec checked and injected
register_option_check("fault_spec", FaultSpec.parse)
register_storage_wrapper("fault_spec", FaultyStorage)
