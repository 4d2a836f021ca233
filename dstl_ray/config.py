"""The one typed configuration object of dstl-ray.

Defaults follow Flink's DSTL (``state.changelog.dstl.dfs.*``) where it has the option; the
tree's own options (branching, flush size, routing horizon) and hedging are ours. Every option
can also be set through an environment variable ``DSTL_<OPTION_NAME_UPPER>``; a bad value fails
at start with a :class:`~dstl_ray.errors.ConfigError` that names the option and its range.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

KiB = 1024
MiB = 1024 * 1024

COMPRESSIONS = ("none", "zstd")


@dataclass(frozen=True)
class _Spec:
    doc: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] | None = None


def _opt(default: Any, doc: str, lo: float | None = None, hi: float | None = None,
         choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"spec": _Spec(doc, lo, hi, choices)})


@dataclass(frozen=True)
class ChangelogConfig:
    """Configuration of a changelog tree and its writers (see README "Configuration")."""

    persist_delay_s: float = _opt(
        0.010, "Wait after the first pending persist request before sending a batch "
        "(Flink: persist-delay 10 ms).", 0.0, 60.0)
    persist_size_threshold: int = _opt(
        10 * MiB, "Send a batch at once when a node buffers this many bytes "
        "(Flink: persist-size-threshold 10 MiB).", 1, 1 << 40)
    preemptive_persist_threshold: int = _opt(
        5 * MiB, "A writer ships its unpersisted changes before the checkpoint asks once they "
        "pass this size (Flink: preemptive-persist-threshold 5 MiB).", 1, 1 << 40)
    in_flight_limit: int = _opt(
        100 * MiB, "Upload bytes in flight per node before persist requests wait "
        "(Flink: upload.max-in-flight 100 MiB).", 1, 1 << 44)
    upload_timeout_s: float = _opt(
        1.0, "Timeout of one DFS upload attempt (Flink: upload.timeout 1 s).", 0.001, 3600.0)
    max_attempts: int = _opt(
        3, "Attempts per DFS upload, the first included (Flink: retry-policy fixed, 3).", 1, 100)
    retry_delay_s: float = _opt(
        0.5, "Delay after a failed attempt (Flink: upload.next-attempt-delay 500 ms).", 0.0, 600.0)
    compression: str = _opt(
        "none", "Compression of changelog files: none or zstd (Flink: compression disabled).",
        choices=COMPRESSIONS)
    branching_factor: int = _opt(
        4, "Children per node in the aggregation tree.", 1, 1024)
    flush_bytes: int = _opt(
        4 * MiB, "A non-root node holding at least this many bytes writes the file itself "
        "instead of forwarding to its parent.", 0, 1 << 40)
    routing_horizon: int = _opt(
        0, "Up-front routing: decide which ancestor flushes for the next N batches (0: off).",
        0, 1_000_000)
    hedge_delay_s: float = _opt(
        0.0, "Start a second (hedged) attempt of a DFS upload slower than this (0: use "
        "hedge_quantile of recent latencies, when hedging is on).", 0.0, 3600.0)
    hedge_quantile: float = _opt(
        0.0, "Hedge uploads slower than this quantile of recent latencies (0: hedging off).",
        0.0, 1.0)
    membership_interval_s: float = _opt(
        2.0, "How often the root checks Ray's node list: joined nodes get a node actor and "
        "attach as leaves, a removed node's children re-attach (0: never).", 0.0, 3600.0)
    tracing: str = _opt(
        "off", "OpenTelemetry tracing of upload paths: off, console, otlp (OTEL_* variables), "
        "memory (tests) or file:<dir> (JSON lines for dstl-ray trace).")
    namespace: str = _opt("dstl_ray", "Ray namespace of the node actors.")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            spec: _Spec = f.metadata["spec"]
            value = getattr(self, f.name)
            expected = f.type if isinstance(f.type, type) else {"float": float, "int": int,
                                                                 "str": str}[f.type]
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
                value = float(value)
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ConfigError(
                    f"option {f.name} must be {expected.__name__}, got {value!r}")
            if spec.choices is not None and value not in spec.choices:
                raise ConfigError(
                    f"option {f.name} must be one of {', '.join(spec.choices)}, got {value!r}")
            if spec.lo is not None and not (spec.lo <= value <= spec.hi):
                raise ConfigError(
                    f"option {f.name} must be in [{spec.lo:g}, {spec.hi:g}], got {value!r}")
        from .tracing import check_mode

        try:
            check_mode(self.tracing)
        except ValueError as e:
            raise ConfigError(f"option tracing: {e}") from None
        if not self.namespace:
            raise ConfigError("option namespace must not be empty")

    @property
    def hedging_enabled(self) -> bool:
        return self.hedge_delay_s > 0 or self.hedge_quantile > 0

    def replace(self, **changes: Any) -> ChangelogConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ChangelogConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(unknown)}")
        return cls(**dict(values))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ChangelogConfig:
        """Defaults, then ``DSTL_*`` environment variables, then ``overrides``."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(env_var(f.name))
            if raw is None:
                continue
            kind = type(f.default)
            try:
                values[f.name] = kind(raw) if kind is not int else int(raw, 0)
            except ValueError:
                raise ConfigError(
                    f"option {f.name} (from {env_var(f.name)}) must be {kind.__name__}, "
                    f"got {raw!r}") from None
        values.update(overrides)
        return cls(**values)

    @classmethod
    def describe(cls) -> list[tuple[str, str, Any, str]]:
        """(option, environment variable, default, doc) for every option."""
        return [(f.name, env_var(f.name), f.default, f.metadata["spec"].doc)
                for f in dataclasses.fields(cls)]


def env_var(option: str) -> str:
    return "DSTL_" + option.upper()
