"""The `/metrics` endpoint of `OTEL_METRICS_EXPORTER=prometheus`: prometheus_client's WSGI
app, on a server of its own that bounds what its clients may hold.

prometheus_client's `start_http_server` gives every connection a thread of its own, for as
long as the client keeps it open, with no time limit: idle connections (a slowloris, a
scanner, a misconfigured scraper's pool) each held a thread and a file descriptor of the
gateway's process, until the process ran out of descriptors and the gateway's own port
accepted nothing more; each head could hold 100 lines of 64 KiB; and a client that reset
its connection part-way wrote a 25-line traceback to serve's log. Here:

- at most `CONNECTIONS` connections are served at once; one more takes the place of the
  oldest that has not sent its request head yet (a scrape sends its head at once: idle
  clients, a port scanner or a stuck health check, held every place and each scrape was
  closed unanswered until they timed out), else first cuts those open longer than
  `CONNECTION_SECONDS` (their threads end), and is closed at once if none is; one cut
  before its head was read is not served (its head ends where its input does, and each
  such was rendered for nobody, outside the bound);
- each read waits at most `CONNECTION_SECONDS`, and a request head is read up to
  `HEAD_BYTES` (a longer one is answered 431);
- a connection's failure (a reset, a timeout) ends it without a word in the log;
- HEAD is answered as GET is, without the body (prometheus_client answered it 405, and a
  health checker or load balancer that checks with HEAD counted the target down);
- the metrics text is made for one request at a time, at most one every `RENDER_GAP`
  seconds: each takes the gateway's interpreter for milliseconds (more with a large route
  table), and four clients scraping in a loop took the request path's p99 latency from
  17 to 109 ms. Prometheus, which scrapes every few seconds, never waits for it.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

CONNECTIONS = 16
CONNECTION_SECONDS = 10.0
HEAD_BYTES = 32 * 1024
RENDER_GAP = 0.1


class _HeadLimit:
    """A connection's input whose lines, together, stop at HEAD_BYTES (a scrape's head is
    a few hundred bytes; the body, which the endpoint never reads, is not asked for): a
    head that goes on is answered 431."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._left = HEAD_BYTES

    def readline(self, size: int = -1) -> bytes:
        if self._left <= 0:  # answered 431, as a line over http.client's own limit is
            raise http.client.LineTooLong(f"request head over {HEAD_BYTES} bytes")
        line: bytes = self._stream.readline(self._left if size < 0 else min(size, self._left))
        self._left -= len(line)
        return line

    def read(self, size: int = -1) -> bytes:
        data: bytes = self._stream.read(size)
        return data

    def close(self) -> None:
        self._stream.close()  # the socket closes only once its files are


class _Paced:
    """A WSGI app called for one request at a time, at most once every RENDER_GAP s."""

    def __init__(self, wsgi: Any) -> None:  # a WSGI app, not an ASGI layer
        self._wsgi = wsgi
        self._lock = threading.Lock()
        self._last = -RENDER_GAP

    def __call__(self, environ: Any, start_response: Any) -> Any:
        if environ.get("REQUEST_METHOD") == "HEAD":  # prometheus_client answers HEAD 405
            return self._head({**environ, "REQUEST_METHOD": "GET"}, start_response)
        return self._paced(environ, start_response)

    def _paced(self, environ: Any, start_response: Any) -> Any:
        with self._lock:  # those waiting hold a connection, not the interpreter
            wait = self._last + RENDER_GAP - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._last = time.monotonic()
            return self._wsgi(environ, start_response)

    def _head(self, environ: Any, start_response: Any) -> list[bytes]:
        """GET's status and headers, no body; its Content-Length the body's (RFC 9110, 8.6:
        wsgiref said 0 for an answer without one)."""
        started: list[tuple[Any, list[tuple[str, str]], Any]] = []

        def start(status: Any, headers: Any, exc_info: Any = None) -> Any:
            started.append((status, list(headers), exc_info))
            return lambda data: None  # a write() the body is not sent with

        body = self._paced(environ, start)
        try:
            size = sum(len(chunk) for chunk in body)
        finally:
            if hasattr(body, "close"):
                body.close()
        status, headers, exc_info = started[-1]
        if not any(name.lower() == "content-length" for name, _ in headers):
            headers.append(("Content-Length", str(size)))
        start_response(status, headers, exc_info)
        return []


class _Handler(WSGIRequestHandler):
    timeout = CONNECTION_SECONDS  # each read and write of the connection
    server: MetricsServer

    def setup(self) -> None:
        super().setup()
        self.rfile = _HeadLimit(self.rfile)  # type: ignore[assignment]

    def parse_request(self) -> bool:
        # Held: no longer given way to a newcomer. Cut before (its head ended where its
        # input did, at the cut): closed unserved, not rendered outside the bound.
        return super().parse_request() and self.server.head_read(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        """Nothing: a scrape is not a log line."""


class MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Each connection served: when it opened, and whether its head has been read.
        self._open: dict[socket.socket, tuple[float, bool]] = {}
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def head_read(self, request: socket.socket) -> bool:
        """Marks `request`'s head read; whether it is still served (not cut for room)."""
        with self._open_lock:
            if request not in self._open:
                return False
            self._open[request] = (self._open[request][0], True)
            return True

    def process_request(self, request: Any, client_address: Any) -> None:
        now = time.monotonic()
        with self._open_lock:
            if len(self._open) >= CONNECTIONS:
                self._make_room(now)
            held = len(self._open)
            if held < CONNECTIONS:
                self._open[request] = (now, False)
        if held >= CONNECTIONS:
            self.shutdown_request(request)  # closed at once: no thread
            return
        super().process_request(request, client_address)

    def _make_room(self, now: float) -> None:
        """Cuts the oldest connection whose head has not come, else those open longer than
        CONNECTION_SECONDS (under `_open_lock`): no longer counted, their threads end and
        close them."""
        waiting = [sock for sock, (_, head) in self._open.items() if not head]
        cut = waiting[:1] or [
            sock for sock, (opened, _) in self._open.items() if now - opened > CONNECTION_SECONDS
        ]
        for sock in cut:
            del self._open[sock]
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.pop(request, None)
        super().close_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Nothing: a client's reset or timeout is the client's (socketserver printed a
        traceback for each)."""


def start_metrics_server(host: str, port: int, registry: Any) -> MetricsServer:
    """`/metrics` from `registry` on `host`:`port`, served from a daemon thread; raises
    OSError when the address cannot be bound."""
    from prometheus_client import make_wsgi_app

    family, _, _, _, sockaddr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class _Server(MetricsServer):
        address_family = family

    server = _Server((sockaddr[0], port), _Handler)
    server.set_app(_Paced(make_wsgi_app(registry)))
    threading.Thread(target=server.serve_forever, name="fallback-mw /metrics", daemon=True).start()
    return server


__all__ = ["CONNECTIONS", "CONNECTION_SECONDS", "HEAD_BYTES", "RENDER_GAP", "start_metrics_server"]
