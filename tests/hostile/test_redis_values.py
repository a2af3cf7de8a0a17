"""Values in the Redis health state written by more than the gateway (an operator's HSET,
another version, a clock that stepped): no breaker stays open or half-open for ever."""

from __future__ import annotations

import hashlib

import pytest
import redis.asyncio as aioredis

from fallback_mw.store_url import split_state_url
from tests.helpers import gateway_client
from tests.upstreams import status_handler, upstream

BREAKER = {"window": 4, "min_calls": 3, "cooldown_ms": 150, "max_cooldown_ms": 1000}
TEN_YEARS_MS = 10 * 365 * 86_400_000


@pytest.mark.anyio
@pytest.mark.parametrize(
    "fields",
    [
        {"st": "open", "until": "ten years"},
        {"st": "open", "until": "1e300"},
        {"st": "open", "until": "inf"},
        {"st": "half_open", "probe": "ten years"},
    ],
)
async def test_a_breaker_end_no_cooldown_wrote_is_due_not_for_ever(
    redis_url: str, fields: dict[str, str]
) -> None:
    # `until` (or a probe's lease) written years ahead on a key without a ttl: every process
    # skipped the upstream for ever (an open breaker's ADMIT touches no ttl; a half-open
    # one's renews it at every admission), and a route with no other candidate answered
    # 503 with a Retry-After of years. Such an end is further off than any cooldown or
    # lease any configuration writes: due now, one probe, which closes the breaker.
    base, prefix = split_state_url(redis_url)
    inspect = aioredis.Redis.from_url(base, decode_responses=True)
    breaker = f"{prefix}breaker:primary"
    try:
        seconds, micros = await inspect.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        written = {
            k: str(now_ms + TEN_YEARS_MS) if v == "ten years" else v for k, v in fields.items()
        }
        await inspect.hset(breaker, mapping=written)
        assert await inspect.ttl(breaker) == -1
        async with upstream(status_handler(200, b"primary")) as primary:
            conf = {
                "gateway": {"state": redis_url, "breaker": BREAKER},
                "upstreams": {"primary": {"url": primary.url}},
                "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
            }
            async with gateway_client(conf) as client:
                response = await client.get("/v1/x")
                assert response.status_code == 200, (response.text, response.headers)
                assert response.text == "primary"
                assert await inspect.hget(breaker, "st") == "closed"
                assert (await client.get("/v1/x")).text == "primary"
        assert primary.count == 2
    finally:
        await inspect.aclose()


@pytest.mark.anyio
async def test_an_open_breaker_within_its_cooldown_still_skips(redis_url: str) -> None:
    # The control: an end inside the key's ttl is a cooldown, and is honoured.
    base, prefix = split_state_url(redis_url)
    inspect = aioredis.Redis.from_url(base, decode_responses=True)
    try:
        seconds, micros = await inspect.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        await inspect.hset(
            f"{prefix}breaker:primary", mapping={"st": "open", "until": str(now_ms + 60_000)}
        )
        async with upstream(status_handler(200)) as primary:
            conf = {
                "gateway": {"state": redis_url, "breaker": BREAKER},
                "upstreams": {"primary": {"url": primary.url}},
                "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
            }
            async with gateway_client(conf) as client:
                response = await client.get("/v1/x")
                assert response.status_code == 503
                assert response.json()["error"]["code"] == "route_exhausted"
                assert 55 <= int(response.headers["retry-after"]) <= 60
        assert primary.count == 0
    finally:
        await inspect.aclose()


