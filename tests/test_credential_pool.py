"""The credential pool as designed (SPEC §12): affinity keyed by (route, model, session),
`selection = "round_robin" | "score"`, and a 429 that says the quota is spent told apart
from a plain rate limit; and `usage --incidents`. Through the whole gateway against real
upstream servers, on the memory state (a hand-driven clock where expiry matters) and on
the real Redis."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from aiohttp import web

from fallback_mw import ConfigError, Gateway, load_config
from fallback_mw.budget import AttemptOutcome, UsageRecord
from fallback_mw.cli import main
from fallback_mw.cli.usage import incident_kinds
from fallback_mw.health.memory import MemoryHealth
from fallback_mw.health.pool import (
    CredentialStats,
    affinity_key,
    credential_mark,
    retry_after_seconds,
    score,
)
from fallback_mw.health.quota import parse_duration, peek_quota, quota_reset
from fallback_mw.store.ledgers import open_ledger
from tests.helpers import client_for
from tests.upstreams import Upstream, host_app, serve_asgi, status_handler, upstream

pytestmark = pytest.mark.anyio

ENV = {"KEY_A": "key-a", "KEY_B": "key-b", "KEY_C": "key-c"}
QUOTA_BODY = json.dumps(
    {"error": {"message": "You exceeded your current quota (ref q-7c1f)", "type":
               "insufficient_quota", "code": "insufficient_quota"}}
).encode()  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key_of(request: web.Request) -> str:
    return request.headers.get("authorization", "").removeprefix("Bearer ")


def keys_used(up: Upstream) -> list[str]:
    return [dict(r.headers).get("authorization", "").removeprefix("Bearer ") for r in up.received]


def pool_config(url: str, *, state: str = "memory://", **upstream_keys: Any) -> dict[str, Any]:
    return {
        "gateway": {"state": state},
        "upstreams": {
            "pool": {"url": url, "auth_env": ["KEY_A", "KEY_B", "KEY_C"], **upstream_keys}
        },
        "routes": [
            {"id": "one", "prefix": "/v1/", "plan": ["pool"], "retries": 2, "backoff_ms": 0},
            {"id": "two", "prefix": "/v2/", "plan": ["pool"], "retries": 2, "backoff_ms": 0},
        ],
    }


@asynccontextmanager
async def gateway_client(conf: dict[str, Any], **kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    gateway = Gateway(host_app, config=conf, environ=ENV, **kwargs)
    try:
        async with client_for(gateway) as client:
            yield client
    finally:
        await gateway.aclose()


async def served_by(
    client: httpx.AsyncClient, path: str, *, session: str | None = None, model: str = "m1"
) -> str:
    headers = {"x-session-id": session} if session else {}
    response = await client.post(path, json={"model": model, "messages": []}, headers=headers)
    assert response.status_code == 200, response.text
    return response.text


async def echo_key(request: web.Request) -> web.StreamResponse:
    return web.Response(text=key_of(request))


# --- affinity ---------------------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
def state(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    url: str = request.getfixturevalue("redis_url")
    return url


async def test_affinity_is_keyed_by_route_model_and_session(state: str) -> None:
    bound = {}
    async with upstream(echo_key) as pool, gateway_client(pool_config(pool.url, state=state)) as c:
        for path, model in (("/v1/chat", "m1"), ("/v2/chat", "m1"), ("/v1/chat", "m2")):
            keys = {await served_by(c, path, session="s1", model=model) for _ in range(3)}
            assert len(keys) == 1, f"{path} {model}: the session moved while healthy"
            bound[(path, model)] = keys.pop()
    # The same session on another route, or asking for another model, is bound on its own:
    # keyed by the session alone, all three would share one credential.
    assert len(set(bound.values())) == 3, bound


def test_the_affinity_key_names_route_model_and_session() -> None:
    assert affinity_key("r", "m", None) is None
    keys = {affinity_key("r", "m", "s"), affinity_key("r2", "m", "s"), affinity_key("r", None, "s")}
    assert len(keys) == 3


def test_a_huge_session_id_is_remembered_by_a_short_key() -> None:
    """A caller's session header may be up to max_header_bytes (64 KiB): the memory pool
    remembers 10,000 sessions per upstream, so kept whole they were some 640 MiB. A long
    key is kept as its digest: still one key per (route, model, session)."""
    long_a, long_b = "a" * 60_000, "a" * 59_999 + "b"
    key_a, key_b = affinity_key("r", "m", long_a), affinity_key("r", "m", long_b)
    assert key_a is not None and key_b is not None
    assert len(key_a) <= 256 and len(key_b) <= 256
    assert key_a != key_b and key_a == affinity_key("r", "m", long_a)
    assert affinity_key("r", "m", "s1") == "r\x1fm\x1fs1"  # a usual one stays as it is


# --- selection --------------------------------------------------------------------------


def slow_key(slow: str, delay: float) -> Any:
    async def handle(request: web.Request) -> web.StreamResponse:
        import asyncio

        if key_of(request) == slow:
            await asyncio.sleep(delay)
        return web.Response(text=key_of(request))

    return handle


@pytest.mark.parametrize("selection", ["round_robin", "score"])
async def test_score_selection_prefers_the_fast_credential(state: str, selection: str) -> None:
    # key-a takes 400 ms to answer, key-b and key-c answer at once. Round robin keeps
    # sending a third of the traffic to key-a; score tries each once, then avoids it.
    async with upstream(slow_key("key-a", 0.4)) as pool:
        conf = pool_config(pool.url, state=state, selection=selection)
        async with gateway_client(conf) as client:
            used = [await served_by(client, "/v1/chat") for _ in range(12)]
    slow = used.count("key-a")
    if selection == "round_robin":
        assert slow == 4
    else:
        assert slow == 1, used  # tried once (untried credentials score highest), then not
        assert set(used) == {"key-a", "key-b", "key-c"}


async def test_score_tries_a_credential_slow_once_again_once_it_has_been_quiet(
    state: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # key-a answered its first request slowly (400 ms), then is as fast as the others. Its
    # mean latency was a ratio of two decayed counts, so it never decayed: long after that
    # one answer (16 half-lives, a weight of 1 in 65,536) key-a still scored
    # 1 / 1.4 and got no traffic at all until its count fell below 1e-9 (30 half-lives:
    # half an hour), where a credential whose failures are long past is tried again.
    half_life = 0.25
    monkeypatch.setattr("fallback_mw.health.pool.SCORE_HALF_LIFE", half_life)
    monkeypatch.setattr("fallback_mw.health.redis_pools.SCORE_HALF_LIFE", half_life)
    slow = {"key-a": 0.4}

    async def slow_once(request: web.Request) -> web.StreamResponse:
        import asyncio

        await asyncio.sleep(slow.pop(key_of(request), 0.0))
        return web.Response(text=key_of(request))

    async with upstream(slow_once) as pool:
        conf = pool_config(pool.url, state=state, selection="score")
        async with gateway_client(conf) as client:
            first = [await served_by(client, "/v1/chat") for _ in range(6)]
            assert first.count("key-a") == 1, first  # tried once, then avoided
            await anyio.sleep(16 * half_life)  # quiet: its slow answer is long past
            later = [await served_by(client, "/v1/chat") for _ in range(6)]
    assert "key-a" in later, later


async def test_round_robin_spreads_evenly_over_the_credentials_left(state: str) -> None:
    # key-a's quota is spent (retired for the hour): round robin must share the traffic
    # between key-b and key-c, not hand key-a's turns to its successor (2/3 on key-b).
    answers = {"key-a": (QUOTA_BODY, {})}
    async with (
        upstream(limited(answers)) as pool,
        gateway_client(pool_config(pool.url, state=state)) as client,
    ):
        await client.get("/v1/x")  # whichever key it meets first, key-a is retired now
        before = len(keys_used(pool))
        for _ in range(12):
            assert (await client.get("/v1/x")).status_code == 200
    used = keys_used(pool)[before:]
    assert "key-a" not in used
    assert (used.count("key-b"), used.count("key-c")) == (6, 6), used


def test_score_is_decayed_success_over_latency() -> None:
    assert score(0, 0, 0) == 1.0  # untried: optimistic
    fast = CredentialStats().add(ok=True, latency=0.01, now=0.0)
    slow = CredentialStats().add(ok=True, latency=0.5, now=0.0)
    failing = CredentialStats().add(ok=False, latency=None, now=0.0)
    assert fast.score(0.0) > slow.score(0.0) > failing.score(0.0)
    # Decayed: an hour later the failure is forgotten and the credential is tried again.
    assert failing.score(3600.0) > 0.99


# --- quota spent vs rate limited --------------------------------------------------------


def limited(answers: dict[str, tuple[bytes, dict[str, str]]]) -> Any:
    """429 with the given body and headers for the keys in `answers`, 200 for the rest."""

    async def handle(request: web.Request) -> web.StreamResponse:
        key = key_of(request)
        if key in answers:
            body, headers = answers[key]
            return web.Response(status=429, body=body, headers=headers)
        return web.Response(text=key)

    return handle


def gemini_429(quota_id: str, retry_delay: str) -> bytes:
    """Gemini's 429 body: RESOURCE_EXHAUSTED, the quota in QuotaFailure, when to come back
    in RetryInfo (its only word on it: no Retry-After header)."""
    rpc = "type.googleapis.com/google.rpc."
    return json.dumps(
        {"error": {"code": 429, "status": "RESOURCE_EXHAUSTED",
                   "message": "You exceeded your current quota (ref q-7c1f)",
                   "details": [
                       {"@type": rpc + "QuotaFailure", "violations": [
                           {"quotaMetric": "generativelanguage.googleapis.com/"
                                           "generate_content_free_tier_requests",
                            "quotaId": quota_id, "quotaValue": "50"}]},
                       {"@type": rpc + "Help", "links": [{"url": "https://ai.google.dev"}]},
                       {"@type": rpc + "RetryInfo", "retryDelay": retry_delay}]}}
    ).encode()  # fmt: skip


def two_keys(url: str, **upstream_keys: Any) -> dict[str, Any]:
    conf = pool_config(url, **upstream_keys)
    conf["upstreams"]["pool"]["auth_env"] = ["KEY_A", "KEY_B"]
    conf["routes"] = conf["routes"][:1]
    return conf


async def key_a_back_after(client: httpx.AsyncClient, pool: Upstream) -> bool:
    """Whether key-a is asked again within a few requests (round robin over two keys)."""
    before = keys_used(pool).count("key-a")
    for _ in range(4):
        await client.get("/v1/x")
    return keys_used(pool).count("key-a") > before


@pytest.mark.parametrize(
    ("answer", "retired_for"),
    [
        # OpenAI: insufficient_quota in the body, no reset given -> quota_retire_ms (600 s)
        ((QUOTA_BODY, {"retry-after": "20"}), 600.0),
        # headers: nothing remaining, the reset in 2 minutes
        (
            (
                b'{"error": {"code": "rate_limit_exceeded"}}',
                {
                    "x-ratelimit-remaining-requests": "0",
                    "x-ratelimit-reset-requests": "2m0s",
                    "retry-after": "20",
                },
            ),
            120.0,
        ),
        # a plain rate limit: cools down for Retry-After (20 s) only
        ((b'{"error": {"code": "rate_limit_exceeded"}}', {"retry-after": "20"}), 20.0),
        # the reset in 2 s, Retry-After 20 s: the upstream said when to come back (the
        # key was asked again 2 s later, against it)
        (
            (
                b'{"error": {"code": "rate_limit_exceeded"}}',
                {
                    "x-ratelimit-remaining-tokens": "0",
                    "x-ratelimit-reset-tokens": "2s",
                    "retry-after": "20",
                },
            ),
            20.0,
        ),
        # OpenAI / Azure OpenAI: `retry-after-ms` (their SDKs read it first) over the
        # coarser Retry-After; it was ignored (cooldown_ms, 5 s, instead of 30 s).
        (
            (
                b'{"error": {"code": "rate_limit_exceeded"}}',
                {"retry-after-ms": "30000", "retry-after": "1"},
            ),
            30.0,
        ),
        # Gemini: no Retry-After, RESOURCE_EXHAUSTED with when to come back in RetryInfo;
        # a per-day quota is spent until then, a per-minute one is a rate limit
        ((gemini_429("GenerateRequestsPerDayPerProjectPerModel-FreeTier", "120s"), {}), 120.0),
        ((gemini_429("GenerateRequestsPerMinutePerProjectPerModel", "20.5s"), {}), 20.5),
    ],
    ids=[
        *("quota-body", "quota-headers", "rate-limited", "reset-sooner-than-retry-after"),
        *("retry-after-ms", "gemini-per-day", "gemini-per-minute"),
    ],
)
async def test_a_spent_quota_retires_until_its_reset_a_rate_limit_cools_down(
    answer: tuple[bytes, dict[str, str]], retired_for: float, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    answers = {"key-a": answer}
    clock = Clock()
    health = MemoryHealth(clock=clock)
    async with upstream(limited(answers)) as pool:
        conf = two_keys(pool.url, quota_retire_ms=600_000)
        async with gateway_client(conf, health=health) as client:
            response = await client.get("/v1/x")  # key-a: 429, then key-b within the request
            assert (response.status_code, response.text) == (200, "key-b")
            assert keys_used(pool) == ["key-a", "key-b"]
            answers.clear()  # key-a would answer now: only its mark keeps it out
            clock.now += retired_for - 5
            assert not await key_a_back_after(client, pool)
            clock.now += 10
            assert await key_a_back_after(client, pool)
    # The 429's body is read to decide, never logged.
    assert "q-7c1f" not in caplog.text and "exceeded" not in caplog.text


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_a_429_body_is_relayed_whole_after_the_peek(engine: str) -> None:
    # Every key spent: the last 429 is served, every byte of a body longer than the peek.
    body = json.dumps({"error": {"code": "insufficient_quota", "pad": "x" * 20_000}}).encode()
    answers: dict[str, tuple[bytes, dict[str, str]]] = {k: (body, {}) for k in ("key-a", "key-b")}
    async with upstream(limited(answers)) as pool:
        conf = two_keys(pool.url)
        conf["gateway"]["engine"] = engine
        async with gateway_client(conf) as client:
            response = await client.get("/v1/x")
    assert response.status_code == 429
    assert response.content == body
    assert sorted(keys_used(pool)) == ["key-a", "key-b"]


async def test_a_pool_with_every_key_spent_says_what_brings_one_back() -> None:
    answers: dict[str, tuple[bytes, dict[str, str]]] = {
        k: (QUOTA_BODY, {}) for k in ("key-a", "key-b")
    }
    async with upstream(limited(answers)) as pool, gateway_client(two_keys(pool.url)) as client:
        assert (await client.get("/v1/x")).status_code == 429  # both keys retired
        response = await client.get("/v1/x")
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["rule"]) == (
        503,
        "route_exhausted",
        "no_candidate",
    )
    assert response.headers["x-gateway-skipped"] == "pool;reason=no_credential"
    assert "quota_retire_ms" in error["message"]
    assert "auth_env pool" in error["message"]
    assert "the plan of route 'one' would be tried" in error["message"]
    assert len(pool.received) == 2  # the second request reached no upstream


async def test_a_pool_with_every_key_revoked_names_its_variables_not_a_429(state: str) -> None:
    """Every credential answered 401: retired for good. The 503 said a quota 429's reset or
    a Retry-After would bring one back (neither will) and never named a variable; it names
    the pool's variables and what to do, and sends no Retry-After."""
    async with (
        upstream(status_handler(401)) as pool,
        gateway_client(pool_config(pool.url, state=state)) as client,
    ):
        assert (await client.get("/v1/x")).status_code == 401  # all three keys retired
        response = await client.get("/v1/x")
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (503, "route_exhausted")
    assert "retry-after" not in response.headers
    message = error["message"]
    assert "every credential of 'pool' answered 401" in message
    assert "KEY_A, KEY_B, KEY_C" in message
    assert "429" not in message and "Retry-After" not in message
    assert "key-a" not in message  # a variable's name, never its value
    assert pool.count == 3


