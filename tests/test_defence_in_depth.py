"""Defence in depth and the design asks nothing else checked (issue 21).

Each test here is named in scripts/mutants.py beside the mutation it must catch: the two
guards for what cannot be repeated, the runtime "no usable credential → skip" rule, no
backoff between different candidates, the same path for every candidate, forged
`x-gateway-*` request headers, each candidate's own first-byte timeout, and a replay that
keeps the rewritten model with a consistent Content-Length.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import httpx
import pytest
from aiohttp import web

from fallback_mw import CredentialInjector, Gateway, PlanWalker, RouteResolver, load_config
from fallback_mw.failover.decide import WalkState, decide, further_attempt_possible
from fallback_mw.failover.outcome import Outcome
from fallback_mw.failover.replay import attempt_ceiling
from fallback_mw.request.context import RequestContext, get_context
from fallback_mw.request.types import Receive, Scope, Send
from tests.helpers import client_for
from tests.upstreams import host_app, serve_asgi, silent_server, status_handler, upstream

pytestmark = pytest.mark.anyio

ENV = {"PRIMARY_KEY": "sk-primary-0001", "BACKUP_KEY": "sk-backup-0002"}


def config_for(primary: str, backup: str, **route: Any) -> dict[str, Any]:
    return {
        "gateway": {"max_request_body": 1 << 20, "replay_buffer": 4096},
        "upstreams": {
            "primary": {"url": primary, "auth_env": "PRIMARY_KEY", "first_byte_timeout_ms": 5000},
            "backup": {"url": backup, "auth_env": "BACKUP_KEY", "first_byte_timeout_ms": 5000},
        },
        "routes": [
            {
                "id": "chat",
                "prefix": "/v1/",
                "plan": ["primary", "backup"],
                "retries": 1,
                "backoff_ms": 0,
                **route,
            }
        ],
    }


class Recorded:
    """An ASGI wrapper that keeps each request's context (attempt records) after the walk."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.contexts: list[RequestContext] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            context = get_context(scope)
            if context is not None:
                self.contexts.append(context)


# --- two guards for what cannot be repeated -------------------------------------------------


def _state(*, replayable: bool, ceiling: int) -> WalkState:
    return WalkState(
        replayable=replayable,
        client_connected=True,
        deadline_left=True,
        response_started=False,
        attempts_made=1,
        attempt_ceiling=ceiling,
        failover_status=frozenset({503}),
    )


def test_the_ceiling_guard_alone_stops_a_replay() -> None:
    route = load_config(config_for("http://127.0.0.1:1", "http://localhost:2"), environ=ENV)
    chat = route.routes[0]
    assert attempt_ceiling(chat, replayable=True) == chat.attempt_ceiling == 2
    assert attempt_ceiling(chat, replayable=False) == 1
    # Eligibility wrongly saying "replayable": the ceiling of 1 still ends the walk.
    state = _state(replayable=True, ceiling=attempt_ceiling(chat, replayable=False))
    assert not further_attempt_possible(state)
    assert decide(Outcome("status", 503), state).error == "upstream_failed"


def test_the_eligibility_guard_alone_stops_a_replay() -> None:
    # A ceiling wrongly left at 1 + retries: eligibility still says no.
    state = _state(replayable=False, ceiling=2)
    assert not further_attempt_possible(state)
    decision = decide(Outcome("status", 503), state)
    assert (decision.action, decision.error) == ("local_error", "upstream_failed")


async def test_a_streamed_body_is_not_replayed_after_it_was_consumed() -> None:
    # A declared length over replay_buffer: the body streams to the primary as it arrives
    # and is gone after that attempt. POST is replayable on this route; the body is not.
    chunk = b"s" * 1024

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(8):
            yield chunk

    async def consume_then_503(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(status=503)

    async with upstream(consume_then_503) as p, upstream(status_handler(200, b"b")) as b:
        conf = config_for(p.url, b.url, replayable_methods=["GET", "POST"])
        gateway = Gateway(host_app, config=conf, environ=ENV)
        async with serve_asgi(gateway) as url, httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/v1/upload", content=chunks(), headers={"content-length": str(8 * 1024)}
            )
        await gateway.aclose()
    assert p.count == 1 and p.received[0].body == chunk * 8
    assert b.count == 0
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_failed"


# --- the runtime credential skip ------------------------------------------------------------


def layers(conf: dict[str, Any], environ: dict[str, str]) -> tuple[PlanWalker, Any]:
    """The public layers over a configuration loaded without the environment check (a
    variable unset at run time, as after a rotation)."""
    config = load_config(conf, check_env=False)
    walker = PlanWalker(host_app, config=config, environ=environ)
    app = RouteResolver(CredentialInjector(walker, config=config, environ=environ), config=config)
    return walker, app


