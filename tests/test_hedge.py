"""Hedging: a second attempt at the primary after `hedge_after_ms`, first head wins, the
loser cancelled and its connection released. Real upstream servers, in-process gateway."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.health.memory import MemoryHealth
from fallback_mw.layers.walker.hedge import first_head
from tests.helpers import client_for, gateway_client
from tests.upstreams import Upstream, host_app, status_handler, upstream


def config(primary: Upstream, backup: Upstream, **route: Any) -> dict[str, Any]:
    route_config: dict[str, Any] = {
        "id": "r",
        "prefix": "/v1/",
        "plan": ["primary", "backup"],
        "retries": 2,
        "backoff_ms": 0,
        "hedge_after_ms": 60,
    }
    route_config.update(route)
    return {
        "upstreams": {"primary": {"url": primary.url}, "backup": {"url": backup.url}},
        "routes": [route_config],
    }


class SlowFirst:
    """The first call hangs (noticing when its connection is dropped); later ones answer
    at once."""

    def __init__(self, hang: float = 2.0) -> None:
        self.hang = hang
        self.arrivals: list[float] = []
        self.dropped = asyncio.Event()

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        self.arrivals.append(time.monotonic())
        if len(self.arrivals) == 1:
            deadline = time.monotonic() + self.hang
            try:
                while time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                    if request.transport is None or request.transport.is_closing():
                        self.dropped.set()
                        break
            except asyncio.CancelledError:  # aiohttp cancels a handler whose client left
                self.dropped.set()
                raise
            return web.Response(body=b"slow")
        return web.Response(body=b"fast")


@pytest.mark.anyio
async def test_hedge_fires_after_the_delay_wins_and_the_slow_attempt_is_cancelled() -> None:
    slow = SlowFirst()
    async with upstream(slow) as primary, upstream(status_handler(200, b"backup")) as backup:
        client_context = gateway_client(config(primary, backup, hedge_after_ms=100))
        async with client_context as client:
            started = time.monotonic()
            response = await client.get("/v1/x")
            elapsed = time.monotonic() - started
            assert response.status_code == 200
            assert response.text == "fast"
            assert response.headers["x-gateway-provider"] == "primary"
            assert response.headers["x-gateway-attempts"] == "2"
            assert elapsed < 1.0
            assert primary.count == 2
            assert backup.count == 0
            # Only after hedge_after_ms. Measured from the client's start, which comes before
            # the first attempt is sent: the upstream's own arrival times move with the
            # machine's load (the first one late by tens of ms on a busy machine).
            assert slow.arrivals[1] - started >= 0.095
            # The loser was cancelled: its upstream connection was closed, well before the
            # hang would have ended.
            await asyncio.wait_for(slow.dropped.wait(), timeout=1.0)


@pytest.mark.anyio
async def test_a_hedge_that_fails_fast_does_not_win_over_the_attempt_still_running() -> None:
    # The hedge is answered 503 at once while the first attempt, slower, is about to
    # answer 200. The 503 won the race as "the first head": the first attempt was
    # cancelled and the walk went to the backup (503 too): a 502 for a request the primary
    # was serving, made to fail by the hedge meant to speed it up. A failover-class head
    # is finished as the failure it is and the race goes on: the 200 is served.
    hedge_answered = asyncio.Event()
    arrivals = 0

    async def primary_handler(request: web.Request) -> web.StreamResponse:
        nonlocal arrivals
        arrivals += 1
        if arrivals == 1:
            await asyncio.wait_for(hedge_answered.wait(), timeout=10)
            await asyncio.sleep(0.2)  # the hedge's 503 reaches the gateway first
            return web.Response(body=b"slow but fine")
        hedge_answered.set()
        return web.Response(status=503, body=b"busy")

    async with (
        upstream(primary_handler) as primary,
        upstream(status_handler(503)) as backup,
        gateway_client(config(primary, backup, hedge_after_ms=50)) as client,
    ):
        response = await client.get("/v1/x")
    assert (response.status_code, response.text) == (200, "slow but fine")
    assert response.headers["x-gateway-attempts"] == "2"
    assert (primary.count, backup.count) == (2, 0)


class BookedKeys(MemoryHealth):
    """The memory state, saying when a pool key's outcome has been booked."""

    def __init__(self) -> None:
        super().__init__()
        self.booked = asyncio.Event()

    async def credential_result(self, upstream: str, index: int, **outcome: Any) -> None:
        await super().credential_result(upstream, index, **outcome)
        self.booked.set()