async def test_a_revoked_pool_is_named_also_when_another_candidate_is_at_its_capacity() -> None:
    """The same 503 with the fallback skipped too, for its declared rpm: the Retry-After
    look-up stops at a capacity skip (nothing it could say beats a minute's turn) before
    it had noted the revoked pool, so the message fell back to the 429 cool-downs and
    resets and never named the pool's variables or what to do with them."""
    async with (
        upstream(status_handler(401)) as pool,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        conf = pool_config(pool.url)
        conf["upstreams"]["backup"] = {"url": backup.url, "rpm": 1}
        conf["routes"] = [
            {"id": "one", "prefix": "/v1/", "plan": ["pool", "backup"], "retries": 3,
             "backoff_ms": 0},
            {"id": "spend", "prefix": "/v2/", "plan": ["backup"], "retries": 0},
        ]  # fmt: skip
        async with gateway_client(conf) as client:
            assert (await client.get("/v1/x")).status_code == 401  # all three keys retired
            assert (await client.get("/v2/x")).text == "backup"  # its rpm of 1 is spent
            response = await client.get("/v1/x")
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (503, "route_exhausted")
    assert response.headers["x-gateway-skipped"] == (
        "pool;reason=no_credential, backup;reason=capacity"
    )
    message = error["message"]
    assert "every credential of 'pool' answered 401" in message, message
    # Not the quota-429 text of a pool that comes back (the capacity skip's own remedy
    # names Retry-After: the rolling minute's room).
    assert "quota 429" not in message and "plain 429" not in message
    assert "KEY_A, KEY_B, KEY_C" in message
    assert (pool.count, backup.count) == (3, 1)


async def revoked(request: web.Request) -> web.StreamResponse:
    return web.Response(status=401, text="revoked " + key_of(request))


@pytest.mark.parametrize(
    ("plan", "sibling", "repeats"),
    [
        (["pool", "backup"], "cooling", None),  # key-b cooling from an earlier 429
        (["pool"], "cooling", None),
        (["pool", "backup"], "healthy", {"percent": 0, "min_per_second": 0}),  # repeats off
    ],
    ids=["sibling-cooling-with-fallback", "sibling-cooling-alone", "repeat-allowance-spent"],
)
async def test_a_401_the_pool_cannot_retry_is_served_as_is_never_failed_over(
    plan: list[str], sibling: str, repeats: dict[str, int] | None
) -> None:
    # SPEC §5: a 401 is served as-is; within a pool it may move to another credential of
    # the same upstream. When no other credential can be tried (cooling, or the repeat
    # allowance refuses the move), the caller gets the 401, not another upstream's answer
    # and not a 502 "all attempts failed".
    health = MemoryHealth()
    async with upstream(revoked) as pool, upstream(status_handler(200)) as backup:
        conf = two_keys(pool.url)
        conf["upstreams"]["backup"] = {"url": backup.url}
        conf["routes"][0]["plan"] = plan
        if repeats is not None:
            conf["gateway"]["repeat_budget"] = repeats
        if sibling == "cooling":
            await health.pick_credential("pool", 2, exclude=frozenset(), session=None)
            await health.credential_result(
                "pool", 1, status=429, failure=False, retry_after=60, session=None
            )
        async with gateway_client(conf, health=health) as client:
            response = await client.get("/v1/x")
    assert (response.status_code, response.text) == (401, "revoked key-a"), response.headers
    assert keys_used(pool) == ["key-a"]
    assert backup.count == 0
    assert response.headers["x-gateway-provider"] == "pool"
    reason = "no_credential" if sibling == "cooling" else "repeat_budget"
    assert response.headers["x-gateway-skipped"] == f"pool;reason={reason}"


async def test_a_spent_quota_is_shared_through_redis(redis_url: str) -> None:
    answers = {"key-a": (QUOTA_BODY, {"retry-after": "1"})}
    async with upstream(limited(answers)) as pool:
        conf = two_keys(pool.url, state=redis_url, quota_retire_ms=600_000)
        async with gateway_client(conf) as client:
            assert (await client.get("/v1/x")).text == "key-b"
        answers.clear()
        # A second gateway (another process would do the same) never asks key-a again.
        async with gateway_client(conf) as client:
            for _ in range(4):
                assert (await client.get("/v1/x")).text == "key-b"
    assert keys_used(pool).count("key-a") == 1


async def test_a_quota_retirement_past_a_day_outlives_the_redis_key_ttl(redis_url: str) -> None:
    # The quota resets in 3 days: in Redis the credential stays retired that long, as in
    # memory. The credentials hash expired 24 h after its last write, forgetting it sooner;
    # a later mark on another credential must not shorten it either.
    import redis.asyncio as aioredis

    from fallback_mw.store_url import split_state_url

    headers = {"ratelimit-remaining": "0", "ratelimit-reset": str(3 * 86400)}
    answers = {"key-a": (b"{}", headers), "key-b": (b"{}", {"retry-after": "5"})}
    async with upstream(limited(answers)) as pool:
        conf = two_keys(pool.url, state=redis_url)
        conf["upstreams"]["pool"]["auth_env"] = ["KEY_A", "KEY_B", "KEY_C"]
        async with gateway_client(conf) as client:
            for _ in range(3):
                assert (await client.get("/v1/x")).text == "key-c"
    assert keys_used(pool).count("key-a") == 1 and keys_used(pool).count("key-b") == 1
    url, prefix = split_state_url(redis_url)
    inspect = aioredis.Redis.from_url(url)
    try:
        [key] = await inspect.keys(f"{prefix}credentials:pool:*")  # named after its variables
        ttl_ms = await inspect.pttl(key)
    finally:
        await inspect.aclose()
    assert ttl_ms > 3 * 86400 * 1000 - 60_000, ttl_ms


async def test_a_401_retirement_in_redis_lasts_its_own_ttl_not_while_the_pool_is_marked(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # key-a answered 401 (retired: 24 h in Redis); the operator rotated the key under the
    # same variable. The retirement was a bare 'retired' in the pool's hash, which lives 24 h
    # after its *last* write: key-b's 429s kept marking the pool, so key-a stayed retired as
    # long as the pool was marked at least once a day, never used again. The retirement
    # now ends its own 24 h after the 401 (shortened here to 1 s).
    import redis.asyncio as aioredis

    from fallback_mw.store_url import split_state_url

    monkeypatch.setattr("fallback_mw.health.redis_pools.CREDENTIAL_TTL_MS", 1000)
    monkeypatch.setattr("fallback_mw.health.redis.CREDENTIAL_TTL_MS", 1000)
    rotated = False

    async def handle(request: web.Request) -> web.StreamResponse:
        key = key_of(request)
        if key == "key-a" and not rotated:
            return web.Response(status=401)
        if key == "key-b":
            return web.Response(status=429, headers={"retry-after": "0"})
        return web.Response(text=key)

    async with upstream(handle) as pool:
        conf = pool_config(pool.url, state=redis_url)
        conf["routes"] = conf["routes"][:1]
        conf["gateway"]["repeat_budget"] = {"min_per_second": 100}  # key-b, then key-c
        async with gateway_client(conf) as client:
            assert (await client.get("/v1/x")).text == "key-c"
            assert keys_used(pool)[:1] == ["key-a"]  # retired
            # ...so that a process of the version before (a rolling upgrade), which reads
            # only a field 'retired', reads it as retired: no script of its fails on it.
            url, prefix = split_state_url(redis_url)
            inspect = aioredis.Redis.from_url(url, decode_responses=True)
            try:
                [key] = await inspect.keys(f"{prefix}credentials:pool:*")
                assert await inspect.hget(key, "0") == "retired"
            finally:
                await inspect.aclose()
            rotated = True
            with anyio.move_on_after(0.5):
                while True:  # retired: key-b's 429s, then key-c; the 429s mark the pool
                    assert (await client.get("/v1/x")).text == "key-c"
                    await anyio.sleep(0.05)
            assert "key-b" in keys_used(pool) and keys_used(pool).count("key-a") == 1
            with anyio.move_on_after(0.8):
                while True:  # the pool marked on, past key-a's own second
                    assert (await client.get("/v1/x")).status_code == 200
                    await anyio.sleep(0.05)
            served = [(await client.get("/v1/x")).text for _ in range(3)]
    assert "key-a" in served


async def test_a_key_removed_from_the_pool_leaves_no_mark_on_another_in_redis(
    redis_url: str,
) -> None:
    # key-a was revoked (401: retired for 24 h in Redis); the operator takes KEY_A out of
    # auth_env and restarts. Index 0 is KEY_B now: it must not inherit key-a's retirement
    # (all the traffic went to key-c, key-b sat retired for a day).
    async def revoked_a(request: web.Request) -> web.StreamResponse:
        key = key_of(request)
        return web.Response(status=401 if key == "key-a" else 200, text=key)

    async with upstream(revoked_a) as pool:
        conf = pool_config(pool.url, state=redis_url)
        conf["routes"] = conf["routes"][:1]
        async with gateway_client(conf) as client:
            for _ in range(3):
                assert (await client.get("/v1/x")).status_code == 200
        assert keys_used(pool).count("key-a") == 1
        conf["upstreams"]["pool"]["auth_env"] = ["KEY_B", "KEY_C"]
        async with gateway_client(conf) as client:
            served = [(await client.get("/v1/x")).text for _ in range(4)]
    assert sorted(served) == ["key-b", "key-b", "key-c", "key-c"]


def test_quota_verdicts() -> None:
    assert quota_reset([], QUOTA_BODY) == float("inf")
    assert quota_reset([], b'{"error": {"code": "rate_limit_exceeded"}}') is None
    assert quota_reset([], b"not json") is None
    assert quota_reset([], QUOTA_BODY[:20]) is None  # cut at the peek: no verdict
    openai = [(b"x-ratelimit-remaining-tokens", b"0"), (b"x-ratelimit-reset-tokens", b"1m30s")]
    assert quota_reset(openai, b"") == 90.0
    remaining = [(b"x-ratelimit-remaining-requests", b"3"), (b"x-ratelimit-reset-requests", b"1s")]
    assert quota_reset(remaining, b"") is None
    anthropic = [
        (b"anthropic-ratelimit-requests-remaining", b"0"),
        (b"anthropic-ratelimit-requests-reset", b"2030-01-01T00:00:00Z"),
    ]
    assert quota_reset(anthropic, b"") is None  # years away: unknown, read as a plain limit
    daily = gemini_429("GenerateRequestsPerDayPerProjectPerModel-FreeTier", "3600s")
    assert quota_reset([], daily) == 3600.0
    assert quota_reset([], gemini_429("GenerateRequestsPerMinutePerProjectPerModel", "9s")) is None
    assert quota_reset([], daily.replace(b'"3600s"', b'"soon"')) == float("inf")
    assert parse_duration("6m0s") == 360.0 and parse_duration("20ms") == 0.02
    assert parse_duration("soon") is None


# --- the incident view ------------------------------------------------------------------


async def test_usage_incidents_lists_failed_over_and_local_errors_with_their_trails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def primary(request: web.Request) -> web.StreamResponse:
        return web.Response(status=200 if request.path == "/v1/fine" else 503, text="p")

    store = f"sqlite:///{tmp_path / 'gw.db'}"
    async with upstream(primary) as p, upstream(echo_key) as b:
        conf = {
            "gateway": {"store": store},
            "upstreams": {
                "primary": {"url": p.url, "auth_env": "KEY_A"},
                "backup": {"url": b.url, "auth_env": "KEY_B"},
            },
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}
            ],
        }
        async with gateway_client(conf) as client:
            assert (await client.get("/v1/moved")).text == "key-b"  # failed over
            assert (await client.get("/v1/fine")).text == "p"  # no incident
            assert (await client.post("/v1/posted", content=b"{}")).status_code == 502
    capsys.readouterr()
    status: int = await anyio.to_thread.run_sync(
        main, ["usage", "--store", store, "--incidents", "--json"]
    )
    assert status == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    trails = {
        tuple(line["incident"]): [(a["candidate"], a.get("status")) for a in line["attempts"]]
        for line in lines
    }
    assert trails == {
        ("failed_over",): [("primary", 503), ("backup", 200)],
        ("local_error",): [("primary", 503)],
    }
    assert await anyio.to_thread.run_sync(main, ["usage", "--store", store, "--incidents"]) == 0
    table = capsys.readouterr().out
    assert "primary:503,backup:200" in table and "failed_over" in table
    assert "upstream_failed" in table and "local_error" in table
    assert len(table.strip().splitlines()) == 3  # the header and the two incidents