@pytest.mark.anyio
async def test_capacity_counts_no_gateway_wrote_neither_fill_nor_empty_a_declared_rpm(
    redis_url: str,
) -> None:
    # A count at a second years ahead (a hand HSET, a clock years ahead) read as recent:
    # the declared rpm stayed full for ever (a refusal touches no ttl), every request went
    # to the backup, and a route without one answered 503 with a Retry-After of years. A
    # negative count (`-100`) read as room: the rpm let 100 more requests through.
    base, prefix = split_state_url(redis_url)
    inspect = aioredis.Redis.from_url(base, decode_responses=True)
    counts = f"{prefix}capacity:primary"
    try:
        now = int((await inspect.time())[0])
        await inspect.hset(counts, mapping={f"r:{now + 10**8}": "1000", f"t:{now + 10**8}": "9"})
        async with (
            upstream(status_handler(200, b"primary")) as primary,
            upstream(status_handler(200, b"backup")) as backup,
        ):
            conf = {
                "gateway": {"state": redis_url, "breaker": BREAKER},
                "upstreams": {
                    "primary": {"url": primary.url, "rpm": 2},
                    "backup": {"url": backup.url},
                },
                "routes": [
                    {"id": "r", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}
                ],
            }
            async with gateway_client(conf) as client:
                assert (await client.get("/v1/x")).text == "primary"
                assert f"r:{now + 10**8}" not in await inspect.hgetall(counts)
                await inspect.hset(counts, f"r:{now - 1}", "-100")
                served = [(await client.get("/v1/x")).text for _ in range(3)]
                assert served == ["primary", "backup", "backup"]
        assert primary.count == 2
    finally:
        await inspect.aclose()


@pytest.mark.anyio
async def test_capacity_counts_a_few_seconds_ahead_of_redis_still_count(redis_url: str) -> None:
    # A count written at a second just after Redis's own clock (a replica whose clock runs
    # a second or two ahead, promoted by a failover) was dropped as if written by hand: the
    # declared rpm forgot the requests of the last seconds and let as many again through.
    # Within a few seconds ahead it counts as now; years ahead it is still dropped (above).
    base, prefix = split_state_url(redis_url)
    inspect = aioredis.Redis.from_url(base, decode_responses=True)
    counts = f"{prefix}capacity:primary"
    try:
        async with (
            upstream(status_handler(200, b"primary")) as primary,
            upstream(status_handler(200, b"backup")) as backup,
        ):
            conf = {
                "gateway": {"state": redis_url, "breaker": BREAKER},
                "upstreams": {
                    "primary": {"url": primary.url, "rpm": 3},
                    "backup": {"url": backup.url},
                },
                "routes": [
                    {"id": "r", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}
                ],
            }
            async with gateway_client(conf) as client:
                now = int((await inspect.time())[0])
                await inspect.hset(counts, mapping={f"r:{now + 2}": "2", f"t:{now + 2}": "0"})
                served = [(await client.get("/v1/x")).text for _ in range(3)]
                assert served == ["primary", "backup", "backup"]
                assert f"r:{now + 2}" in await inspect.hgetall(counts)
        assert primary.count == 1
    finally:
        await inspect.aclose()


@pytest.mark.anyio
async def test_capacity_retry_after_of_a_count_a_few_seconds_ahead_is_a_minute_at_most(
    redis_url: str,
) -> None:
    base, prefix = split_state_url(redis_url)
    inspect = aioredis.Redis.from_url(base, decode_responses=True)
    counts = f"{prefix}capacity:primary"
    try:
        async with upstream(status_handler(200)) as primary:
            conf = {
                "gateway": {"state": redis_url, "breaker": BREAKER},
                "upstreams": {"primary": {"url": primary.url, "rpm": 2}},
                "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
            }
            async with gateway_client(conf) as client:
                now = int((await inspect.time())[0])
                await inspect.hset(counts, mapping={f"r:{now}": "1", f"r:{now + 3}": "1"})
                response = await client.get("/v1/x")
                assert response.status_code == 503  # both count: the rpm of 2 is full
                assert 55 <= int(response.headers["retry-after"]) <= 60
        assert primary.count == 0
    finally:
        await inspect.aclose()


