"""tracing=otlp sends spans to an OTLP/HTTP endpoint configured by the standard OTEL_*
variables (a real HTTP server on loopback stands in for the collector)."""

from __future__ import annotations

import http.server
import threading
import uuid

from dstl_ray import ChangelogConfig, DirectTransport, KeyGroupRange, StateChangelogClient
from dstl_ray.observability import tracing


def test_otlp_exporter_posts_spans(monkeypatch):
    received: list[bytes] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                       f"http://127.0.0.1:{server.server_port}/v1/traces")
    try:
        t = DirectTransport("otlp", f"memory://o-{uuid.uuid4().hex}",
                            ChangelogConfig(tracing="otlp"))
        w = StateChangelogClient("otlp", transport=t).create_writer("op", KeyGroupRange(0, 0))
        w.append(0, b"x")
        w.persist_durably(0).result(timeout=10)
        assert tracing.flush(10)
        assert received and any(b"dstl.writer.persist" in body for body in received)
    finally:
        tracing.configure("off")
        server.shutdown()
