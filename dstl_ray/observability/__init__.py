"""Metrics, OpenTelemetry tracing and the trace viewer."""
