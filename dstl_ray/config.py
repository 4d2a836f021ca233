"""The one typed configuration object of dstl-ray.

Defaults follow Flink's DSTL (``state.changelog.dstl.dfs.*``) where it has the option; the
tree's own options (branching, flush size, routing horizon) and hedging are ours. Every option
can also be set through an environment variable ``DSTL_<OPTION_NAME_UPPER>``; a bad value fails
at start with a :class:`~dstl_ray.errors.ConfigError` that names the option and its range.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

KiB = 1024
MiB = 1024 * 1024

COMPRESSIONS = ("none", "zstd")
MERGING_MODES = ("none", "within_checkpoint", "across_checkpoints")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

# Options whose values an extension outside the runtime interprets (``fault_spec``:
# dstl_ray.testing.faults), with the check it registered when imported: a bad value then fails
# at construction in every process that loaded the extension. The runtime never imports one.
_OPTION_CHECKS: dict[str, Callable[[str], object]] = {}


def register_option_check(option: str, check: Callable[[str], object]) -> None:
    """``check(value)`` raises :class:`ConfigError` for a bad non-empty value of ``option``;
    config objects built from now on in this process run it."""
    if option not in {f.name for f in dataclasses.fields(ChangelogConfig)}:
        raise ValueError(f"no option {option!r}")
    _OPTION_CHECKS[option] = check


@dataclass(frozen=True)
class _Spec:
    doc: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] | None = None
    secret: bool = False


def _opt(default: Any, doc: str, lo: float | None = None, hi: float | None = None,
         choices: tuple[str, ...] | None = None, secret: bool = False) -> Any:
    return field(default=default, metadata={"spec": _Spec(doc, lo, hi, choices, secret)},
                 repr=not secret)


REDACTED = "***"
_SECRET_WORDS = ("key", "secret", "token", "password", "credential", "session")


def redact_options(options: Any) -> Any:
    """``options`` (nested dicts/lists) with the values of secret-looking keys replaced."""
    if isinstance(options, Mapping):
        return {k: (REDACTED if isinstance(k, str) and v
                    and any(w in k.lower() for w in _SECRET_WORDS)
                    and not isinstance(v, (Mapping, list, bool))
                    else redact_options(v)) for k, v in options.items()}
    if isinstance(options, list):
        return [redact_options(v) for v in options]
    return options


def parse_json_object(option: str, text: str) -> dict[str, Any]:
    """The JSON object in option ``option`` ({} when empty); ConfigError otherwise."""
    import json

    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"option {option} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"option {option} must be a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True, repr=False)
class ChangelogConfig:
    """Configuration of a changelog tree and its writers (see README "Configuration")."""

    persist_delay_s: float = _opt(
        0.010, "Wait after the first pending persist request before sending a batch "
        "(Flink: persist-delay 10 ms).", 0.0, 60.0)
    persist_size_threshold: int = _opt(
        10 * MiB, "Send a batch at once when a node buffers this many bytes "
        "(Flink: persist-size-threshold 10 MiB).", 1, 1 << 40)
    persist_max_wait_s: float = _opt(
        0.5, "When the persist delay ends while a source that took part in the job's previous "
        "checkpoint has not sent its request for this one, wait for it up to this long after "
        "the batch's first request, so one checkpoint stays one file (a checkpoint cannot "
        "complete before its slowest request anyway; 0: never wait past the delay).",
        0.0, 600.0)
    source_idle_s: float = _opt(
        5.0, "A source (writer or child node) that sent nothing for this long (and for at "
        "least 4 batching delays) stops counting for the \"every source is pending\" trigger "
        "until its next request: a killed writer process never unregisters (0: never).",
        0.0, 86400.0)
    dead_writer_check_s: float = _opt(
        30.0, "With file_merging=across_checkpoints: how often a node actor asks Ray whether "
        "the driver processes (drivers, Spark Python workers) of its writers are alive; a "
        "dead one's sections in merged changelog files are released up to the newest "
        "checkpoint of its job any node saw, and its writers wait for their marks to be "
        "taken (0: off; a killed writer's merged files then stay until the job's next "
        "recovery).", 0.0, 86400.0)
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
    persist_timeout_s: float = _opt(
        0.0, "A writer's persist request whose node actor has not answered after this long "
        "fails (PersistError) and its changes go again with the writer's next request; a "
        "late answer's files are released (0: derived, 2 x (max_attempts x (upload_timeout_s "
        "+ retry_delay_s) + 30 s): a node gives its parent that long, then flushes itself).",
        0.0, 86400.0)
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
        0.0, "Hedge uploads slower than this quantile of recent attempt latencies (0: off; "
        "until hedge_min_samples latencies are known, hedge_delay_s applies if set).",
        0.0, 0.9999)
    hedge_window: int = _opt(
        1000, "How many recent successful attempt latencies the hedge quantile is taken "
        "over.", 10, 1_000_000)
    hedge_min_samples: int = _opt(
        20, "Latencies needed before the hedge quantile is trusted.", 1, 1_000_000)
    s3_endpoint_url: str = _opt(
        "", "S3 endpoint URL for s3:// base paths (empty: DSTL_S3_ENDPOINT_URL, "
        "AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, else AWS).")
    s3_access_key_id: str = _opt(
        "", "S3 access key id (empty: the standard AWS variables / credential chain). "
        "Secret: never shown in repr, to_dict, status or logs.", secret=True)
    s3_secret_access_key: str = _opt(
        "", "S3 secret access key (empty: the standard AWS variables / credential chain). "
        "Secret: never shown in repr, to_dict, status or logs.", secret=True)
    s3_multipart_threshold: int = _opt(
        16 * MiB, "Files of at least this size go to S3 as a multipart upload (parts of "
        "half this size, at least 5 MiB, S3's minimum).", 10 * MiB, 5 << 30)
    storage_options: str = _opt(
        "", "Extra fsspec file system options as a JSON object, e.g. "
        '{"client_kwargs": {"region_name": "eu-west-1"}}; values of keys naming secrets '
        "(key, secret, token, password, ...) are never shown.")
    fault_spec: str = _opt(
        "", "Fault and latency injection for tests and experiments (dstl_ray.testing.faults): a "
        "JSON object; empty: none. Processes that write need the module that handles it: "
        "import dstl_ray.testing, or name it in plugins.")
    plugins: str = _opt(
        "", "Modules (comma-separated) that every dstl-ray process imports before it builds "
        "a storage from this config, e.g. node actors: extensions that register themselves, "
        "such as dstl_ray.testing (the fault injection behind fault_spec).")
    membership_interval_s: float = _opt(
        2.0, "How often the root checks Ray's node list: joined nodes get a node actor and "
        "attach as leaves, a removed node's children re-attach (0: never).", 0.0, 3600.0)
    tracing: str = _opt(
        "off", "OpenTelemetry tracing of upload paths: off, console, otlp (OTEL_* variables), "
        "memory (tests) or file:<dir> (JSON lines for dstl-ray trace).")
    file_merging: str = _opt(
        "none", "File merging of materialized state (FLIP-306): none, within_checkpoint "
        "(state.checkpoints.file-merging.enabled) or across_checkpoints (also "
        "...across-checkpoint-boundary; file:// only).", choices=MERGING_MODES)
    file_merging_max_file_size: int = _opt(
        32 * MiB, "A physical file takes no more segments once it holds this many bytes "
        "(FLIP-306 max-file-size).", 1, 1 << 40)
    file_merging_max_file_pool_size: int = _opt(
        4, "Physical files a subtask may have open for concurrent writers (FLIP-306 "
        "max-file-pool-size).", 1, 1024)
    file_merging_max_space_amplification: float = _opt(
        2.0, "A physical file whose size exceeds this multiple of its live bytes is "
        "compacted (FLIP-306 max-space-amplification; >= 1).", 1.0, 1e6)
    local_lane: str = _opt(
        "on", "Writers on the node actor's machine send persist requests and marks over a "
        "Unix socket instead of Ray actor calls (on: about 5 ms less per checkpoint here; "
        "off: Ray calls only).", choices=("on", "off"))
    host_lane: str = _opt(
        "on", "With local_lane on, a node actor sends a child's batches and marks to a parent "
        "on another host over TCP to the parent's Ray IP, with the local lane's frames and "
        "token (on: 0.13 ms per call between hosts here, 0.35 ms for 256 KiB, against 1.1 "
        "and 4.8 ms by Ray; off: Ray calls between hosts).", choices=("on", "off"))
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
        from .observability.tracing import check_mode

        try:
            check_mode(self.tracing)
        except ValueError as e:
            raise ConfigError(f"option tracing: {e}") from None
        if not self.namespace:
            raise ConfigError("option namespace must not be empty")
        parse_json_object("storage_options", self.storage_options)
        parse_json_object("fault_spec", self.fault_spec)
        self.plugin_modules()
        for option, check in list(_OPTION_CHECKS.items()):
            if getattr(self, option):
                check(getattr(self, option))  # raises ConfigError naming the option

    def plugin_modules(self) -> list[str]:
        """The module names of option ``plugins``, checked."""
        names = [m.strip() for m in self.plugins.split(",") if m.strip()]
        for m in names:
            if not _MODULE.match(m):
                raise ConfigError(f"option plugins: {m!r} is not a module name")
        return names

    def load_plugins(self) -> None:
        """Import the modules of option ``plugins`` (once per process: Python caches them)."""
        for m in self.plugin_modules():
            try:
                importlib.import_module(m)
            except ImportError as e:
                raise ConfigError(f"option plugins: cannot import {m}: {e}") from None

    def __repr__(self) -> str:
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata["spec"].secret:
                value = REDACTED if value else ""
            elif f.name == "storage_options" and value:
                import json

                value = json.dumps(redact_options(parse_json_object(f.name, value)))
            parts.append(f"{f.name}={value!r}")
        return f"ChangelogConfig({', '.join(parts)})"

    __str__ = __repr__

    @property
    def upload_deadline_s(self) -> float:
        """How long one DFS upload may take with all its tries: max_attempts x
        (upload_timeout_s + retry_delay_s). Queueing for an upload thread counts against it,
        not against an attempt's own timeout (see :mod:`dstl_ray.upload.uploader`)."""
        return self.max_attempts * (self.upload_timeout_s + self.retry_delay_s)

    @property
    def effective_persist_timeout_s(self) -> float:
        """``persist_timeout_s``, or the value derived from the upload options when 0."""
        if self.persist_timeout_s > 0:
            return self.persist_timeout_s
        return 2 * (self.upload_deadline_s + 30.0)

    @property
    def hedging_enabled(self) -> bool:
        return self.hedge_delay_s > 0 or self.hedge_quantile > 0

    def replace(self, **changes: Any) -> ChangelogConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self, secrets: bool = False) -> dict[str, Any]:
        """Every option; secrets (S3 keys, secret-looking storage_options) are left out unless
        ``secrets`` (this dict is shown by ``info``/``status`` and sent to clients)."""
        d = dataclasses.asdict(self)
        if not secrets:
            import json

            for f in dataclasses.fields(self):
                if f.metadata["spec"].secret:
                    d[f.name] = ""
            opts = parse_json_object("storage_options", self.storage_options)
            if opts:
                d["storage_options"] = json.dumps(_drop_secrets(opts))
        return d

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


def _drop_secrets(options: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in options.items():
        if isinstance(v, dict):
            out[k] = _drop_secrets(v)
        elif not (isinstance(k, str) and any(w in k.lower() for w in _SECRET_WORDS)
                  and not isinstance(v, (list, bool))):
            out[k] = v
    return out


def env_var(option: str) -> str:
    return "DSTL_" + option.upper()