async def test_a_backup_without_its_credential_is_skipped_never_sent_bare() -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(200, b"b")) as b:
        walker, layered = layers(config_for(p.url, b.url), {"PRIMARY_KEY": ENV["PRIMARY_KEY"]})
        app = Recorded(layered)
        async with client_for(app) as client:
            response = await client.get("/v1/models", headers={"authorization": "Bearer caller"})
        await walker.aclose()
    assert b.count == 0  # never sent a request without its Authorization
    # The skip cost no attempt: the second of the ceiling's two went to the primary again
    # (a single credential may be repeated on a later pass).
    assert p.count == 2
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_failed"
    assert response.headers["x-gateway-attempts"] == "2"
    (context,) = app.contexts
    assert [(s.candidate, s.reason) for s in context.skipped] == [("backup", "no_credential")]
    assert response.headers["x-gateway-skipped"] == "backup;reason=no_credential"


async def test_a_primary_without_its_credential_is_skipped_and_costs_no_attempt() -> None:
    async with upstream(status_handler(200, b"p")) as p, upstream(status_handler(200, b"b")) as b:
        walker, app = layers(config_for(p.url, b.url), {"BACKUP_KEY": ENV["BACKUP_KEY"]})
        async with client_for(app) as client:
            response = await client.get("/v1/models", headers={"authorization": "Bearer caller"})
        await walker.aclose()
    assert p.count == 0
    assert (response.status_code, response.content) == (200, b"b")
    assert response.headers["x-gateway-attempts"] == "1"
    assert ("authorization", f"Bearer {ENV['BACKUP_KEY']}") in b.received[0].headers
    assert all(value != "Bearer caller" for _, value in b.received[0].headers)


async def test_a_hedge_never_goes_out_without_its_credential() -> None:
    """A hedge at a pool upstream uses another credential of the pool; one whose variable
    is unset at run time (a rotation) is never used: the hedge is not started, and the
    first attempt runs on. Never a request without its credential."""
    calls = 0

    async def first_slow(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(0.4)
        return web.Response(text=f"answer {calls}")

    async with upstream(first_slow) as p, upstream(status_handler(200, b"b")) as b:
        conf = config_for(p.url, b.url, retries=2, hedge_after_ms=50)
        conf["upstreams"]["primary"]["auth_env"] = ["PRIMARY_KEY", "PRIMARY_KEY_2"]
        walker, app = layers(conf, {"PRIMARY_KEY": ENV["PRIMARY_KEY"]})
        async with client_for(app) as client:
            response = await client.get("/v1/models", headers={"authorization": "Bearer caller"})
        await walker.aclose()
    assert (response.status_code, response.text) == (200, "answer 1")
    assert response.headers["x-gateway-attempts"] == "1"
    assert p.count == 1 and b.count == 0
    assert ("authorization", f"Bearer {ENV['PRIMARY_KEY']}") in p.received[0].headers


# --- no backoff between different candidates ------------------------------------------------


async def test_no_backoff_between_different_candidates() -> None:
    # backoff_ms is only for repeating a candidate already tried (SPEC §5). With 2 s of
    # backoff, a gap of under 1 s between the primary's end and the backup's start (the
    # attempt records' own timestamps) cannot be a backoff, however loaded the machine.
    async with upstream(status_handler(503)) as p, upstream(status_handler(200, b"b")) as b:
        app = Recorded(
            Gateway(host_app, config=config_for(p.url, b.url, backoff_ms=2000), environ=ENV)
        )
        async with client_for(app) as client:
            response = await client.get("/v1/models")
        await app.app.aclose()
    assert response.status_code == 200
    (context,) = app.contexts
    first, second = context.attempts
    assert (first.candidate, second.candidate) == ("primary", "backup")
    assert first.duration is not None
    gap = second.started - (first.started + first.duration)
    assert 0 <= gap < 1.0, f"{gap:.3f} s between different candidates"


async def test_backoff_only_before_repeating_a_candidate() -> None:
    # The same measure on the third attempt (back at the primary) sees the backoff: the
    # test above would catch a backoff that never happens only through this one.
    handler = status_handler(503)
    async with upstream(handler) as p, upstream(handler) as b:
        conf = config_for(p.url, b.url, backoff_ms=300, retries=2)
        app = Recorded(Gateway(host_app, config=conf, environ=ENV))
        async with client_for(app) as client:
            response = await client.get("/v1/models")
        await app.app.aclose()
    assert response.status_code == 502
    (context,) = app.contexts
    names = [a.candidate for a in context.attempts]
    assert names == ["primary", "backup", "primary"]
    second, third = context.attempts[1:]
    assert second.duration is not None
    assert third.started - (second.started + second.duration) >= 0.3


# --- the same request for every candidate ---------------------------------------------------


async def test_every_candidate_gets_the_same_path_and_query() -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=config_for(p.url, b.url), environ=ENV)
        async with client_for(gateway) as client:
            response = await client.get("/v1/chat/deep/path?a=1&b=two")
        await gateway.aclose()
    assert response.status_code == 200
    assert [r.path for r in (*p.received, *b.received)] == ["/v1/chat/deep/path"] * 2
    assert [r.query for r in (*p.received, *b.received)] == ["a=1&b=two"] * 2


