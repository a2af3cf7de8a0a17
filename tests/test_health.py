"""Breakers and credential pools through the whole gateway, against real upstream servers
(SPEC §6). The in-memory state gets a hand-driven clock so cooldowns are exact."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.config import BreakerConfig
from fallback_mw.health import create_health
from fallback_mw.health.memory import MemoryHealth
from fallback_mw.health.redis import RedisHealth
from tests.helpers import client_for, http_scope
from tests.upstreams import Upstream, host_app, status_handler, upstream

BREAKER = {"window": 4, "min_calls": 3, "failure_rate": 0.5, "cooldown_ms": 100,
           "max_cooldown_ms": 350}  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def config(
    upstreams: dict[str, Upstream | str],
    plan: list[str],
    *,
    auth: dict[str, Any] | None = None,
    state: str = "memory://",
    **route: Any,
) -> dict[str, Any]:
    route_config: dict[str, Any] = {
        "id": "r",
        "prefix": "/v1/",
        "plan": plan,
        "retries": len(plan) - 1,
        "backoff_ms": 0,
    }
    route_config.update(route)
    return {
        "gateway": {"state": state, "breaker": BREAKER},
        "upstreams": {
            name: {"url": up if isinstance(up, str) else up.url, **(auth or {}).get(name, {})}
            for name, up in upstreams.items()
        },
        "routes": [route_config],
    }


@asynccontextmanager
async def gateway_client(
    conf: dict[str, Any], **kwargs: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    gateway = Gateway(host_app, config=conf, **kwargs)
    try:
        async with client_for(gateway) as client:
            yield client, gateway
    finally:
        await gateway.aclose()


@pytest.mark.anyio
async def test_memory_is_the_default_state() -> None:
    assert isinstance(create_health("memory://"), MemoryHealth)
    assert isinstance(create_health("redis://127.0.0.1:6379/0?prefix=x:"), RedisHealth)
    with pytest.raises(ValueError, match="state must be"):
        create_health("postgresql://x")


@pytest.mark.anyio
async def test_breaker_opens_skips_probes_once_doubles_and_closes() -> None:
    answer = {"status": 503}

    async def primary_handler(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.05)  # slow enough for concurrent requests to overlap
        return web.Response(status=answer["status"], body=b"p")

    clock = Clock()
    health = MemoryHealth(BreakerConfig(**BREAKER), clock=clock)
    async with (
        upstream(primary_handler) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        conf = config({"primary": primary, "backup": backup}, ["primary", "backup"])
        async with gateway_client(conf, health=health) as (client, _):
            for expected in (1, 2, 3):
                response = await client.get("/v1/x")
                assert response.status_code == 200
                assert response.headers["x-gateway-attempts"] == "2"
                assert primary.count == expected
            # Open after min_calls = 3: the primary gets nothing, costs no attempt.
            for _ in range(5):
                response = await client.get("/v1/x")
                assert response.headers["x-gateway-provider"] == "backup"
                assert response.headers["x-gateway-attempts"] == "1"
            assert primary.count == 3

            # After the cooldown: exactly one probe, however many requests arrive at once.
            clock.now += 0.1
            responses = await asyncio.gather(*(client.get("/v1/x") for _ in range(6)))
            assert all(r.status_code == 200 for r in responses)
            assert primary.count == 4
            assert sorted(r.headers["x-gateway-attempts"] for r in responses) == ["1"] * 5 + ["2"]

            # The failed probe reopened it for twice the cooldown (0.2 s).
            clock.now += 0.15
            await client.get("/v1/x")
            assert primary.count == 4
            clock.now += 0.06
            await client.get("/v1/x")
            assert primary.count == 5  # second probe, fails: cooldown 0.4 capped at 0.35
            clock.now += 0.3
            await client.get("/v1/x")
            assert primary.count == 5
            answer["status"] = 200
            clock.now += 0.06
            response = await client.get("/v1/x")
            assert response.headers["x-gateway-provider"] == "primary"
            assert primary.count == 6
            # Closed and reset: every request goes to the primary again.
            for _ in range(4):
                response = await client.get("/v1/x")
                assert response.headers["x-gateway-provider"] == "primary"
            assert primary.count == 10
            assert health.breaker("primary").cooldown == 0.1


@pytest.mark.anyio
async def test_a_slow_probe_keeps_its_slot_for_its_upstreams_timeouts() -> None:
    """One probe at a time (SPEC §6) also while the probe waits up to its upstream's 90 s
    first-byte timeout: its lease (3 + 90 + 5 s) outlasts it, not a fixed 30 s."""
    answer = {"status": 503}
    arrived, go = asyncio.Event(), asyncio.Event()

    async def primary_handler(request: web.Request) -> web.StreamResponse:
        if answer["status"] == 200 and not arrived.is_set():  # the probe, held until `go`
            arrived.set()
            await go.wait()
        return web.Response(status=answer["status"], body=b"p")

    clock = Clock()
    health = MemoryHealth(BreakerConfig(**BREAKER), clock=clock)
    async with (
        upstream(primary_handler) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        conf = config({"primary": primary, "backup": backup}, ["primary", "backup"],
                      deadline_ms=120_000)  # fmt: skip
        conf["upstreams"]["primary"]["first_byte_timeout_ms"] = 90_000
        async with gateway_client(conf, health=health) as (client, _):
            for _ in range(3):
                await client.get("/v1/x")
            assert health.breaker("primary").state == "open"
            clock.now += 0.1
            answer["status"] = 200
            probe = asyncio.ensure_future(client.get("/v1/x"))
            try:
                await asyncio.wait_for(arrived.wait(), 5)
                assert primary.count == 4

                clock.now += 40  # the probe still in flight, past the old 30 s lease
                response = await client.get("/v1/x")
                assert response.headers["x-gateway-provider"] == "backup"
                assert response.headers["x-gateway-attempts"] == "1"
                assert primary.count == 4
                clock.now += 57.9  # 97.9 s: still inside the lease
                assert (await client.get("/v1/x")).headers["x-gateway-attempts"] == "1"
                assert primary.count == 4

                # A probe that never reports frees its slot once its lease is over (98 s).
                clock.now += 0.2
                response = await client.get("/v1/x")
                assert response.headers["x-gateway-provider"] == "primary"
                assert primary.count == 5
            finally:
                go.set()  # never leave a handler waiting, nor the probe in flight
                (result,) = await asyncio.gather(probe, return_exceptions=True)
            assert not isinstance(result, BaseException)
            assert result.headers["x-gateway-provider"] == "primary"
            assert health.breaker("primary").state == "closed"


@pytest.mark.anyio
async def test_a_probe_whose_caller_uploads_slowly_keeps_its_slot_until_its_deadline() -> None:
    """The probe's lease covered the upstream's timeouts (1 + 10 + 5 s, at least 30 s), but
    a streamed body's upload is the caller's time, bounded only by the route deadline: a
    caller still uploading 40 s on lost the slot, and a second probe went out beside it.
    Such a probe now holds its slot until the walk's deadline could end it."""
    answer = {"status": 503}
    sending, go = asyncio.Event(), asyncio.Event()

    async def primary_handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=answer["status"], body=b"p")

    async def upload() -> AsyncIterator[bytes]:
        yield b"x" * 2048
        sending.set()  # the probe was admitted and asks for the rest of the body
        await go.wait()  # the caller pauses; the probe waits on it, not on the upstream
        yield b"x" * 2048

    clock = Clock()
    health = MemoryHealth(BreakerConfig(**BREAKER), clock=clock)
    async with (
        upstream(primary_handler) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        conf = config({"primary": primary, "backup": backup}, ["primary", "backup"],
                      deadline_ms=120_000)  # fmt: skip
        conf["gateway"]["replay_buffer"] = 1024  # the upload streams, never buffered
        conf["upstreams"]["primary"].update(connect_timeout_ms=1000, first_byte_timeout_ms=10_000)
        async with gateway_client(conf, health=health) as (client, _):
            for _ in range(3):
                await client.get("/v1/x")
            assert health.breaker("primary").state == "open"
            clock.now += 0.1
            answer["status"] = 200
            probe = asyncio.ensure_future(
                client.post("/v1/x", content=upload(), headers={"content-length": "4096"})
            )
            try:
                await asyncio.wait_for(sending.wait(), 5)
                clock.now += 40  # past the upstream's lease, the upload still going
                response = await client.get("/v1/x")
                assert response.headers["x-gateway-provider"] == "backup"
                assert primary.count == 3  # the probe's body still on its way
            finally:
                go.set()
                (result,) = await asyncio.gather(probe, return_exceptions=True)
            assert not isinstance(result, BaseException)
            assert result.headers["x-gateway-provider"] == "primary"
            assert health.breaker("primary").state == "closed"


@pytest.mark.anyio
async def test_statuses_outside_failover_status_never_trip_the_breaker() -> None:
    async with upstream(status_handler(400)) as primary, upstream(status_handler(200)) as backup:
        conf = config({"primary": primary, "backup": backup}, ["primary", "backup"])
        async with gateway_client(conf) as (client, gateway):
            for _ in range(12):
                response = await client.get("/v1/x")
                assert response.status_code == 400
                assert response.headers["x-gateway-provider"] == "primary"
            assert primary.count == 12
            assert backup.count == 0
            health = gateway.services.health
            assert isinstance(health, MemoryHealth)
            assert health.breaker("primary").state == "closed"


@pytest.mark.anyio
async def test_all_candidates_unusable_is_route_exhausted_without_contact() -> None:
    async with upstream(status_handler(503)) as a, upstream(status_handler(503)) as b:
        conf = config({"a": a, "b": b}, ["a", "b"], retries=3)
        async with gateway_client(conf) as (client, _):
            for attempts in (4, 2):
                response = await client.get("/v1/x")
                assert response.status_code == 502
                assert response.json()["error"]["code"] == "upstream_failed"
                assert response.headers["x-gateway-attempts"] == str(attempts)
            # min_calls = 3 failures each: both breakers opened during the second request.
            assert (a.count, b.count) == (3, 3)
            response = await client.get("/v1/x")
            assert response.status_code == 503
            error = response.json()["error"]
            assert error["code"] == "route_exhausted"
            assert error["attempts"] == 0
            assert response.headers["x-gateway-attempts"] == "0"
            assert (a.count, b.count) == (3, 3)


def key_handler(statuses: dict[str, int]) -> Any:
    async def handle(request: web.Request) -> web.StreamResponse:
        key = request.headers.get("authorization", "").removeprefix("Bearer ")
        status = statuses.get(key, 200)
        headers = {"retry-after": "30"} if status == 429 else {}
        return web.Response(status=status, body=f"served by {key}".encode(), headers=headers)

    return handle


POOL_ENV = {"KEY_A": "key-a", "KEY_B": "key-b", "KEY_C": "key-c"}


def keys_used(up: Upstream) -> list[str]:
    return [dict(r.headers).get("authorization", "").removeprefix("Bearer ") for r in up.received]


@pytest.mark.anyio
async def test_a_401_credential_is_used_exactly_once_and_never_again() -> None:
    async with upstream(key_handler({"key-a": 401})) as primary:
        auth = {"primary": {"auth_env": ["KEY_A", "KEY_B"]}}
        conf = config({"primary": primary}, ["primary"], auth=auth, retries=1)
        async with gateway_client(conf, environ=POOL_ENV) as (client, _):
            for _ in range(8):
                response = await client.get("/v1/x")
                assert response.status_code == 200
                assert response.text == "served by key-b"
        used = keys_used(primary)
        assert used.count("key-a") == 1
        assert used.count("key-b") == 8


@pytest.mark.anyio
async def test_a_pool_with_every_credential_retired_is_skipped() -> None:
    async with (
        upstream(key_handler({"key-a": 401, "key-b": 401})) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        auth = {"primary": {"auth_env": ["KEY_A", "KEY_B"]}}
        conf = config(
            {"primary": primary, "backup": backup}, ["primary", "backup"], auth=auth, retries=2
        )
        async with gateway_client(conf, environ=POOL_ENV) as (client, _):
            response = await client.get("/v1/x")
            # Each credential at most once per request; the 401s are not failover-class, so
            # the last 401 is the answer.
            assert response.status_code == 401
            assert sorted(keys_used(primary)) == ["key-a", "key-b"]
            for _ in range(3):
                response = await client.get("/v1/x")
                assert response.text == "backup"
                assert response.headers["x-gateway-attempts"] == "1"
            assert primary.count == 2


@pytest.mark.anyio
async def test_session_affinity_keeps_a_session_on_its_healthy_credential() -> None:
    statuses: dict[str, int] = {}
    async with upstream(key_handler(statuses)) as primary:
        auth = {"primary": {"auth_env": ["KEY_A", "KEY_B", "KEY_C"]}}
        conf = config({"primary": primary}, ["primary"], auth=auth, retries=1)
        async with gateway_client(conf, environ=POOL_ENV) as (client, _):
            sessions = {}
            for session in ("s1", "s2", "s3"):
                texts = {
                    (await client.get("/v1/x", headers={"x-session-id": session})).text
                    for _ in range(4)
                }
                assert len(texts) == 1
                sessions[session] = texts.pop().removeprefix("served by ")
            assert len(set(sessions.values())) > 1  # sessions spread over the pool
            # s1's key is rate limited: it moves within the same request and stays moved.
            statuses[sessions["s1"]] = 429
            before = primary.count
            response = await client.get("/v1/x", headers={"x-session-id": "s1"})
            assert response.status_code == 200
            moved = response.text.removeprefix("served by ")
            assert moved != sessions["s1"]
            assert primary.count == before + 2
            assert response.headers["x-gateway-attempts"] == "2"
            for _ in range(3):
                response = await client.get("/v1/x", headers={"x-session-id": "s1"})
                assert response.text == f"served by {moved}"
            # Retry-After: 30 keeps the limited key out of rotation for everyone.
            for _ in range(6):
                response = await client.get("/v1/x")
                assert response.status_code == 200
            assert keys_used(primary).count(sessions["s1"]) == 5


@pytest.mark.anyio
async def test_single_credential_is_governed_by_the_breaker_only() -> None:
    async with upstream(key_handler({"key-a": 429})) as primary:
        auth = {"primary": {"auth_env": "KEY_A"}}
        conf = config({"primary": primary}, ["primary"], auth=auth)
        async with gateway_client(conf, environ=POOL_ENV) as (client, _):
            for _ in range(3):
                response = await client.get("/v1/x")
                assert response.status_code == 429
        assert primary.count == 3


def straggler_upstream(gates: dict[str, asyncio.Event]) -> Any:
    """`/v1/fail` answers 503; a path named in `gates` waits for its event, then 200."""

    async def handle(request: web.Request) -> web.StreamResponse:
        name = request.path.rsplit("/", 1)[-1]
        if name == "fail":
            return web.Response(status=503)
        if name in gates:
            await gates[name].wait()
        return web.Response(body=b"primary")

    return handle


async def wait_for_count(up: Upstream, count: int) -> None:
    for _ in range(400):
        if up.count >= count:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"the upstream received {up.count} requests, not {count}")


@pytest.mark.anyio
@pytest.mark.parametrize("state", ["memory", "redis"])
@pytest.mark.parametrize("ending", ["answers", "hangs_up"])
async def test_an_attempt_admitted_before_the_breaker_opened_is_not_the_half_open_probe(
    state: str, ending: str, request: pytest.FixtureRequest
) -> None:
    """A request admitted while the breaker was closed that ends while it is half-open (its
    answer arrives, or its caller hangs up) is not the probe: the answer closed the breaker
    with the probe still out, and the hang-up freed the probe's slot, letting a second
    probe through (SPEC §6: half-open admits one probe)."""
    gates = {"straggler": asyncio.Event(), "probe": asyncio.Event()}
    clock = Clock()
    kwargs: dict[str, Any] = {}
    if state == "memory":
        kwargs["health"] = MemoryHealth(BreakerConfig(**BREAKER), clock=clock)
        state_url = "memory://"
    else:
        state_url = request.getfixturevalue("redis_url")
    async with upstream(straggler_upstream(gates)) as primary:
        conf = config({"primary": primary}, ["primary"], state=state_url)
        async with gateway_client(conf, **kwargs) as (client, gateway):
            left = asyncio.Event()
            sent: list[dict[str, Any]] = []

            async def receive() -> dict[str, Any]:
                if not sent:
                    sent.append({})
                    return {"type": "http.request", "body": b"", "more_body": False}
                await left.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            if ending == "answers":
                straggler = asyncio.ensure_future(client.get("/v1/straggler"))
            else:
                scope = http_scope("GET", "/v1/straggler")
                straggler = asyncio.ensure_future(gateway(scope, receive, send))
            await wait_for_count(primary, 1)  # admitted by the closed breaker, in flight
            for _ in range(3):
                assert (await client.get("/v1/fail")).status_code == 502
            assert (await client.get("/v1/x")).status_code == 503  # open: skipped
            assert primary.count == 4

            if state == "memory":
                clock.now += 0.1
            else:
                await asyncio.sleep(0.15)
            probe = asyncio.ensure_future(client.get("/v1/probe"))
            await wait_for_count(primary, 5)  # the one half-open probe, in flight

            if ending == "answers":
                gates["straggler"].set()
            else:
                left.set()
            await straggler
            response = await client.get("/v1/x")
            assert response.status_code == 503, "a second probe while the first is out"
            assert response.headers["x-gateway-skipped"] == "primary;reason=breaker_open"
            assert primary.count == 5

            gates["probe"].set()
            assert (await probe).status_code == 200  # the probe's success closes it
            assert (await client.get("/v1/x")).text == "primary"
            assert primary.count == 6


@pytest.mark.anyio
@pytest.mark.parametrize("state", ["memory", "redis"])
async def test_a_probe_whose_caller_hangs_up_frees_its_slot(
    state: str, request: pytest.FixtureRequest
) -> None:
    """The half-open probe's caller leaves: the probe proved nothing, and its slot was held
    for its whole lease (38 s with the default timeouts) while every request skipped the
    upstream. The next request is the probe now."""
    gates = {"probe": asyncio.Event()}
    clock = Clock()
    kwargs: dict[str, Any] = {}
    if state == "memory":
        kwargs["health"] = MemoryHealth(BreakerConfig(**BREAKER), clock=clock)
        state_url = "memory://"
    else:
        state_url = request.getfixturevalue("redis_url")
    async with upstream(straggler_upstream(gates)) as primary:
        conf = config({"primary": primary}, ["primary"], state=state_url)
        async with gateway_client(conf, **kwargs) as (client, gateway):
            for _ in range(3):
                assert (await client.get("/v1/fail")).status_code == 502
            if state == "memory":
                clock.now += 0.1
            else:
                await asyncio.sleep(0.15)
            left = asyncio.Event()
            sent: list[dict[str, Any]] = []

            async def receive() -> dict[str, Any]:
                if not sent:
                    sent.append({})
                    return {"type": "http.request", "body": b"", "more_body": False}
                await left.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            probe = asyncio.ensure_future(gateway(http_scope("GET", "/v1/probe"), receive, send))
            await wait_for_count(primary, 4)  # the probe, in flight
            assert (await client.get("/v1/x")).status_code == 503  # one probe at a time
            left.set()
            await probe
            assert len(sent) == 1  # nothing was sent to the caller who left
            response = await client.get("/v1/x")
            assert response.status_code == 200, "the probe's slot is held for nobody"
            assert primary.count == 5
            assert (await client.get("/v1/x")).text == "primary"  # its success closed it


@pytest.mark.anyio
@pytest.mark.parametrize("state", ["memory", "redis"])
async def test_a_fallback_moved_to_another_url_by_the_store_starts_with_a_closed_breaker(
    state: str, request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    """`routes set-fallback` points the route's fallback at a healthy host: the breaker the
    old host opened went on skipping the new one (503 route_exhausted) for its cooldown,
    up to max_cooldown_ms once doubled. A name that now stands for another url gets a
    closed breaker; one whose url is unchanged keeps its state."""
    from tests.test_cli_admin import cli, wait_for

    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    state_url = "memory://" if state == "memory" else request.getfixturevalue("redis_url")
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(503)) as old,
        upstream(status_handler(200, b"new")) as new,
    ):
        assert (await cli(
            "routes", "add", "--store", store, "--id", "st", "--prefix", "/st/",
            "--upstream", primary.url, "--retries", "1", "--fallback", old.url,
        ))[0] == 0  # fmt: skip
        conf = {
            "gateway": {"store": store, "state": state_url,
                        "breaker": {"window": 2, "min_calls": 2, "cooldown_ms": 60_000}},
        }  # fmt: skip
        async with gateway_client(conf) as (client, gateway):
            runtime = gateway.services.store
            assert runtime is not None
            runtime.poll_interval = 0.05
            for _ in range(2):
                assert (await client.get("/st/x")).status_code == 502
            response = await client.get("/st/x")
            assert response.headers["x-gateway-skipped"] == (
                "st-primary;reason=breaker_open, st-fallback;reason=breaker_open"
            )
            reloads = runtime.reloads
            assert (await cli(
                "routes", "set-fallback", "--store", store, "--id", "st", "--upstream", new.url,
            ))[0] == 0  # fmt: skip

            async def reloaded() -> bool:
                return runtime.reloads > reloads

            assert await wait_for(reloaded, True)
            response = await client.get("/st/x")
            assert (response.status_code, response.text) == (200, "new")
            # The primary's url did not change: its breaker is still open.
            assert response.headers["x-gateway-skipped"] == "st-primary;reason=breaker_open"
    assert (primary.count, old.count, new.count) == (2, 2, 1)


