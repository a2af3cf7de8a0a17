"""One Gateway called from one event loop after another, as Starlette's TestClient does
without `with` (the first example of FastAPI's testing docs): each request runs on a new
loop, the previous one closed, and no lifespan runs. Every routed request must still be
served, on both engines."""

from __future__ import annotations

import asyncio
import gc
import threading
import uuid
import warnings
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.testclient import TestClient

from fallback_mw import Gateway
from tests.conftest import (
    PG_HOST,
    PG_PORT,
    PG_PREFIX,
    PG_USER,
    REDIS_DB,
    REDIS_HOST,
    REDIS_PORT,
    require_service,
)


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
    gateway = app.middleware_stack.app  # type: ignore[union-attr]  # Starlette built it
    assert isinstance(gateway, Gateway)
    asyncio.run(gateway.aclose())  # from yet another loop: the last one's pool is closed
    # The pooled connections of the closed loops can only be left to the garbage
    # collector: collected here, where their ResourceWarnings are expected.
    del client, app, gateway
    gc.collect()


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
def test_a_test_client_without_with_leaves_no_connection_to_the_garbage_collector(
    engine: str, upstream_url: str
) -> None:
    """FastAPI's first testing example, `TestClient(app)` without `with`, under a suite's
    `-W error`: each request's loop ended with the gateway's pooled upstream connections
    still open, and the garbage collector later warned about each socket (ResourceWarning,
    raised in whichever test happened to collect). The pool is now closed on its loop as
    that loop ends; nothing is left to close, not even with `aclose()` skipped."""
    conf = {
        "gateway": {"engine": engine},
        "upstreams": {"primary": {"url": upstream_url}},
        "routes": [{"id": "up", "prefix": "/v1/", "plan": ["primary"]}],
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        app = Starlette(middleware=[Middleware(Gateway, config=conf)])
        client = TestClient(app)  # no `with`: a new event loop for every request
        for _ in range(3):
            assert client.get("/v1/models").text == "upstream"
        del client, app
        gc.collect()
    left = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not left, left


@pytest.fixture
def shared_stores() -> Iterator[tuple[str, str]]:
    """A fresh PostgreSQL database (the ledger) and a Redis key prefix (the health state),
    made and removed without an event loop of the test's own."""
    require_service("PostgreSQL", PG_HOST, PG_PORT)
    require_service("Redis", REDIS_HOST, REDIS_PORT)
    import asyncpg
    import redis

    name = f"fmw_test_{uuid.uuid4().hex[:12]}"

    async def admin(statement: str) -> None:
        conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, database="postgres")
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    prefix = f"fmwtest:{uuid.uuid4().hex[:12]}:"
    try:
        yield (
            f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}",
            f"redis://{REDIS_HOST}:{REDIS_PORT}/14?prefix={prefix}",
        )
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=14)
        try:
            keys = list(client.scan_iter(match=prefix + "*"))
            if keys:
                client.delete(*keys)
        finally:
            client.close()


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # the closed loops' sockets
def test_the_postgres_ledger_and_redis_state_follow_a_new_loop(
    upstream_url: str, shared_stores: tuple[str, str]
) -> None:
    store, state = shared_stores
    conf = {
        "gateway": {"store": store, "state": state},
        "upstreams": {"primary": {"url": upstream_url}},
        "routes": [{"id": "up", "prefix": "/v1/", "plan": ["primary"], "budget": "b"}],
        "budgets": {"b": {"limit": 10.0, "default_hold": 0.01}},
    }
    gateway = Gateway(Starlette(), config=conf)
    client = TestClient(gateway)  # no `with`: a new event loop for every request
    for _ in range(3):
        response = client.get("/v1/models")
        assert (response.status_code, response.text) == (200, "upstream")
    asyncio.run(gateway.aclose())
    del client, gateway
    gc.collect()


@pytest.fixture
def configured_stores() -> Iterator[tuple[str, str]]:
    """As `shared_stores`, on the database prefix and Redis db the suite is configured with
    (FMW_TEST_PG_PREFIX, FMW_TEST_REDIS_DB)."""
    require_service("PostgreSQL", PG_HOST, PG_PORT)
    require_service("Redis", REDIS_HOST, REDIS_PORT)
    import asyncpg
    import redis

    name = f"{PG_PREFIX}{uuid.uuid4().hex[:12]}"

    async def admin(statement: str) -> None:
        conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, database="postgres")
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    prefix = f"fmwtest:{uuid.uuid4().hex[:12]}:"
    try:
        yield (
            f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}",
            f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}?prefix={prefix}",
        )
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
        try:
            keys = list(client.scan_iter(match=prefix + "*"))
            if keys:
                client.delete(*keys)
        finally:
            client.close()


def test_a_test_client_without_with_leaves_no_ledger_or_state_connection_behind(
    upstream_url: str, configured_stores: tuple[str, str]
) -> None:
    """The same for the PostgreSQL ledger's pool (and the route store on it) and the Redis
    state's: each request's loop ended with them open, a ResourceWarning per connection
    at the next collection. Each is closed on its loop as that loop ends."""
    store, state = configured_stores
    conf = {
        "gateway": {"store": store, "state": state},
        "upstreams": {"primary": {"url": upstream_url}},
        "routes": [{"id": "up", "prefix": "/v1/", "plan": ["primary"], "budget": "b"}],
        "budgets": {"b": {"limit": 10.0, "default_hold": 0.01}},
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gateway = Gateway(Starlette(), config=conf)
        client = TestClient(gateway)  # no `with`: a new event loop for every request
        for _ in range(3):
            assert client.get("/v1/models").text == "upstream"
        del client, gateway
        gc.collect()
    left = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not left, left
