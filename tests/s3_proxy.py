"""A real S3 endpoint for tests and benchmarks: moto's server on 127.0.0.1, optionally behind
a small HTTP proxy that adds latency to every request, fails a share of them (500,
503 SlowDown, or a reset connection) as a flaky object store does, or throttles like a busy
one (503 SlowDown for requests beyond a number in flight), and counts requests by kind."""

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


def request_kind(method: str, path: str) -> str:
    """What an S3 request does: ``list`` (objects or multipart uploads), ``get``, ``put``, ..."""
    query = path.partition("?")[2]
    if method == "GET" and ("list-type=" in query or "uploads" in query.split("&")
                            or (path.count("/") <= 1 and "prefix=" in query)):
        return "list"
    return {"GET": "get", "HEAD": "head", "PUT": "put", "POST": "post", "DELETE": "delete"}.get(method, method)


class FaultyProxy:
    """Forwards HTTP requests to ``upstream``; each request first waits ``latency_s`` plus
    up to ``jitter_s`` (uniform), then fails with probability ``fail_rate`` (one of
    ``fail_kinds``) when its method and path match ``match``. With ``max_inflight``, a
    request arriving while that many are being served is answered 503 SlowDown (a store
    throttling past its capacity). With ``conn_mbps``, each request's body and answer move
    at that many MB/s (one connection's share of a store's bandwidth, as S3 serves each
    connection at tens of MB/s). ``drop_headers`` (lower case) are removed from every request
    (``("if-match",)``: a store without conditional writes, to a client that does not sign
    them). ``counts`` holds the requests received, by kind."""

    def __init__(self, upstream: str, *, latency_s: float = 0.0, jitter_s: float = 0.0, fail_rate: float = 0.0,
                 match: str = ".*", seed: int = 0, fail_kinds: tuple[Any, ...] = (500, 503, "reset"),
                 max_inflight: int = 0, conn_mbps: float = 0.0, drop_headers: tuple[str, ...] = ()) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.latency_s = latency_s
        self.jitter_s = jitter_s
        self.fail_rate = fail_rate
        self.match = match
        self.fail_kinds = fail_kinds
        self.max_inflight = max_inflight
        self.conn_mbps = conn_mbps
        self.drop_headers = drop_headers
        self.rng = random.Random(seed)
        self.mu = threading.Lock()  # guards the counters and rng
        self.requests = 0
        self.failed = 0
        self.throttled = 0
        self.inflight = 0
        self.counts: dict[str, int] = {}
        self.journal: list[tuple[float, str]] = []  # (time.time() at arrival, kind), every request
        self.gets: list[tuple[str, str | None]] = []  # (path, Range header) of every GET
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
                admitted = False
                with proxy.mu:
                    proxy.requests += 1
                    what = request_kind(self.command, self.path)
                    proxy.counts[what] = proxy.counts.get(what, 0) + 1
                    proxy.journal.append((time.time(), what))
                    if self.command == "GET":
                        proxy.gets.append((self.path, self.headers.get("Range")))
                    fault = (re.search(proxy.match, f"{self.command} {self.path}") is not None
                             and proxy.rng.random() < proxy.fail_rate)
                    kind = proxy.rng.choice(list(proxy.fail_kinds)) if fault else None
                    proxy.failed += bool(fault)
                    if kind is None and proxy.max_inflight and proxy.inflight >= proxy.max_inflight:
                        kind = 503  # over capacity: the store asks to slow down
                        proxy.throttled += 1
                    elif kind is None:
                        proxy.inflight += 1
                        admitted = True
                    extra = proxy.rng.uniform(0, proxy.jitter_s) if proxy.jitter_s else 0.0
                try:
                    if proxy.latency_s or extra:
                        time.sleep(proxy.latency_s + extra)
                    if kind is None:
                        self._upstream(body)
                        return
                finally:
                    if admitted:
                        with proxy.mu:
                            proxy.inflight -= 1
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

            def _upstream(self, body: bytes) -> None:
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("transfer-encoding", "connection", "expect", *proxy.drop_headers)}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                if proxy.conn_mbps:
                    time.sleep((len(body) + len(data)) / (proxy.conn_mbps * 1e6))
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # a HEAD answer carries the object's length, without the body
                length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
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

    def count(self, kind: str) -> int:
        with self.mu:
            return self.counts.get(kind, 0)

    def reset_counts(self) -> None:
        with self.mu:
            self.counts.clear()
            self.gets.clear()
            self.journal.clear()
            self.requests = self.failed = self.throttled = 0

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