async def test_forged_gateway_headers_change_nothing() -> None:
    forged = {
        "x-gateway-attempts": "0",
        "x-gateway-provider": "backup",
        "x-gateway-route": "other",
        "x-gateway-retries": "9",
        "x-gateway-canary": "1",
    }
    handler = status_handler(503)
    async with upstream(handler) as p, upstream(handler) as b:
        gateway = Gateway(host_app, config=config_for(p.url, b.url, retries=1), environ=ENV)
        async with client_for(gateway) as client:
            response = await client.get("/v1/models", headers=forged)
        await gateway.aclose()
    # The walk's bound is the route's: two attempts, the 502 of an exhausted plan.
    assert response.status_code == 502
    assert response.headers["x-gateway-attempts"] == "2"
    assert response.headers["x-gateway-route"] == "chat"
    assert "x-gateway-provider" not in response.headers
    assert "x-gateway-canary" not in response.headers
    for received in (*p.received, *b.received):
        assert not [k for k, _ in received.headers if k.startswith("x-gateway-")]


async def test_a_forged_deadline_cannot_lengthen_the_walk() -> None:
    # Route deadline 400 ms, the primary never answers (its first byte would time out only
    # after 3 s): the caller's 9999999 ms cannot buy the walk the time to reach the backup.
    async with silent_server() as (silent, _), upstream(status_handler(200)) as b:
        conf = config_for(silent, b.url, deadline_ms=400)
        conf["upstreams"]["primary"]["first_byte_timeout_ms"] = 3000
        gateway = Gateway(host_app, config=conf, environ=ENV)
        async with client_for(gateway) as client:
            response = await client.get("/v1/models", headers={"x-gateway-deadline-ms": "9999999"})
        await gateway.aclose()
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert b.count == 0


# --- each candidate its own timeouts --------------------------------------------------------


async def test_each_candidate_gets_its_own_first_byte_timeout() -> None:
    # The primary's first byte times out after 300 ms; the backup takes 2 s to answer, well
    # inside its own 5 s first-byte timeout: it is served, not timed out with the primary's.
    async with (
        silent_server() as (silent, accepted),
        upstream(status_handler(200, b"slow but fine", delay=2.0)) as b,
    ):
        conf = config_for(silent, b.url, deadline_ms=20_000)
        conf["upstreams"]["primary"]["first_byte_timeout_ms"] = 300
        app = Recorded(Gateway(host_app, config=conf, environ=ENV))
        async with client_for(app) as client:
            response = await client.get("/v1/models")
        await app.app.aclose()
    assert (response.status_code, response.content) == (200, b"slow but fine")
    assert accepted and b.count == 1
    (context,) = app.contexts
    first, second = context.attempts
    assert first.failure_kind == "timeout"
    assert second.status == 200 and second.duration is not None and second.duration >= 2.0


@contextmanager
def saturated_listener() -> Iterator[str]:
    """A listener whose accept queue is full: a further connect is never answered (the
    SYN is dropped), so only the connect timeout ends it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for filler in fillers:
            filler.close()
        server.close()


async def test_each_candidate_gets_its_own_connect_timeout() -> None:
    # The primary never completes a connect: its own 300 ms connect timeout ends the
    # attempt, not the backup's 5 s (nor its own 10 s first byte). The backup connects at
    # once and is served.
    async with upstream(status_handler(200, b"backup")) as b:
        with saturated_listener() as unreachable:
            conf = config_for(unreachable, b.url, deadline_ms=30_000)
            conf["upstreams"]["primary"].update(
                connect_timeout_ms=300, first_byte_timeout_ms=10_000
            )
            conf["upstreams"]["backup"]["connect_timeout_ms"] = 5000
            app = Recorded(Gateway(host_app, config=conf, environ=ENV))
            async with client_for(app) as client:
                response = await client.get("/v1/models")
            await app.app.aclose()
    assert (response.status_code, response.content) == (200, b"backup")
    (context,) = app.contexts
    first, second = context.attempts
    assert second.candidate == "backup" and second.status == 200
    assert first.failure_kind == "timeout" and first.duration is not None
    assert first.duration < 2.5, f"the primary's connect took {first.duration:.2f} s"


# --- a replay keeps the rewritten model -----------------------------------------------------


async def test_a_replay_keeps_each_candidates_model_and_a_consistent_length() -> None:
    handler = status_handler(503)
    async with upstream(handler) as p, upstream(handler) as b:
        conf = config_for(p.url, b.url, retries=2, replayable_methods=["POST"])
        conf["upstreams"]["primary"]["model"] = "model-primary"
        conf["upstreams"]["backup"]["model"] = "model-backup-longer-name"
        gateway = Gateway(host_app, config=conf, environ=ENV)
        body = {"model": "asked", "messages": [{"role": "user", "content": "héllo"}]}
        async with client_for(gateway) as client:
            response = await client.post("/v1/chat/completions", json=body)
        await gateway.aclose()
    assert response.status_code == 502
    assert (p.count, b.count) == (2, 1)  # primary, backup, primary again
    expected = {"primary": "model-primary", "backup": "model-backup-longer-name"}
    for name, server in (("primary", p), ("backup", b)):
        for received in server.received:
            sent = json.loads(received.body)
            assert sent["model"] == expected[name]
            assert sent["messages"] == body["messages"]
            lengths = [v for k, v in received.headers if k == "content-length"]
            assert lengths == [str(len(received.body))]