@pytest.mark.anyio
async def test_answers_of_the_old_url_that_end_after_the_move_leave_the_new_breaker_closed(
    tmp_path: Any,
) -> None:
    """`routes set-fallback` moves the fallback off a failing host while requests still
    wait on it (the reason for the move). Their failures, ending after the reload, were
    booked to the breaker the new url had just been given: they opened it, and the
    healthy new host was skipped for the cooldown. An outcome is booked to the breaker
    that admitted its attempt, never to the one a move put in its place."""
    from tests.test_cli_admin import cli, wait_for

    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    release = asyncio.Event()

    async def failing_late(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(status=503, body=b"old")

    async with (
        upstream(status_handler(503)) as primary,
        upstream(failing_late) as old,
        upstream(status_handler(200, b"new")) as new,
    ):
        assert (await cli(
            "routes", "add", "--store", store, "--id", "st", "--prefix", "/st/",
            "--upstream", primary.url, "--retries", "1", "--fallback", old.url,
        ))[0] == 0  # fmt: skip
        conf = {
            "gateway": {"store": store,
                        "breaker": {"window": 2, "min_calls": 2, "cooldown_ms": 60_000}},
        }  # fmt: skip
        async with gateway_client(conf) as (client, gateway):
            runtime = gateway.services.store
            assert runtime is not None
            runtime.poll_interval = 0.05
            waiting = [asyncio.ensure_future(client.get("/st/x")) for _ in range(2)]
            try:

                async def both_at_old() -> bool:
                    return old.count == 2

                assert await wait_for(both_at_old, True)
                reloads = runtime.reloads
                assert (await cli(
                    "routes", "set-fallback", "--store", store, "--id", "st",
                    "--upstream", new.url,
                ))[0] == 0  # fmt: skip

                async def reloaded() -> bool:
                    return runtime.reloads > reloads

                assert await wait_for(reloaded, True)
            finally:
                release.set()
                answers = await asyncio.gather(*waiting)
            assert [r.status_code for r in answers] == [502, 502]
            response = await client.get("/st/x")
            assert (response.status_code, response.text) == (200, "new")
    assert new.count == 1


@pytest.mark.anyio
async def test_requests_waiting_on_the_old_url_leave_the_new_url_its_connections(
    tmp_path: Any,
) -> None:
    """`routes set-fallback` moves the fallback off a host that hangs, every one of its
    `max_connections` (100) taken by requests waiting on it. The connection cap was counted
    per upstream name: requests to the new, healthy host waited for the old host's
    connections to free (its first-byte timeout, 30 s by default) and ended 504 in that
    queue. The new url's connections are its own."""
    from tests.test_cli_admin import cli, wait_for

    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    release = asyncio.Event()

    async def hangs(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(status=503, body=b"old")

    async with (
        upstream(status_handler(503)) as primary,
        upstream(hangs) as old,
        upstream(status_handler(200, b"new")) as new,
    ):
        assert (await cli(
            "routes", "add", "--store", store, "--id", "st", "--prefix", "/st/",
            "--upstream", primary.url, "--retries", "1", "--fallback", old.url,
        ))[0] == 0  # fmt: skip
        async with gateway_client({"gateway": {"store": store}}) as (client, gateway):
            runtime = gateway.services.store
            assert runtime is not None
            runtime.poll_interval = 0.05
            cap = gateway.services.table().upstreams["st-fallback"].max_connections
            waiting = [asyncio.ensure_future(client.get("/st/x")) for _ in range(cap)]
            try:

                async def all_taken() -> bool:
                    return old.count == cap

                assert await wait_for(all_taken, True)
                reloads = runtime.reloads
                assert (await cli(
                    "routes", "set-fallback", "--store", store, "--id", "st",
                    "--upstream", new.url,
                ))[0] == 0  # fmt: skip

                async def reloaded() -> bool:
                    return runtime.reloads > reloads

                assert await wait_for(reloaded, True)
                response = await client.get("/st/x", headers={"x-gateway-deadline-ms": "2000"})
                assert (response.status_code, response.text) == (200, "new")
            finally:
                release.set()
                await asyncio.gather(*waiting)


@pytest.mark.anyio
async def test_a_store_reload_forgets_the_upstreams_it_removed(tmp_path: Any) -> None:
    """An SRE's store adds and removes routes for weeks (one per customer job): each
    removed route's upstreams kept their breaker and capacity windows in every gateway
    process for its life (~2 KB a name, without bound). A reload keeps only the state of
    the upstreams its table has; one still served keeps its breaker as it was."""
    from tests.test_cli_admin import cli, wait_for

    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    async with upstream(status_handler(503)) as failing:
        conf = {
            "gateway": {"store": store, "breaker": {"window": 2, "min_calls": 2}},
            "upstreams": {"kept": {"url": failing.url, "rpm": 1000}},
            "routes": [{"id": "kept", "prefix": "/kept/", "plan": ["kept"]}],
        }
        async with gateway_client(conf) as (client, gateway):
            runtime = gateway.services.store
            health = gateway.services.health
            capacity = gateway.services.capacity
            assert runtime is not None
            assert isinstance(health, MemoryHealth)
            runtime.poll_interval = 0.05
            for _ in range(2):
                assert (await client.get("/kept/x")).status_code == 502

            async def reloaded(*command: str) -> None:
                reloads = runtime.reloads
                assert (await cli(*command, "--store", store))[0] == 0

                async def later() -> bool:
                    return runtime.reloads > reloads

                assert await wait_for(later, True)

            for job in range(3):
                await reloaded(
                    "routes", "add", "--id", f"job{job}", "--prefix", f"/job{job}/",
                    "--upstream", failing.url,
                )  # fmt: skip
                for _ in range(2):
                    assert (await client.get(f"/job{job}/x")).status_code == 502
                await reloaded("routes", "remove", "--id", f"job{job}")
            assert set(health._breakers) == {"kept"}
            assert set(capacity._capacity) <= {"kept"}  # type: ignore[attr-defined]
            assert health._breakers["kept"].state == "open"  # still served: as it was


@pytest.mark.anyio
@pytest.mark.parametrize("state", ["memory", "redis"])
async def test_an_upstream_removed_and_added_again_at_its_url(
    state: str, request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    """docs/health.md: a route removed and added again with the same url starts with a
    closed breaker in a `memory://` process (it forgot the removed upstream), and keeps
    the shared breaker with `redis://` until its key expires (the shared state is the
    name's and url's: it cannot tell the re-add from a process that never saw the
    removal). Both as documented, so neither changes unnoticed."""
    from tests.test_cli_admin import cli, wait_for

    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    state_url = "memory://" if state == "memory" else request.getfixturevalue("redis_url")
    async with upstream(status_handler(503)) as failing:
        add = [
            "routes", "add", "--store", store, "--id", "job", "--prefix", "/job/",
            "--upstream", failing.url,
        ]  # fmt: skip
        assert (await cli(*add))[0] == 0
        conf = {
            "gateway": {
                "store": store,
                "state": state_url,
                "breaker": {"window": 2, "min_calls": 2, "cooldown_ms": 60_000},
            }
        }
        async with gateway_client(conf) as (client, gateway):
            runtime = gateway.services.store
            assert runtime is not None
            runtime.poll_interval = 0.05

            async def reloaded(*command: str) -> None:
                reloads = runtime.reloads
                assert (await cli(*command))[0] == 0

                async def later() -> bool:
                    return runtime.reloads > reloads

                assert await wait_for(later, True)

            for _ in range(2):
                assert (await client.get("/job/x")).status_code == 502
            assert (await client.get("/job/x")).status_code == 503  # open: skipped
            await reloaded("routes", "remove", "--store", store, "--id", "job")
            await reloaded(*add)
            response = await client.get("/job/x")
    if state == "memory":
        assert response.status_code == 502 and failing.count == 3  # a fresh breaker
    else:
        assert response.status_code == 503 and failing.count == 2  # the shared one, open
        assert response.headers["x-gateway-skipped"] == "job-primary;reason=breaker_open"


@pytest.mark.anyio
async def test_a_probe_cancelled_while_its_capacity_is_counted_frees_its_slot(
    redis_url: str,
) -> None:
    """The breaker admits the half-open probe, then the upstream's declared rpm is counted
    in Redis (a round trip): the request cancelled then (its client gone, the host's stop)
    left the probe slot held for nobody for the probe's whole lease, every request
    skipping the upstream meanwhile. The gate gives the admission back."""
    answer = {"status": 503}

    async def handle(request: web.Request) -> web.StreamResponse:
        return web.Response(status=answer["status"], body=b"primary")

    health = RedisHealth(redis_url, BreakerConfig(**BREAKER))
    async with upstream(handle) as primary:
        conf = config({"primary": primary}, ["primary"], state=redis_url)
        conf["upstreams"]["primary"]["rpm"] = 100_000
        async with gateway_client(conf, health=health) as (client, gateway):
            for _ in range(3):
                assert (await client.get("/v1/x")).status_code == 502
            assert (await client.get("/v1/x")).status_code == 503  # open: skipped
            await asyncio.sleep(0.15)
            answer["status"] = 200
            counting = asyncio.Event()
            send_group = health._send_group

            def spy(calls: list[Any]) -> None:  # the real pipeline, watched
                if any(call.item.name == "capacity_admit" for call in calls):
                    counting.set()
                send_group(calls)

            health._send_group = spy  # type: ignore[method-assign]
            health._group = None  # the next group hands over to the spy

            async def receive() -> dict[str, Any]:
                return {"type": "http.request", "body": b"", "more_body": False}

            async def send(message: dict[str, Any]) -> None:
                pass

            probe = asyncio.ensure_future(gateway(http_scope("GET", "/v1/probe"), receive, send))
            await asyncio.wait_for(counting.wait(), 5)
            probe.cancel()  # while the capacity's round trip is out
            await asyncio.gather(probe, return_exceptions=True)
            health._send_group = send_group  # type: ignore[method-assign]
            assert primary.count == 3  # the probe was never sent
            response = await client.get("/v1/x")
            assert response.status_code == 200, "the probe's slot is held for nobody"
            assert primary.count == 4


@pytest.mark.anyio
async def test_a_url_change_is_forgotten_once_across_processes_sharing_a_breaker(
    redis_url: str, tmp_path: Any
) -> None:
    """Two gateway processes on one Redis state see one `routes set-fallback` on their own
    reloads. The first one's forget gave the new url a closed breaker, the new url then
    failed and opened it; the second process's reload dropped that breaker again, so every
    process sent traffic to the broken host as if nothing had been learned. A change of url
    is forgotten once: the later reloads of the same change leave the breaker alone."""
    from fallback_mw.store.routes import open_store
    from tests.test_cli_admin import cli, wait_for

    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(503)) as old,
        upstream(status_handler(503)) as new,
    ):
        assert (await cli(
            "routes", "add", "--store", store, "--id", "st", "--prefix", "/st/",
            "--upstream", primary.url, "--retries", "1", "--fallback", old.url,
        ))[0] == 0  # fmt: skip
        conf = {
            "gateway": {"store": store, "state": redis_url,
                        "breaker": {"window": 2, "min_calls": 2, "cooldown_ms": 60_000}},
        }  # fmt: skip
        async with (
            gateway_client(conf) as (one, first),
            gateway_client(conf) as (two, second),
        ):
            runtime, other = first.services.store, second.services.store
            assert runtime is not None and other is not None
            runtime.poll_interval = other.poll_interval = 3600.0
            for _ in range(2):
                assert (await one.get("/st/x")).status_code == 502
            assert (await two.get("/st/x")).headers["x-gateway-skipped"] == (
                "st-primary;reason=breaker_open, st-fallback;reason=breaker_open"
            )
            await asyncio.sleep(1.2)  # each reloader's first wait (1 s) is over
            assert (await cli(
                "routes", "set-fallback", "--store", store, "--id", "st", "--upstream", new.url,
            ))[0] == 0  # fmt: skip

            async def reload(runtime: Any) -> None:
                route_store = open_store(store)
                try:
                    await runtime.refresh(route_store)
                finally:
                    await route_store.aclose()

            await reload(runtime)  # the first process: the new url starts closed
            assert (await one.get("/st/x")).status_code == 502  # two attempts at it
            assert new.count == 2  # ... whose failures opened the shared breaker
            assert (await one.get("/st/x")).status_code == 503
            await reload(other)  # the second process sees the same change later

            async def reloaded() -> bool:
                return other.reloads > 1

            assert await wait_for(reloaded, True)
            response = await two.get("/st/x")
            assert response.status_code == 503
            assert response.headers["x-gateway-skipped"] == (
                "st-primary;reason=breaker_open, st-fallback;reason=breaker_open"
            )
    assert new.count == 2


@pytest.mark.anyio
async def test_a_hedge_that_is_the_probe_is_judged_by_its_own_answer() -> None:
    """The first attempt was admitted while the breaker was closed; the breaker opened and
    half-opened meanwhile, so the hedge at the same upstream is the probe. The hedge's head
    won, and the first attempt, cancelled as the loser, released the slot by upstream name:
    the probe's, so the probe's own success, booked next, was ignored and the breaker stayed
    half-open. Each attempt now ends its own admission: the probe's success closes it."""
    gates = {"first": asyncio.Event(), "hedge": asyncio.Event()}
    arrivals: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path.endswith("/fail"):
            return web.Response(status=503)
        if request.path.endswith("/race"):
            arrivals.append("race")
            if len(arrivals) == 1:
                await gates["first"].wait()
                return web.Response(status=503)
            await gates["hedge"].wait()
        return web.Response(body=b"primary")

    clock = Clock()
    health = MemoryHealth(BreakerConfig(**BREAKER), clock=clock)
    async with upstream(handle) as primary:
        conf = config({"primary": primary}, ["primary"], retries=1, hedge_after_ms=1000)
        async with gateway_client(conf, health=health) as (client, _):
            race = asyncio.ensure_future(client.get("/v1/race"))
            await wait_for_count(primary, 1)  # admitted by the closed breaker
            for _ in range(2):  # 3 failures (a retry each, the second skipped): open
                assert (await client.get("/v1/fail")).status_code == 502
            assert health.breaker("primary").state == "open"
            assert primary.count == 4
            clock.now += 0.1  # the cooldown is over: the hedge will be the half-open probe
            await wait_for_count(primary, 5)
            assert health.breaker("primary").state == "half_open"
            gates["hedge"].set()  # the probe's head wins; the first attempt is cancelled
            response = await race
            gates["first"].set()
            assert (response.status_code, response.text) == (200, "primary")
            assert health.breaker("primary").state == "closed"
            response = await client.get("/v1/x")
            assert response.text == "primary", response.headers.get("x-gateway-skipped")
