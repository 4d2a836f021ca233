"""OpenTelemetry tracing of the upload path (docs/architecture.md "Observability").

One trace per persist request: ``dstl.writer.persist`` -> ``dstl.node`` at every level the
request passes (receive, batch wait, forward or flush) -> ``dstl.dfs.put`` -> one
``dstl.dfs.attempt`` per attempt (retries, hedges). The context crosses Ray actor calls
explicitly: each ``PersistRequest`` carries a W3C ``traceparent`` that every node replaces with
its own span's before forwarding.

Exporters, chosen by the ``tracing`` option (``DSTL_TRACING``): ``off`` (the default; costs one
boolean check per call), ``console``, ``otlp`` (configured by the standard ``OTEL_*``
variables), ``memory`` (per process, for tests; node
actors return theirs through ``spans()``), and ``file:<dir>`` (JSON lines per process, read by
``dstl-ray trace``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

TRACE_MODES = ("off", "console", "otlp", "memory", "file")

_lock = threading.Lock()
_mode = "off"
_tracer: Any = None
_memory: Any = None
_propagator: Any = None
_provider: Any = None


def check_mode(mode: str) -> str:
    kind = mode.split(":", 1)[0]
    if kind not in TRACE_MODES or (kind == "file") != (":" in mode):
        raise ValueError(f"tracing must be one of off, console, otlp, memory, file:<dir>, "
                         f"got {mode!r}")
    return mode


class _JsonLinesExporter:
    """Writes finished spans as JSON lines to ``{dir}/spans-{pid}.jsonl``."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self._path = os.path.join(directory, f"spans-{os.getpid()}.jsonl")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = [json.dumps(span_to_dict(s)) + "\n" for s in spans]
        with self._lock, open(self._path, "a") as f:
            f.writelines(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def configure(mode: str, service: str = "dstl-ray") -> None:
    """Set this process's tracing mode (idempotent for the same mode)."""
    global _mode, _tracer, _memory, _propagator, _provider
    check_mode(mode)
    with _lock:
        if mode == _mode and (_tracer is not None or mode == "off"):
            return
        _mode = mode
        if mode == "off":
            _tracer = None
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        if mode == "memory":
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
                InMemorySpanExporter,
            )

            _memory = InMemorySpanExporter()
            provider.add_span_processor(SimpleSpanProcessor(_memory))
        elif mode == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        elif mode == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,  # endpoint, headers, ... from the standard OTEL_* variables
            )

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            provider.add_span_processor(SimpleSpanProcessor(
                _JsonLinesExporter(mode.split(":", 1)[1])))
        _provider = provider
        _tracer = provider.get_tracer("dstl_ray")
        _propagator = TraceContextTextMapPropagator()


def flush(timeout_s: float = 10.0) -> bool:
    """Export every finished span now (e.g. before a process exits)."""
    return bool(_provider.force_flush(int(timeout_s * 1000))) if _provider is not None else True


def enabled() -> bool:
    return _tracer is not None


@contextmanager
def span(name: str, parent: Mapping[str, str] | None = None, links: Sequence[Any] = (),
         **attributes: Any) -> Iterator[Any]:
    """A span named ``name`` (child of the ``parent`` carrier, if given); ``None`` when off."""
    if _tracer is None:
        yield None
        return
    ctx = _propagator.extract(dict(parent)) if parent else None
    with _tracer.start_as_current_span(name, context=ctx, links=list(links),
                                       attributes=_clean(attributes)) as s:
        yield s


def start_span(name: str, parent: Mapping[str, str] | None = None, **attributes: Any) -> Any:
    """A span the caller ends itself (``end_span``), e.g. across a future; ``None`` when off."""
    if _tracer is None:
        return None
    ctx = _propagator.extract(dict(parent)) if parent else None
    return _tracer.start_span(name, context=ctx, attributes=_clean(attributes))


def end_span(s: Any, error: BaseException | None = None, **attributes: Any) -> None:
    if s is None:
        return
    for k, v in _clean(attributes).items():
        s.set_attribute(k, v)
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        s.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    s.end()


def carrier(s: Any = None) -> dict[str, str]:
    """W3C trace context of span ``s`` (or the current span) to send with a request."""
    if _tracer is None:
        return {}
    from opentelemetry import trace

    out: dict[str, str] = {}
    ctx = trace.set_span_in_context(s) if s is not None else None
    _propagator.inject(out, context=ctx)
    return out


def link_to(parent: Mapping[str, str]) -> Any:
    """A span link to the request whose carrier is ``parent`` (for shared batch work)."""
    from opentelemetry import trace

    sc = trace.get_current_span(_propagator.extract(dict(parent))).get_span_context()
    return trace.Link(sc)


def _clean(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {f"dstl.{k}": v for k, v in attrs.items() if v is not None}


def span_to_dict(s: Any) -> dict[str, Any]:
    ctx = s.get_span_context()
    return {
        "name": s.name, "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{s.parent.span_id:016x}" if s.parent is not None else None,
        "start_ns": s.start_time, "end_ns": s.end_time,
        "attributes": dict(s.attributes or {}),
        "links": [f"{lk.context.span_id:016x}" for lk in (s.links or ())],
        "status": s.status.status_code.name,
    }


def finished_spans(clear: bool = False) -> list[dict[str, Any]]:
    """Spans finished in this process (``memory`` mode only)."""
    if _memory is None:
        return []
    out = [span_to_dict(s) for s in _memory.get_finished_spans()]
    if clear:
        _memory.clear()
    return out