@pytest.mark.anyio
async def test_capacity_retry_after_of_a_count_a_few_seconds_ahead_is_never_short(
    redis_url: str,
) -> None:
    # A count up to 5 s ahead of Redis's clock holds the rpm until its own second leaves
    # the rolling minute (ADMIT reads its age from that second), but the Retry-After was
    # read as if it were made now: up to 5 s short, and a caller retrying on time was
    # refused again. It is the seconds until ADMIT lets the request through.
    base, prefix = split_state_url(redis_url)
    inspect = aioredis.Redis.from_url(base, decode_responses=True)
    counts = f"{prefix}capacity:primary"
    try:
        async with upstream(status_handler(200)) as primary:
            conf = {
                "gateway": {"state": redis_url, "breaker": BREAKER},
                "upstreams": {"primary": {"url": primary.url, "rpm": 1}},
                "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
            }
            async with gateway_client(conf) as client:
                before = int((await inspect.time())[0])
                await inspect.hset(counts, mapping={f"r:{before + 4}": "1"})
                response = await client.get("/v1/x")
                after = int((await inspect.time())[0])
                assert response.status_code == 503
                retry_after = int(response.headers["retry-after"])
                # Admitted again once Redis's clock reads the count's second plus 60.
                assert retry_after >= before + 4 + 60 - after, (retry_after, before, after)
                assert retry_after <= 65
        assert primary.count == 0
    finally:
        await inspect.aclose()


@pytest.mark.anyio
async def test_capacity_retry_after_never_counts_a_second_ahead(redis_url: str) -> None:
    base, prefix = split_state_url(redis_url)
    inspect = aioredis.Redis.from_url(base, decode_responses=True)
    counts = f"{prefix}capacity:primary"
    try:
        now = int((await inspect.time())[0])
        async with upstream(status_handler(200)) as primary:
            conf = {
                "gateway": {"state": redis_url, "breaker": BREAKER},
                "upstreams": {"primary": {"url": primary.url, "rpm": 1}},
                "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
            }
            async with gateway_client(conf) as client:
                assert (await client.get("/v1/x")).status_code == 200
                await inspect.hset(counts, f"r:{now + 10**8}", "5")
                response = await client.get("/v1/x")
                assert response.status_code == 503
                assert int(response.headers["retry-after"]) <= 60
        assert primary.count == 1
    finally:
        await inspect.aclose()


