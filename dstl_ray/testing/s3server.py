"""A real S3 server on loopback for tests and experiments: moto's ``ThreadedMotoServer`` on
127.0.0.1 and a free port, with a bucket created through boto3 (s3fs's mkdir sends a location
constraint that the server refuses for us-east-1). Needs ``moto[server]`` (a test dependency).

>>> with LoopbackS3() as s3:                      # doctest: +SKIP
...     cfg = ChangelogConfig(**s3.config_options())
...     tree = dstl_ray.deploy(s3.url("dstl"), cfg)
"""

from __future__ import annotations

import socket
import uuid
from typing import Any

# moto accepts any credentials; these are fake and only ever talk to the loopback server
TEST_KEY = "testing-key"
TEST_SECRET = "testing-secret"
REGION = "us-east-1"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LoopbackS3:
    """``process=False``: moto's ThreadedMotoServer in this process (tests). ``process=True``:
    the same server in a child process (``python -m moto.server``), so that its request
    handling does not share this process's GIL with the clients being measured."""

    def __init__(self, bucket: str | None = None, process: bool = False,
                 host: str = "127.0.0.1") -> None:
        self.bucket = bucket or f"dstl-{uuid.uuid4().hex[:8]}"
        self.host = host  # another local address: hosts of a HostCluster reach its bridge's
        self.port = 0
        self.process = process
        self._server: Any = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> LoopbackS3:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.port = free_port(self.host)
        if self.process:
            import subprocess
            import sys
            import time

            self._server = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection((self.host, self.port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or self._server.poll() is not None:
                        self.stop()
                        raise RuntimeError("moto server did not start") from None
                    time.sleep(0.1)
        else:
            self._server = ThreadedMotoServer(ip_address=self.host, port=self.port,
                                              verbose=False)
            self._server.start()
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def stop(self) -> None:
        if self._server is not None:
            if self.process:
                self._server.terminate()
                self._server.wait(timeout=10)
            else:
                self._server.stop()
            self._server = None

    def __enter__(self) -> LoopbackS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=REGION,
                            aws_access_key_id=TEST_KEY, aws_secret_access_key=TEST_SECRET)

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])

    def config_options(self) -> dict[str, str]:
        """ChangelogConfig options that reach this server from any process (node actors)."""
        return {"s3_endpoint_url": self.endpoint_url, "s3_access_key_id": TEST_KEY,
                "s3_secret_access_key": TEST_SECRET}

    def env(self) -> dict[str, str]:
        """The standard AWS variables for this server (for the current process's readers)."""
        return {"AWS_ENDPOINT_URL_S3": self.endpoint_url, "AWS_ACCESS_KEY_ID": TEST_KEY,
                "AWS_SECRET_ACCESS_KEY": TEST_SECRET, "AWS_REGION": REGION}

    def keys(self, prefix: str = "") -> list[str]:
        out: list[str] = []
        pages = self.client().get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix)
        for page in pages:
            out.extend(o["Key"] for o in page.get("Contents", []))
        return sorted(out)