@pytest.mark.anyio
@pytest.mark.parametrize("status", [401, 429])
async def test_a_pool_keys_refusal_on_the_hedge_does_not_win_over_the_attempt_still_running(
    status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pool of two keys, the second revoked (401) or rate limited (429): the hedge, on
    # the second key, was refused at once while the first attempt, on the good key, was
    # about to answer 200. The refusal won the race as "the first head": the first attempt
    # was cancelled and, no key left to try, the caller got the 401 / 429. A pool key's own
    # refusal is finished as the failure it is (the key retired or cooled down) and the
    # race goes on: the 200 is served.
    monkeypatch.setenv("GOOD_KEY", "good")
    monkeypatch.setenv("REFUSED_KEY", "refused")
    health = BookedKeys()

    async def primary_handler(request: web.Request) -> web.StreamResponse:
        if request.headers["authorization"] == "Bearer refused":
            return web.Response(status=status, body=b"key refused")
        # Answers once the gateway has booked the refusal to its key (it won the race:
        # this attempt was cancelled first, and never answers).
        await asyncio.wait_for(health.booked.wait(), timeout=10)
        return web.Response(body=b"good key")

    async with upstream(primary_handler) as primary, upstream(status_handler(503)) as backup:
        conf = config(primary, backup, hedge_after_ms=50)
        conf["upstreams"]["primary"]["auth_env"] = ["GOOD_KEY", "REFUSED_KEY"]
        gateway = Gateway(host_app, config=conf, health=health)
        try:
            async with client_for(gateway) as client:
                response = await client.get("/v1/x")
        finally:
            await gateway.aclose()
    assert (response.status_code, response.text) == (200, "good key")
    assert response.headers["x-gateway-attempts"] == "2"
    assert (primary.count, backup.count) == (2, 0)


@pytest.mark.anyio
async def test_the_502_names_the_answer_that_ended_the_walk_not_the_hedge_that_failed_first() -> (
    None
):
    # The hedge is answered 502 at once; the first attempt then 503, which the walk judges
    # (the ceiling of two attempts is reached: a local 502). The message named the hedge's
    # 502, the last attempt started, as what ended the walk: a failover-class loser is
    # finished as a failure now (not cancelled), and the answer judged came before it.
    hedge_answered = asyncio.Event()
    arrivals = 0

    async def primary_handler(request: web.Request) -> web.StreamResponse:
        nonlocal arrivals
        arrivals += 1
        if arrivals == 1:
            await asyncio.wait_for(hedge_answered.wait(), timeout=10)
            await asyncio.sleep(0.2)  # the hedge's 502 reaches the gateway first
            return web.Response(status=503, body=b"busy")
        hedge_answered.set()
        return web.Response(status=502, body=b"bad gateway")

    async with (
        upstream(primary_handler) as primary,
        upstream(status_handler(200)) as backup,
        gateway_client(
            config(primary, backup, hedge_after_ms=50, retries=1, plan=["primary"])
        ) as client,
    ):
        response = await client.get("/v1/x")
    assert (response.status_code, primary.count, backup.count) == (502, 2, 0)
    message = response.json()["error"]["message"]
    assert "(last failure: status 503 at 'primary')" in message, message


@pytest.mark.anyio
async def test_a_failover_class_answer_that_lost_the_race_is_the_last_response_served() -> None:
    # on_exhausted = "last_response": the first attempt is answered 503 while the hedge
    # still waits, then the hedge times out (no head). The 503 was finished and closed as
    # the race's loser, so the walk, exhausted, had no upstream answer to pass through: a
    # local 502 where the route asks for the upstream's own 503 (as without a hedge).
    hedge_arrived = asyncio.Event()
    arrivals = 0

    async def primary_handler(request: web.Request) -> web.StreamResponse:
        nonlocal arrivals
        arrivals += 1
        if arrivals == 1:
            await asyncio.wait_for(hedge_arrived.wait(), timeout=10)
            return web.Response(status=503, body=b"busy", headers={"retry-after": "7"})
        hedge_arrived.set()
        await asyncio.sleep(10)  # past its first_byte_timeout_ms: a timeout, no head
        return web.Response(body=b"too late")

    async with upstream(primary_handler) as primary, upstream(status_handler(200)) as backup:
        conf = config(
            primary, backup, hedge_after_ms=50, retries=1, plan=["primary"],
            on_exhausted="last_response",
        )  # fmt: skip
        conf["upstreams"]["primary"]["first_byte_timeout_ms"] = 1000
        async with gateway_client(conf) as client:
            response = await client.get("/v1/x")
    assert (response.status_code, response.text) == (503, "busy"), response.text
    assert response.headers["retry-after"] == "7"
    assert response.headers["x-gateway-attempts"] == "2"


@pytest.mark.anyio
async def test_no_hedge_when_the_primary_answers_in_time() -> None:
    async with (
        upstream(status_handler(200, b"p", delay=0.02)) as primary,
        upstream(status_handler(200)) as backup,
    ):
        async with gateway_client(config(primary, backup, hedge_after_ms=300)) as client:
            for _ in range(3):
                response = await client.get("/v1/x")
                assert response.headers["x-gateway-attempts"] == "1"
            await asyncio.sleep(0.35)
        assert primary.count == 3


@pytest.mark.anyio
async def test_hedge_only_at_the_primary_never_at_a_fallback() -> None:
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(200, b"backup", delay=1.0)) as backup,
    ):
        # The primary's 503 comes well inside 300 ms even on a loaded machine; the backup
        # takes 1 s, so a hedge at the fallback (the bug) would have fired.
        async with gateway_client(config(primary, backup, hedge_after_ms=300)) as client:
            response = await client.get("/v1/x")
            assert response.text == "backup"
            assert response.headers["x-gateway-attempts"] == "2"
        assert (primary.count, backup.count) == (1, 1)