@pytest.mark.anyio
async def test_a_credential_mark_no_pool_wrote_ends(redis_url: str) -> None:
    # A cool-down (or a retirement's end) written years ahead on a key without a ttl kept
    # that credential out of every process's pool for ever; with both marked so, every
    # request was a 503 route_exhausted. Marks end within 31 days (cooldowns, quotas): one
    # further ahead is over.
    base, prefix = split_state_url(redis_url)
    inspect = aioredis.Redis.from_url(base, decode_responses=True)
    envs = ["KEY_A", "KEY_B"]
    pool = hashlib.sha256("\x1f".join(envs).encode()).hexdigest()[:12]
    marks = f"{prefix}credentials:primary:{pool}"
    try:
        seconds, micros = await inspect.time()
        ahead = str(int(seconds) * 1000 + int(micros) // 1000 + TEN_YEARS_MS)
        await inspect.hset(marks, mapping={"0": ahead, "1": "retired", "1:until": ahead})
        async with upstream(status_handler(200)) as primary:
            conf = {
                "gateway": {"state": redis_url, "breaker": BREAKER},
                "upstreams": {"primary": {"url": primary.url, "auth_env": envs}},
                "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
            }
            environ = {"KEY_A": "key-a", "KEY_B": "key-b"}
            async with gateway_client(conf, environ=environ) as client:
                for _ in range(4):
                    response = await client.get("/v1/x")
                    assert response.status_code == 200, response.text
        used = {dict(r.headers)["authorization"] for r in primary.received}
        assert used == {"Bearer key-a", "Bearer key-b"}
    finally:
        await inspect.aclose()


@pytest.mark.anyio
async def test_a_credential_cooling_down_for_a_day_stays_out(redis_url: str) -> None:
    # The control: a mark within the longest a pool writes is honoured.
    base, prefix = split_state_url(redis_url)
    inspect = aioredis.Redis.from_url(base, decode_responses=True)
    envs = ["KEY_A", "KEY_B"]
    pool = hashlib.sha256("\x1f".join(envs).encode()).hexdigest()[:12]
    try:
        seconds, micros = await inspect.time()
        day = str(int(seconds) * 1000 + int(micros) // 1000 + 86_400_000)
        await inspect.hset(f"{prefix}credentials:primary:{pool}", mapping={"0": day})
        async with upstream(status_handler(200)) as primary:
            conf = {
                "gateway": {"state": redis_url, "breaker": BREAKER},
                "upstreams": {"primary": {"url": primary.url, "auth_env": envs}},
                "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
            }
            environ = {"KEY_A": "key-a", "KEY_B": "key-b"}
            async with gateway_client(conf, environ=environ) as client:
                for _ in range(3):
                    assert (await client.get("/v1/x")).status_code == 200
        assert {dict(r.headers)["authorization"] for r in primary.received} == {"Bearer key-b"}
    finally:
        await inspect.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("stats", ["nan 0 0", "inf 0 0", "-1 0 0", "1 -1 0"])
async def test_a_credential_score_no_pool_wrote_reads_as_none(redis_url: str, stats: str) -> None:
    # `selection = "score"`: a credential's score written as `nan`, `inf` or a negative
    # count (a hand HSET, another tool) scored NaN, which no comparison picks: with every
    # credential so written the pool picked none, and the route answered 503 (no_credential)
    # for as long as the key lived (one set by hand: for ever). Such stats read as none.
    base, prefix = split_state_url(redis_url)
    inspect = aioredis.Redis.from_url(base, decode_responses=True)
    envs = ["KEY_A", "KEY_B"]
    pool = hashlib.sha256("\x1f".join(envs).encode()).hexdigest()[:12]
    try:
        seconds, micros = await inspect.time()
        at = str(int(seconds) * 1000 + int(micros) // 1000)
        written = f"{stats} {at}"
        await inspect.hset(f"{prefix}score:primary:{pool}", mapping={"0": written, "1": written})
        async with upstream(status_handler(200)) as primary:
            conf = {
                "gateway": {"state": redis_url, "breaker": BREAKER},
                "upstreams": {
                    "primary": {"url": primary.url, "auth_env": envs, "selection": "score"}
                },
                "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
            }
            environ = {"KEY_A": "key-a", "KEY_B": "key-b"}
            async with gateway_client(conf, environ=environ) as client:
                response = await client.get("/v1/x")
                assert response.status_code == 200, response.text
        assert primary.count == 1
    finally:
        await inspect.aclose()


@pytest.mark.anyio
async def test_a_breaker_another_gateway_opened_for_its_own_cooldown_still_skips(
    redis_url: str,
) -> None:
    # Two gateways on one Redis whose breakers differ (a rolling change of max_cooldown_ms):
    # the one with an hour's cooldown opens the shared breaker for 45 minutes, an end this
    # package writes. The one whose own cooldowns are short took it for a hand edit (due at
    # once) and went on sending requests to the upstream the other had found failing.
    base, prefix = split_state_url(redis_url)
    inspect = aioredis.Redis.from_url(base, decode_responses=True)
    long_breaker = {
        "window": 4, "min_calls": 2, "cooldown_ms": 2_700_000, "max_cooldown_ms": 3_600_000
    }  # fmt: skip
    try:
        async with (
            upstream(status_handler(503, b"primary")) as primary,
            upstream(status_handler(200, b"backup")) as backup,
        ):

            def conf(breaker: dict[str, int]) -> dict[str, object]:
                return {
                    "gateway": {"state": redis_url, "breaker": breaker},
                    "upstreams": {"primary": {"url": primary.url}, "backup": {"url": backup.url}},
                    "routes": [
                        {"id": "r", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}
                    ],
                }

            async with gateway_client(conf(long_breaker)) as client:
                for _ in range(2):
                    assert (await client.get("/v1/x")).text == "backup"
            assert await inspect.hget(f"{prefix}breaker:primary", "st") == "open"
            assert primary.count == 2
            async with gateway_client(conf(BREAKER)) as client:
                for _ in range(2):
                    response = await client.get("/v1/x")
                    assert response.text == "backup"
                    assert response.headers["x-gateway-skipped"].startswith("primary;")
            assert primary.count == 2
    finally:
        await inspect.aclose()
