"""A real S3 endpoint for tests and benchmarks: moto's server on 127.0.0.1, optionally behind
a small HTTP proxy that adds latency to every request or fails a share of them (500,
503 SlowDown, or a reset connection), as a busy or flaky object store does."""

from __future__ import annotations

import http.client
import os
import random
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

os.environ.setdefault("S3_UPLOAD_PART_MIN_SIZE", "1024")  # tiny parts in tests (read by moto at import)
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

_ERRORS = {
    500: b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>",
    503: b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>",
}


def start_moto() -> tuple[Any, str]:
    """moto's S3 server on a free port of 127.0.0.1; returns (server, endpoint URL)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


class FaultyProxy:
    """Forwards HTTP requests to ``upstream``; each request first waits ``latency_s`` plus
    up to ``jitter_s`` (uniform), then fails with probability ``fail_rate`` when its method
    and path match ``match``."""

    def __init__(self, upstream: str, *, latency_s: float = 0.0, jitter_s: float = 0.0, fail_rate: float = 0.0,
                 match: str = ".*", seed: int = 0) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.latency_s = latency_s
        self.jitter_s = jitter_s
        self.fail_rate = fail_rate
        self.match = match
        self.rng = random.Random(seed)
        self.mu = threading.Lock()
        self.requests = 0
        self.failed = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                try:
                    self._forward()
                except (BrokenPipeError, ConnectionResetError):  # the client gave up on us
                    self.close_connection = True

            def _forward(self) -> None:
                body = self._body()
                if proxy.latency_s or proxy.jitter_s:
                    with proxy.mu:
                        extra = proxy.rng.uniform(0, proxy.jitter_s)
                    time.sleep(proxy.latency_s + extra)
                with proxy.mu:
                    proxy.requests += 1
                    fault = (re.search(proxy.match, f"{self.command} {self.path}") is not None
                             and proxy.rng.random() < proxy.fail_rate)
                    kind = proxy.rng.choice([500, 503, "reset"]) if fault else None
                    proxy.failed += bool(fault)
                if kind == "reset":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if kind is not None:
                    payload = _ERRORS[int(kind)]
                    self.send_response(int(kind))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":  # a HEAD answer has no body on the wire
                        self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("transfer-encoding", "connection", "expect")}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
