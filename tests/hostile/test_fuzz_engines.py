"""Fuzzing caller input through both engines (hypothesis): methods, paths, query strings,
header names and values (any bytes) and bodies (buffered and streamed), straight through
the ASGI interface of an in-process gateway, to a real local upstream that always answers
200. Whatever the caller sends:

- the gateway never makes a 5xx other than 502 / 503 / 504, and those are its JSON error;
- no exception escapes the gateway (which a server would turn into a bare 500);
- no breaker ever records a failure: the upstream is healthy, so any failure mark would be
  a caller's fault booked to it. Each example is judged by its own marks: the windows are
  emptied before it (a mark stayed in the window for the next 20 requests, so every later
  example failed too: hypothesis shrank to one that had nothing to do with it, and its
  replay, the mark gone, passed: a FlakyFailure naming the wrong input).

The upstream's own timers (connect, first byte) are far longer than the walk deadline:
a gateway process stalled past them on a loaded host (3 s without the CPU, a long garbage
collection) would book the stall to the upstream as its timeout; the walk deadline ends
such a request in the gateway's own 504 instead, which the oracle accepts.

Content-Length, when sent, matches the body (framing is the ASGI server's job)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator, MutableMapping
from concurrent.futures import Future
from contextlib import AsyncExitStack
from typing import Any, TypeVar

import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fallback_mw import Gateway
from fallback_mw.health.breaker import Breaker
from fallback_mw.health.memory import MemoryHealth
from tests.helpers import http_scope
from tests.upstreams import host_app, upstream

T = TypeVar("T")

# Past the walk deadline (10 s) and the 30 s the test waits: never what ends an attempt.
UPSTREAM_TIMERS_MS = 60_000

SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


class Harness:
    """A gateway and a healthy upstream living on their own event loop (a thread), so the
    synchronous hypothesis test can drive one request per example."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stack = AsyncExitStack()
        self.gateway: Gateway = self.run(self._start())

    def run(self, coroutine: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout=60)

    async def _start(self) -> Gateway:
        async def ok(request: web.Request) -> web.StreamResponse:
            return web.Response(text="ok")

        primary = await self.stack.enter_async_context(upstream(ok))
        backup = await self.stack.enter_async_context(upstream(ok))
        slow = {
            "connect_timeout_ms": UPSTREAM_TIMERS_MS,
            "first_byte_timeout_ms": UPSTREAM_TIMERS_MS,
        }
        config = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "engine": self.engine,
                        "replay_buffer": 1024, "max_request_body": 8192, "deadline_ms": 10_000},
            "upstreams": {"primary": {"url": primary.url, **slow},
                          "backup": {"url": backup.url, **slow}},
            "routes": [{"id": "fuzz", "prefix": "/v1/", "plan": ["primary", "backup"],
                        "retries": 1, "replayable_methods": ["GET", "POST"]}],
        }  # fmt: skip
        return Gateway(host_app, config=config)

    def close(self) -> None:
        async def stop() -> None:
            await self.gateway.aclose()
            await self.stack.aclose()

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    def breakers(self) -> list[Breaker]:
        health = self.gateway.services.health
        assert isinstance(health, MemoryHealth)
        return [health.breaker(name) for name in ("primary", "backup")]

    def forget_marks(self) -> None:
        """Empty both windows (closed breakers: one example makes two outcomes at most,
        never the 5 that could open one)."""
        for breaker in self.breakers():
            assert breaker.state == "closed"
            breaker.outcomes.clear()

    def marks(self) -> list[int]:
        return [m for breaker in self.breakers() for m in breaker.outcomes]


@pytest.fixture(params=["aiohttp", "httpx"], scope="module")
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    found = Harness(request.param)
    try:
        yield found
    finally:
        found.close()


async def call(
    gateway: Gateway, scope: dict[str, Any], chunks: list[bytes]
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    messages = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks or [b""])
    ]
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # connected until the gateway is done
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await asyncio.wait_for(gateway(scope, receive, send), 30)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], list(start.get("headers", [])), body


METHODS = st.one_of(
    st.just("GET"),
    st.just("POST"),
    st.just("PUT"),
    st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "TRACE",
                     "CONNECT", "PROPFIND", "get"]),
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ-_ !\x00é", min_size=1, max_size=8),
)  # fmt: skip
PATHS = st.lists(
    st.sampled_from([*"abc/.%;?#~-_ 09", "%2F", "%2e", "..", "\x00", "é", "\\"]), max_size=12
).map(lambda parts: "/v1/" + "".join(parts))
NAMES = st.one_of(
    st.sampled_from([b"x-note", b"idempotency-key", b"x-gateway-deadline-ms", b"connection",
                     b"x-tenant-id", b"x-session-id", b"authorization", b"te", b"expect",
                     b"transfer-encoding", b"traceparent", b"baggage", b"x_api_key",
                     b"content-type", b"accept-encoding", b"upgrade"]),
    st.sampled_from([b"x-a", b"accept", b"user-agent", b"x-request-id", b"if-none-match"]),
    st.binary(min_size=0, max_size=12),
)  # fmt: skip
VALUES = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30).map(str.encode),
    st.binary(max_size=40),
    st.sampled_from([b"close", b"100-continue", b"chunked", b"0", b"1", b"99999999",
                     b"\t", b" x ", b"caf\xc3\xa9", b"caf\xe9", b"a\r\nb", b"websocket"]),
)  # fmt: skip
BODIES = st.one_of(st.binary(max_size=64), st.binary(min_size=1000, max_size=3000))


@SETTINGS
@given(
    method=METHODS,
    path=PATHS,
    query=st.binary(max_size=30),
    headers=st.lists(st.tuples(NAMES, VALUES), max_size=6),
    body=BODIES,
    pieces=st.integers(1, 3),
    declare=st.booleans(),
)
def test_caller_input_never_makes_a_bare_5xx_or_a_breaker_mark(
    harness: Harness,
    method: str,
    path: str,
    query: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    pieces: int,
    declare: bool,
) -> None:
    # Framing is the server's: a declared length is the body's, one at most.
    headers = [(n, v) for n, v in headers if n.lower() != b"content-length"]
    if declare:
        headers.append((b"content-length", str(len(body)).encode()))
    size = -(-len(body) // pieces) or 1
    chunks = [body[i : i + size] for i in range(0, len(body), size)]
    scope = http_scope(method, path, query=query, headers=headers)
    harness.forget_marks()  # this example's marks only
    status, _, answer = harness.run(call(harness.gateway, scope, chunks))
    event(f"status {status}")
    if status >= 500:
        assert status in (502, 503, 504), (status, answer[:200])
        error = json.loads(answer)["error"]
        assert error["type"] == "gateway_error"
    assert 1 not in harness.marks(), "a caller's input was booked to a healthy upstream"