async def test_usage_shows_a_response_cut_short_after_the_commit_point_as_an_incident(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # "Why didn't it fail over?": the primary's 200 reset mid-stream. `usage` showed it as
    # a plain primary:200 and `--incidents` left it out.
    async def resets_mid_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200)
        await response.prepare(request)
        await response.write(b"partial-")
        await anyio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return response

    store = f"sqlite:///{tmp_path / 'gw.db'}"
    async with upstream(resets_mid_stream) as p, upstream(echo_key) as b:
        conf = {
            "gateway": {"store": store},
            "upstreams": {
                "primary": {"url": p.url, "auth_env": "KEY_A"},
                "backup": {"url": b.url, "auth_env": "KEY_B"},
            },
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}
            ],
        }
        gateway = Gateway(host_app, config=conf, environ={"KEY_A": "a", "KEY_B": "b"})
        async with serve_asgi(gateway) as url, httpx.AsyncClient(base_url=url) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get("/v1/stream")
        await gateway.aclose()  # the usage record is written before the walk returns
    capsys.readouterr()
    assert await anyio.to_thread.run_sync(main, ["usage", "--store", store, "--json"]) == 0
    (line,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert line["attempts"] == [{"candidate": "primary", "status": 200, "failure": "transport"}]
    assert (line["outcome"], line["chosen"]) == ("aborted", "primary")
    args = ["usage", "--store", store, "--incidents"]
    assert await anyio.to_thread.run_sync(main, args) == 0
    table = capsys.readouterr().out
    assert "primary:200(aborted:transport)" in table and " aborted " in table
    assert await anyio.to_thread.run_sync(main, [*args, "--json"]) == 0
    (line,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert line["incident"] == ["aborted"]


async def test_a_hedge_that_lost_the_race_with_its_head_is_not_read_as_aborted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two heads in the same instant: the hedge that lost is closed unused (failure kind
    # `cancelled`, its head's status kept). The trail read `primary:200(aborted:cancelled)`,
    # a failure after the commit point that never happened, beside the primary that served.
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    ledger = open_ledger(store)
    try:
        await ledger.record_usage(
            UsageRecord(
                request_id="h", route="chat", tenant="t", candidates=("primary", "backup"),
                attempts=(
                    AttemptOutcome("primary", status=200),
                    AttemptOutcome("primary", status=200, failure="cancelled"),
                ),
                chosen="primary", outcome="served", status=200,
            )
        )  # fmt: skip
    finally:
        await ledger.aclose()
    capsys.readouterr()
    args = ["usage", "--store", store, "--incidents"]
    assert await anyio.to_thread.run_sync(main, args) == 0
    table = capsys.readouterr().out
    assert "primary:200,primary:200(cancelled)" in table, table
    assert "aborted" not in table


async def test_a_response_too_large_before_the_commit_point_is_a_local_error_incident(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The gateway's own 502 response_too_large (the declared length over
    # max_response_body, refused before a byte reached the client): `usage --incidents`
    # left it out, its outcome being read as one of a response that had started.
    async def too_large(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 4000)

    store = f"sqlite:///{tmp_path / 'gw.db'}"
    async with upstream(too_large) as p:
        conf = {
            "gateway": {"store": store, "max_response_body": 1000},
            "upstreams": {"primary": {"url": p.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        async with serve_asgi(gateway) as url, httpx.AsyncClient(base_url=url) as client:
            answer = await client.get("/v1/big")
        await gateway.aclose()
    assert (answer.status_code, answer.json()["error"]["code"]) == (502, "response_too_large")
    capsys.readouterr()
    args = ["usage", "--store", store, "--incidents", "--json"]
    assert await anyio.to_thread.run_sync(main, args) == 0
    (line,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (line["outcome"], line["chosen"]) == ("response_too_large", None)
    assert line["incident"] == ["local_error"]


def test_a_response_the_host_cut_after_it_started_is_an_incident() -> None:
    # A deploy's --timeout-graceful-shutdown cutting a stream: the log line, the span and
    # the usage record book it `cancelled`; `usage --incidents` left it out.
    cut = UsageRecord(
        request_id="c",
        route="chat",
        tenant="t",
        attempts=(AttemptOutcome("primary", status=200),),
        chosen="primary",
        outcome="cancelled",
        status=200,
    )
    assert incident_kinds(cut) == ["cancelled"]
    before_the_head = UsageRecord(
        request_id="h", route="chat", tenant="t", attempts=(), outcome="cancelled"
    )
    assert incident_kinds(before_the_head) == ["local_error"]


def test_a_skipped_candidate_is_an_incident() -> None:
    skipped = UsageRecord(
        request_id="r",
        route="chat",
        tenant="t",
        attempts=(
            AttemptOutcome("backup", status=200),
            AttemptOutcome("primary", skipped="breaker_open"),
        ),
        chosen="backup",
        outcome="served",
        status=200,
    )
    assert incident_kinds(skipped) == ["skipped"]
    quiet = UsageRecord(
        request_id="q", route="chat", tenant="t", attempts=(AttemptOutcome("primary", status=200),),
        chosen="primary", outcome="served", status=200,
    )  # fmt: skip
    assert incident_kinds(quiet) == []


class _Answer:
    """A response whose body arrives in `chunks`, then ends or fails with `error`."""

    def __init__(self, chunks: list[bytes], error: Exception | None = None) -> None:
        self.status = 429
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks = chunks
        self.error = error
        self.closed = False

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if self.error is not None:
            raise self.error

    async def aclose(self) -> None:
        self.closed = True


async def test_the_peek_reads_a_bounded_prefix_and_relays_every_byte_or_the_error() -> None:
    long = _Answer([b"a" * 3000, b"b" * 3000, b"c" * 3000])
    peeked = await peek_quota(long, limit=4096)
    assert peeked.quota is None  # cut at the peek: no verdict
    assert b"".join([c async for c in peeked.iter_chunks()]) == b"".join(long.chunks)
    await peeked.aclose()
    assert long.closed

    broken = _Answer([QUOTA_BODY[:10]], error=ConnectionResetError("reset"))
    peeked = await peek_quota(broken)
    relayed = []
    with pytest.raises(ConnectionResetError):
        async for chunk in peeked.iter_chunks():
            relayed.append(chunk)
    assert relayed == [QUOTA_BODY[:10]]
    await peeked.aclose()


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (b"120", 120.0),
        (b"0000000000120", 120.0),  # leading zeros: read whole, not its first 9 digits (0)
        (b"-5", None),
        (b"1e9", None),
        (b"\xc2\xb2", None),
        (b"garbage", None),
        (b"Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # a date in the past: retry now
        (b"1 Jan 10000000000 00:00:00 GMT", None),  # a year past datetime's: unreadable
    ],
)
def test_retry_after_is_read_whole_or_not_at_all(value: bytes, seconds: float | None) -> None:
    assert retry_after_seconds([(b"retry-after", value)]) == seconds


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ([(b"retry-after-ms", b"1500")], 1.5),
        ([(b"retry-after-ms", b"250.5")], 0.2505),
        ([(b"retry-after", b"20"), (b"retry-after-ms", b"20000")], 20.0),
        ([(b"retry-after", b"20"), (b"retry-after-ms", b"500")], 0.5),  # the finer one wins
        ([(b"retry-after-ms", b"-1"), (b"retry-after", b"3")], 3.0),  # unreadable: ignored
        ([(b"retry-after-ms", b"1e9")], None),
        ([(b"retry-after-ms", b"nan")], None),
        ([(b"retry-after-ms", b".")], None),
        ([(b"retry-after-ms", b"\xc2\xb2")], None),
    ],
)
def test_retry_after_ms_is_read_before_retry_after(
    headers: list[tuple[bytes, bytes]], seconds: float | None
) -> None:
    assert retry_after_seconds(headers) == seconds


async def test_a_retry_after_date_beyond_any_year_fails_over_like_any_429() -> None:
    # An upstream's 429 with `Retry-After: 1 Jan 10000000000 00:00:00 GMT` (a year too big
    # for a date) raised OverflowError out of the attempt: the caller got a 500
    # internal_error instead of the pool's next key, on every request that drew key-a.
    answers = {"key-a": (b"slow down", {"retry-after": "1 Jan 10000000000 00:00:00 GMT"})}
    async with upstream(limited(answers)) as pool, gateway_client(two_keys(pool.url)) as client:
        response = await client.get("/v1/x")
        assert (response.status_code, response.text) == (200, "key-b")
        assert keys_used(pool) == ["key-a", "key-b"]
        # key-a cools down (cooldown_ms, the Retry-After unreadable): key-b serves on.
        assert (await client.get("/v1/x")).text == "key-b"
        assert keys_used(pool) == ["key-a", "key-b", "key-b"]


def test_a_huge_retry_after_cools_a_credential_for_max_cooldown_only() -> None:
    seconds = retry_after_seconds([(b"retry-after", b"9" * 400)])
    mark = credential_mark(
        status=429, failure=False, retry_after=seconds, default_cooldown=5, max_cooldown=300
    )
    assert mark is not None and (mark.action, mark.seconds) == ("cool_down", 300)


async def test_a_pool_naming_one_variable_twice_is_refused_at_load() -> None:
    # auth_env = ["KEY_A", "KEY_A"] (a copy-paste slip for KEY_B) loaded as a pool of two,
    # and a 429 "moved to another credential" that was the same key: one request sent it
    # twice to an upstream that had just rate-limited it (SPEC §6: each credential at most
    # once per request). Refused at load, naming the upstream and the variable once.
    conf = {
        "upstreams": {
            "pool": {"url": "http://127.0.0.1:9", "auth_env": ["KEY_A", "KEY_B", "KEY_A"]}
        },
        "routes": [{"id": "one", "prefix": "/v1/", "plan": ["pool"], "retries": 2}],
    }
    with pytest.raises(ConfigError) as info:
        load_config(conf, environ=ENV)
    message = str(info.value)
    assert message == (
        "upstream 'pool': auth_env names KEY_A more than once: each credential of a pool is "
        "its own variable (a request uses each at most once)"
    )
    gateway = Gateway(host_app, config=conf, environ=ENV)
    assert gateway.config_error is not None and message in gateway.config_error


@pytest.mark.parametrize("state", ["memory://", "redis"])
async def test_a_hedge_the_bound_credential_won_does_not_move_the_session(
    state: str, request: pytest.FixtureRequest
) -> None:
    # A session bound to key-a, whose answer was slow once (the hedge at key-b started,
    # key-a still won): the session's next requests went to key-b. A hedge is no verdict on
    # key-a, which answered; the session keeps its credential while it is healthy.
    if state == "redis":
        state = request.getfixturevalue("redis_url")
    slow: dict[str, float] = {}

    async def handle(request: web.Request) -> web.StreamResponse:
        key = key_of(request)
        await anyio.sleep(slow.get(key, 0.0))
        return web.Response(text=key)

    async with upstream(handle) as pool:
        conf = two_keys(pool.url)
        conf["gateway"]["state"] = state
        conf["routes"][0]["hedge_after_ms"] = 100
        s1 = {"x-session-id": "s1"}
        async with gateway_client(conf) as client:
            # Bind the session first, on a request that is not hedged.
            first = (await client.get("/v1/x", headers=s1)).text
            slow.clear()
            slow[first] = 0.3
            slow["key-b" if first == "key-a" else "key-a"] = 2.0
            assert (await client.get("/v1/x", headers=s1)).text == first  # hedged, won
            other = "key-b" if first == "key-a" else "key-a"
            assert keys_used(pool)[-2:] == [first, other]  # the hedge did start
            slow.clear()
            assert [(await client.get("/v1/x", headers=s1)).text for _ in range(3)] == [first] * 3