@pytest.mark.parametrize(
    "route",
    [
        {"plan": ["primary"], "retries": 0},  # no attempt left for a hedge
        {"plan": ["primary", "backup"], "retries": 1},  # the hedge would cost the backup
    ],
)
def test_a_hedge_that_could_cost_a_fallback_its_turn_is_refused(route: dict[str, Any]) -> None:
    from fallback_mw import ConfigError, load_config

    primary, backup = Upstream(url="http://127.0.0.1:9"), Upstream(url="http://127.0.0.1:10")
    with pytest.raises(ConfigError, match="hedge_after_ms needs retries"):
        load_config(config(primary, backup, hedge_after_ms=30, **route))


@pytest.mark.anyio
@pytest.mark.parametrize("route", [{"replayable_methods": ["HEAD"]}])  # GET not replayable
async def test_no_hedge_without_replay(route: dict[str, Any]) -> None:
    async with (
        upstream(status_handler(200, b"p", delay=0.2)) as primary,
        upstream(status_handler(200)) as backup,
    ):
        async with gateway_client(config(primary, backup, hedge_after_ms=30, **route)) as client:
            response = await client.get("/v1/x")
            assert response.text == "p"
            assert response.headers["x-gateway-attempts"] == "1"
        assert primary.count == 1


@pytest.mark.anyio
async def test_first_head_waits_for_a_head_when_the_first_to_finish_failed() -> None:
    discarded: list[tuple[int, str | None]] = []

    async def attempt(delay: float, result: str) -> str:
        await asyncio.sleep(delay)
        return result

    async def start_hedge() -> Any:
        return attempt(0.01, "error")

    async def discard(index: int, result: str | None) -> None:
        discarded.append((index, result))

    index, result = await first_head(
        attempt(0.5, "head"),  # wide margins: a loaded machine must not reorder them
        start_hedge,
        after=0.02,
        is_head=lambda r: r == "head",
        discard=discard,
    )
    assert (index, result) == (0, "head")
    assert discarded == [(1, "error")]

    # Neither answers with a head: the last to finish is returned.
    discarded.clear()
    index, result = await first_head(
        attempt(0.5, "timeout"),
        start_hedge,
        after=0.02,
        is_head=lambda r: r == "head",
        discard=discard,
    )
    assert (index, result) == (0, "timeout")
    assert discarded == [(1, "error")]


@pytest.mark.anyio
async def test_first_head_cancels_both_when_cancelled() -> None:
    cancelled: list[int] = []

    async def attempt(index: int) -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(index)
            raise
        return "never"

    async def start_hedge() -> Any:
        return attempt(1)

    async def discard(index: int, result: str | None) -> None:
        return None

    task = asyncio.ensure_future(
        first_head(attempt(0), start_hedge, after=0.01, is_head=bool, discard=discard)
    )
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(cancelled) == [0, 1]
