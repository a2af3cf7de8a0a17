"""An upstream engine a host writes itself (`Gateway(..., client=...)`, the
`fallback_mw.upstream.UpstreamClient` protocol of docs/budgets.md: `send` and `aclose`, an
`UpstreamResponse` with `status`, `headers`, `iter_chunks`, `aclose`) is used as the
shipped engines are: what it sends counts as sent."""

from __future__ import annotations

import asyncio
import copy
import pickle
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fallback_mw import Gateway
from fallback_mw.upstream import UpstreamError, UpstreamRequest, UpstreamResponse
from tests.helpers import client_for
from tests.upstreams import host_app

pytestmark = pytest.mark.anyio


class Answer:
    status = 200
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"2")]

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        yield b"ok"

    async def aclose(self) -> None:
        return None


class OwnEngine:
    """Written from the protocol alone: it answers every request itself, and holds one
    whose path ends in /slow past any deadline."""

    def __init__(self) -> None:
        self.sent = 0

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        self.sent += 1
        if request.url.endswith("/slow"):
            await asyncio.sleep(60)
        return Answer()

    async def aclose(self) -> None:
        return None


def config(**upstream: Any) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {"primary": {"url": "http://127.0.0.1:9", **upstream}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"], "deadline_ms": 300}],
    }


async def test_a_declared_rpm_holds_for_an_engine_of_the_hosts_own() -> None:
    """With `rpm = 2` on its upstream, a host's own engine was sent every request: the walk
    read each attempt as one that ended waiting for a connection slot (a flag only the
    shipped engines set), gave its count back, and the upstream never reached its rpm.
    The third request in the minute is now skipped for capacity (no packet), as with the
    shipped engines."""
    engine = OwnEngine()
    gateway = Gateway(host_app, config=config(rpm=2), client=engine)
    async with gateway, client_for(gateway) as client:
        served = [await client.get("/v1/models") for _ in range(2)]
        assert [r.status_code for r in served] == [200, 200]
        refused = await client.get("/v1/models")
    assert engine.sent == 2
    assert refused.status_code == 503, refused.text
    assert refused.headers["x-gateway-skipped"] == "primary;reason=capacity"


async def test_a_deadline_under_an_engine_of_the_hosts_own_names_its_timers() -> None:
    """The deadline cutting an attempt a host's own engine was still waiting on was
    explained as waiting for a free connection ("its max_connections, 100, were all in
    use: raise the max_connections"), a cap that engine never applied; it names the
    first-byte timer the attempt was inside, as for the shipped engines."""
    engine = OwnEngine()
    gateway = Gateway(host_app, config=config(first_byte_timeout_ms=1000), client=engine)
    async with gateway, client_for(gateway) as client:
        response = await client.get("/v1/slow")
    assert response.status_code == 504, response.text
    message = response.json()["error"]["message"]
    assert "max_connections" not in message, message
    assert "first_byte_timeout_ms (1000 ms)" in message, message


class TimingOutEngine:
    """Times its upstream out as asyncio does (`asyncio.timeout` raising TimeoutError),
    not with the protocol's UpstreamError("timeout", ...), for the primary."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        self.asked.append(request.url.split("/")[2])
        if request.url.startswith("http://127.0.0.1:9/"):
            async with asyncio.timeout(request.timeouts.first_byte):
                await asyncio.sleep(60)
        return Answer()

    async def aclose(self) -> None:
        return None


async def test_an_engines_own_timeout_is_the_upstreams_timeout_not_the_deadline() -> None:
    """An engine of the host's own that timed its upstream out with asyncio's own
    TimeoutError (its `asyncio.timeout(request.timeouts.first_byte)`) ended the walk at
    once with 504 deadline_exceeded, "the route deadline (5000 ms) passed" 0.2 s into it,
    and the backup was never asked. Only the walk's own deadline is the deadline: the
    engine's timeout is the upstream's (failure kind timeout), and the backup serves."""
    conf = {
        "gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {
            "primary": {"url": "http://127.0.0.1:9", "first_byte_timeout_ms": 200},
            "backup": {"url": "http://127.0.0.1:10"},
        },
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"],
                    "retries": 1, "deadline_ms": 5000}],
    }  # fmt: skip
    engine = TimingOutEngine()
    gateway = Gateway(host_app, config=conf, client=engine)
    async with gateway, client_for(gateway) as client:
        response = await client.get("/v1/models")
    assert response.status_code == 200, response.text
    assert response.headers["x-gateway-provider"] == "backup"
    assert engine.asked == ["127.0.0.1:9", "127.0.0.1:10"]


class Head:
    def __init__(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.headers = headers
        self.closed = False

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        yield b"ok"

    async def aclose(self) -> None:
        self.closed = True


class PrimaryAnswers:
    """The primary answers `head`, the backup a plain 200."""

    def __init__(self, head: Head) -> None:
        self.head = head

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        return self.head if request.url.startswith("http://127.0.0.1:9/") else Answer()

    async def aclose(self) -> None:
        return None


HEADS = {
    "a status outside 100-599": (700, []),
    "a 1xx as the final answer": (101, [(b"upgrade", b"websocket")]),
    "contradictory framing": (200, [(b"content-length", b"2"), (b"transfer-encoding", b"chunked")]),
    "a control character in a field": (200, [(b"x-note", b"a\x01b")]),
}


@pytest.mark.parametrize("case", list(HEADS))
async def test_an_answer_no_relay_can_carry_fails_over_from_an_engine_of_the_hosts_own(
    case: str,
) -> None:
    """SPEC §12: an upstream status outside 100-599, a 1xx as the final answer or
    contradictory framing is a failover-class failure. The shipped engines check the head
    themselves (upstream/base.check_response_head); an engine of the host's own had its
    answer relayed as it was (status 700 to the caller, a 101 with a body, Content-Length
    beside chunked), which a server refuses to write once the response started: an empty
    reply booked as served. The walk checks such an engine's head: the backup serves, and
    the primary's answer is closed unread."""
    status, headers = HEADS[case]
    head = Head(status, headers)
    conf = {
        "gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {"primary": {"url": "http://127.0.0.1:9"},
                      "backup": {"url": "http://127.0.0.1:10"}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"],
                    "retries": 1}],
    }  # fmt: skip
    gateway = Gateway(host_app, config=conf, client=PrimaryAnswers(head))
    async with gateway, client_for(gateway) as client:
        response = await client.get("/v1/models")
    assert response.status_code == 200, response.text
    assert response.headers["x-gateway-provider"] == "backup"
    assert response.headers["x-gateway-attempts"] == "2"
    assert head.closed


def test_an_engine_error_survives_pickling_and_copying() -> None:
    """An UpstreamError raised in a worker process (an engine of the host's own that sends
    from a process pool) could not come back: its required `phase` made unpickling fail
    ("__init__() missing 1 required positional argument: 'phase'"), and so did
    copy.copy. Its kind, phase, message and detail survive both."""
    error = UpstreamError("timeout", "connect", "took too long", detail="what to change")
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert isinstance(again, UpstreamError)
        assert (again.kind, again.phase, str(again), again.detail) == (
            "timeout", "connect", "took too long", "what to change",
        )  # fmt: skip


def test_the_head_check_is_an_optional_declaration_of_the_seam() -> None:
    """Both shipped engines say they check each answer's head themselves; an engine written
    to `send` + `aclose` alone says nothing and has its heads checked by the walk."""
    from fallback_mw.upstream.aiohttp_engine import AiohttpClient
    from fallback_mw.upstream.base import checks_own_heads
    from fallback_mw.upstream.httpx_engine import HttpxClient

    class Plain:
        async def send(self, request: UpstreamRequest) -> UpstreamResponse:
            raise UpstreamError("transport", "connect")

        async def aclose(self) -> None:
            return None

    # Asked of an instance, as the walk asks it (compiled, a native class's attribute read
    # from the class is its descriptor).
    aiohttp_client, httpx_client = AiohttpClient(), HttpxClient()
    try:
        assert checks_own_heads(aiohttp_client) is True
        assert checks_own_heads(httpx_client) is True
    finally:
        asyncio.run(aiohttp_client.aclose())
        asyncio.run(httpx_client.aclose())
    assert checks_own_heads(Plain()) is False
