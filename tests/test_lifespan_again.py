"""A host that runs the app's lifespan again after a shutdown: Starlette's TestClient runs it
once per `with TestClient(app)` block, and a test suite's fixtures open one per test over
the same app (and so the same Gateway, which Starlette builds once). Each startup after a
shutdown must give a gateway that works as after the first."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from fallback_mw import Gateway
from fallback_mw.cli import main


@contextmanager
def recording_upstream() -> Iterator[tuple[str, list[str]]]:
    """A 200 upstream on its own thread (the TestClient runs the app on a loop of its own),
    recording each request's path."""
    paths: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            paths.append(self.path)
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", paths
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def until(check: Any, limit: float = 10.0) -> bool:
    deadline = time.monotonic() + limit
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_lifespan_after_a_shutdown_reloads_the_store_and_shadows_again(tmp_path: Path) -> None:
    """The second `with TestClient(app)` over one app: its requests were served, but the
    route store's reloader and the shadow copies had closed with the first lifespan's
    shutdown and never started again (a route added to the store, or a fault set, was
    never seen; every copy was refused as overloaded) for the rest of the process."""
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    with recording_upstream() as (url, paths):
        config = {
            "gateway": {"store": store},
            "upstreams": {"primary": {"url": url}, "candidate": {"url": url + "/shadow"}},
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["primary"], "shadow": "candidate",
                 "shadow_percent": 100.0},
            ],
        }  # fmt: skip
        app = Starlette()
        app.add_middleware(Gateway, config=config)
        for session in ("first", "second"):
            with TestClient(app) as client:
                response = client.get("/v1/chat", headers={"x-session-id": session})
                assert response.status_code == 200, session
                assert until(lambda: len(paths) == 2), f"{session} lifespan: {paths}"
                paths.clear()
        with TestClient(app) as client:
            out, err = io.StringIO(), io.StringIO()
            status = main(
                ["routes", "add", "--store", store, "--id", "new", "--prefix", "/v2/",
                 "--upstream", url],
                stdout=out, stderr=err,
            )  # fmt: skip
            assert status == 0, err.getvalue()
            # The reloader polls a SQLite store each second.
            assert until(lambda: client.get("/v2/x").headers.get("x-gateway-route") == "new")
