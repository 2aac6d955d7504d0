"""A misbehaving S3 endpoint for tests: a real HTTP proxy on 127.0.0.1 in front of a real S3 API.

Test double, not a store: it forwards every request unchanged to an upstream S3 server (moto
in this repository's tests) and can misbehave the way S3-compatible stores do:

- ``ignore_conditional=True``: strips If-None-Match / If-Match, like stores that do not
  implement conditional puts (every "first writer wins" decision then silently has two
  winners; `diloco.store.objectstore.verify_store` must refuse such a store);
- ``error_rate=p``: answers a fraction p of requests with S3's own throttling and server
  errors (503 SlowDown, 500 InternalError) instead of forwarding them, as S3 does under load;
  clients are expected to retry (obstore does, with backoff);
- ``go_down(refuse_s, unavailable_s)``: a store outage, as a region's or a MinIO node's: for
  `refuse_s` nothing listens on the port (new connections are refused, open ones are dropped
  without an answer), then for `unavailable_s` every request is answered 503 Service
  Unavailable, then the store is back (`outage_done` is set).

Counts of forwarded and failed requests are kept for assertions. Stdlib only.
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

_ERRORS = [(503, "SlowDown", "Please reduce your request rate."),
           (500, "InternalError", "We encountered an internal error. Please try again.")]
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "trailer"}


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client killed mid-request (the fault tests do that) resets its connection: not news."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class FaultyS3Proxy:
    def __init__(self, upstream: str, *, ignore_conditional: bool = False, error_rate: float = 0.0,
                 seed: int = 0):
        up = urlparse(upstream)
        self.upstream_host, self.upstream_port = up.hostname, up.port or 80
        self.ignore_conditional = ignore_conditional
        self.error_rate = error_rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.forwarded = 0
        self.injected = 0
        self.state = "up"  # "refusing" and "unavailable" during an outage (`go_down`)
        self.dropped = 0       # requests dropped unanswered while refusing
        self.unavailable = 0   # requests answered 503 while unavailable
        self.outage_done = threading.Event()
        self.closed = False
        self.server = self._serve(0)
        self.port = self.server.server_address[1]

    def _serve(self, port: int) -> _QuietServer:
        server = _QuietServer(("127.0.0.1", port), self._handler())
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultyS3Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.closed = True  # an outage in progress does not bring the port back
        self.server.shutdown()
        self.server.server_close()

    def go_down(self, refuse_s: float, unavailable_s: float) -> None:
        """Start an outage now (it runs on a thread): refused for `refuse_s`, then 503s for
        `unavailable_s`, then back on the same port."""
        def outage() -> None:
            with self.lock:
                self.state = "refusing"
            self.server.shutdown()
            self.server.server_close()  # nothing listens: connecting is refused
            time.sleep(refuse_s)
            with self.lock:
                if self.closed:
                    return
                self.state = "unavailable"
                self.server = self._serve(self.port)
            time.sleep(unavailable_s)
            with self.lock:
                self.state = "up"
            self.outage_done.set()

        self.outage_done.clear()
        threading.Thread(target=outage, daemon=True).start()

    def _fail_now(self) -> bool:
        with self.lock:
            fail = self.error_rate > 0 and self.rng.random() < self.error_rate
            if fail:
                self.injected += 1
            else:
                self.forwarded += 1
            return fail

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _forward(self) -> None:
                body = self._body()
                with proxy.lock:
                    state = proxy.state
                    proxy.dropped += state == "refusing"
                    proxy.unavailable += state == "unavailable"
                if state == "refusing":  # an open connection to a store that went away: no answer
                    self.close_connection = True
                    return
                if state == "unavailable":
                    status, code, message = 503, "ServiceUnavailable", "Service is unable to handle request."
                elif proxy._fail_now():
                    status, code, message = proxy.rng.choice(_ERRORS)
                else:
                    status = 0
                if status:
                    payload = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                               f"<Message>{message}</Message></Error>").encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                if proxy.ignore_conditional:
                    headers = {k: v for k, v in headers.items() if k.lower() not in ("if-none-match", "if-match")}
                conn = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler
