"""One Gateway called from one event loop after another, as Starlette's TestClient does
without `with` (the first example of FastAPI's testing docs): each request runs on a new
loop, the previous one closed, and no lifespan runs. Every routed request must still be
served, on both engines."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.testclient import TestClient

from fallback_mw import Gateway


class _Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the gateway pools the connection

    def do_GET(self) -> None:
        body = b"upstream"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return None


@pytest.fixture
def upstream_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # the closed loops' sockets
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
def test_a_test_client_without_lifespan_is_served_on_each_new_loop(
    engine: str, upstream_url: str
) -> None:
    conf = {
        "gateway": {"engine": engine},
        "upstreams": {"primary": {"url": upstream_url}},
        "routes": [{"id": "up", "prefix": "/v1/", "plan": ["primary"]}],
    }
    app = Starlette(middleware=[Middleware(Gateway, config=conf)])
    client = TestClient(app)  # no `with`: a new event loop for every request
    for _ in range(3):
        response = client.get("/v1/models")
        assert (response.status_code, response.text) == (200, "upstream")
        assert response.headers["x-gateway-provider"] == "primary"
    # The pooled connections of the closed loops can only be left to the garbage
    # collector: collected here, where their ResourceWarnings are expected.
    del client, app
    gc.collect()
