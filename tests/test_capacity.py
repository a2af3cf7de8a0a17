"""Declared capacity (`rpm`, `tpm`) and the repeat budget, end to end: real upstream
sockets, the whole Gateway, telemetry from the SDK's in-memory readers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from aiohttp import web
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fallback_mw import Gateway
from fallback_mw.health.memory import MemoryHealth
from fallback_mw.request.types import Message
from fallback_mw.telemetry import Telemetry
from fallback_mw.tokens import estimate_tokens
from tests.helpers import client_for, free_port, http_scope, serve_process, wait_listening
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio


class Recorded:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        self.telemetry = Telemetry(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider
        )

    def skips(self) -> dict[tuple[str, str], int]:
        found: dict[tuple[str, str], int] = {}
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == "gateway.skips":
                        for point in metric.data.data_points:
                            key = (
                                str(point.attributes["gateway.candidate"]),
                                str(point.attributes["gateway.skip.reason"]),
                            )
                            found[key] = found.get(key, 0) + point.value
        return found

    def skip_events(self) -> list[tuple[str, str]]:
        return [
            (str(e.attributes["gateway.candidate"]), str(e.attributes["gateway.skip.reason"]))
            for span in self.spans.get_finished_spans()
            if span.name == "gateway.request"
            for e in span.events
            if e.attributes is not None
        ]


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    found = Recorded()
    yield found
    found.tracer_provider.shutdown()
    found.meter_provider.shutdown()


NO_BREAKER = {"window": 10_000, "min_calls": 10_000}  # the budget alone limits repeats


def limited_backup(limit: int) -> Any:
    """Like a provider: answers 200 up to `limit` requests, 429 after that."""
    seen = 0

    async def handle(request: web.Request) -> web.StreamResponse:
        nonlocal seen
        seen += 1
        if seen > limit:
            return web.Response(status=429, text="rate limited")
        return web.Response(text="answer from the backup upstream")

    return handle


def config(primary: str, backup: str, **route: Any) -> dict[str, Any]:
    return {
        "gateway": {"breaker": {"window": 10, "min_calls": 3, "cooldown_ms": 60_000}},
        "upstreams": {"primary": {"url": primary}, "backup": {"url": backup, "rpm": 5}},
        "routes": [
            {
                "id": "chat",
                "prefix": "/v1/",
                "plan": ["primary", "backup"],
                "retries": 1,
                "backoff_ms": 0,
                "failover_status": [429, 503],
                **route,
            }
        ],
    }


async def test_backup_with_rpm_5_takes_exactly_5_failovers_and_its_breaker_stays_closed(
    recorded: Recorded,
) -> None:
    async with (
        upstream(status_handler(503)) as primary,
        upstream(limited_backup(5)) as backup,
    ):
        gateway = Gateway(
            host_app, config=config(primary.url, backup.url), telemetry=recorded.telemetry
        )
        try:
            async with client_for(gateway) as client:
                responses = [await client.get("/v1/chat") for _ in range(12)]
            breaker_admits = await gateway.services.health.admit("backup")
        finally:
            await gateway.aclose()
    assert backup.count == 5  # a sixth would have been a 429 that opens its breaker
    served = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert len(served) == 5 and all(r.text == "answer from the backup upstream" for r in served)
    assert len(refused) == 7
    for response in refused:
        # the local error: the primary failed again (502), or its breaker opened and
        # nothing could be attempted (503)
        code = response.json()["error"]["code"]
        assert (response.status_code, code) in {(502, "upstream_failed"), (503, "route_exhausted")}
        assert "answer from" not in response.text  # never the upstream's body
    assert breaker_admits and recorded.telemetry.breaker_states().get("backup") != "open"
    assert recorded.skips()[("backup", "capacity")] == 7
    assert recorded.skip_events().count(("backup", "capacity")) == 7


async def test_nothing_attempted_is_route_exhausted(recorded: Recorded) -> None:
    async with upstream(status_handler(200, b"only")) as only:
        conf = {
            "upstreams": {"only": {"url": only.url, "rpm": 2}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["only"]}],
        }
        gateway = Gateway(host_app, config=conf, telemetry=recorded.telemetry)
        try:
            async with client_for(gateway) as client:
                responses = [await client.get("/v1/chat") for _ in range(3)]
        finally:
            await gateway.aclose()
    assert [r.status_code for r in responses] == [200, 200, 503]
    assert responses[2].json()["error"]["code"] == "route_exhausted"
    assert responses[2].headers["x-gateway-attempts"] == "0"
    assert only.count == 2
    assert recorded.skip_events() == [("only", "capacity")]


@pytest.mark.parametrize("shared", [False, True], ids=["memory", "redis"])
async def test_a_503_for_full_capacity_says_when_the_minute_has_room(
    shared: bool, request: pytest.FixtureRequest
) -> None:
    """Every candidate skipped for `capacity`: the 503 carries Retry-After, the seconds
    until the rolling minute lets out enough to fit (here: the first of the two requests,
    a minute after it). A request whose estimate is over the whole tpm never fits: none."""
    state = request.getfixturevalue("redis_url") if shared else "memory://"
    async with upstream(status_handler(200, b"only")) as only:
        conf = {
            "gateway": {"state": state},
            "upstreams": {
                "only": {"url": only.url, "rpm": 2},
                "small": {"url": only.url + "/small", "tpm": 100},
            },
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["only"]},
                {"id": "small", "prefix": "/s/", "plan": ["small"], "replayable_methods": ["POST"]},
            ],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                responses = [await client.get("/v1/chat") for _ in range(3)]
                too_big = await client.post("/s/x", json={"max_tokens": 1000})
        finally:
            await gateway.aclose()
    assert [r.status_code for r in responses] == [200, 200, 503]
    assert "retry-after" not in responses[0].headers
    assert 58 <= int(responses[2].headers["retry-after"]) <= 60
    assert responses[2].headers["x-gateway-skipped"] == "only;reason=capacity"
    assert too_big.status_code == 503
    assert too_big.headers["x-gateway-skipped"] == "small;reason=capacity"
    assert "retry-after" not in too_big.headers


class PrimaryFault:
    """A game-day fault on `primary`, set and cleared by the test (the store's source in
    a running gateway)."""

    def __init__(self) -> None:
        self.fault: Any = None

    async def upstream_fault(self, upstream: str) -> Any:
        return self.fault if upstream == "primary" else None

    async def pinned_candidate(self, route_id: str) -> str | None:
        return None

    async def aclose(self) -> None:
        return None


@pytest.mark.parametrize("fault", ["fail", "revoke"])
async def test_attempts_a_fault_answered_leave_the_upstreams_rpm_alone(fault: str) -> None:
    """A faulted attempt sends nothing to the upstream: it does not count against its
    declared rpm, so when the game day ends the primary takes traffic at once instead of
    being skipped for `capacity` until the minute has passed."""
    faults = PrimaryFault()
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        conf = {
            "gateway": {"breaker": NO_BREAKER},
            "upstreams": {"primary": {"url": primary.url, "rpm": 3},
                          "backup": {"url": backup.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"],
                        "retries": 1, "failover_status": [401, 503]}],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf, faults=faults)
        try:
            async with client_for(gateway) as client:
                faults.fault = fault
                during = [await client.get("/v1/chat") for _ in range(5)]
                faults.fault = None  # the game day ends
                after = [await client.get("/v1/chat") for _ in range(3)]
        finally:
            await gateway.aclose()
    assert [r.text for r in during] == ["backup"] * 5
    assert all("x-gateway-skipped" not in r.headers for r in during)  # primary tried each time
    assert [r.text for r in after] == ["primary"] * 3
    assert primary.count == 3


async def test_attempts_that_never_got_a_connection_leave_the_upstreams_rpm_alone() -> None:
    """A burst beyond `max_connections` waits in the gateway; an attempt whose deadline ends
    there sent nothing, so it does not count against the upstream's declared rpm (the
    upstream would otherwise be skipped for `capacity` for a minute after the burst)."""
    reached = asyncio.Event()

    async def first_slow(request: web.Request) -> web.StreamResponse:
        if not reached.is_set():
            reached.set()
            await asyncio.sleep(0.5)  # holds the only connection past the burst's deadlines
        return web.Response(text="ok")

    async with upstream(first_slow) as only:
        conf = {
            "upstreams": {"only": {"url": only.url, "rpm": 5, "max_connections": 1}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["only"], "deadline_ms": 5000}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                holder = asyncio.ensure_future(client.get("/v1/chat"))
                await asyncio.wait_for(reached.wait(), 10)
                short = {"x-gateway-deadline-ms": "150"}
                burst = await asyncio.gather(
                    *(client.get("/v1/c", headers=short) for _ in range(4))
                )
                held = await holder
                after = [await client.get("/v1/chat") for _ in range(4)]
        finally:
            await gateway.aclose()
    assert [r.status_code for r in burst] == [504] * 4  # waited for the connection, sent nothing
    assert held.status_code == 200
    assert [r.status_code for r in after] == [200] * 4, [r.headers for r in after]
    assert only.count == 5  # the holder and the four after


async def test_a_hedge_and_its_primary_that_never_got_a_connection_both_leave_rpm_alone() -> None:
    """A hedge at the primary's upstream while the primary waits for a connection: both
    wait, neither is sent, and each gives back its own rpm count. The hedge's reservation
    replaced the primary's in the request's books, so the primary gave back the hedge's
    and the hedge nothing: every such request held one rpm slot for a minute, and the
    upstream was skipped for `capacity` with room left."""
    reached, release = asyncio.Event(), asyncio.Event()

    async def first_held(request: web.Request) -> web.StreamResponse:
        if not reached.is_set():
            reached.set()
            await release.wait()  # holds the only connection until the burst has ended
        return web.Response(text="ok")

    async with upstream(first_held) as only:
        conf = {
            "upstreams": {"only": {"url": only.url, "rpm": 4, "max_connections": 1}},
            "routes": [
                {"id": "plain", "prefix": "/plain/", "plan": ["only"], "deadline_ms": 10000},
                {"id": "hedged", "prefix": "/v1/", "plan": ["only"], "retries": 1,
                 "hedge_after_ms": 20, "deadline_ms": 10000},
            ],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                holder = asyncio.ensure_future(client.get("/plain/chat"))
                await asyncio.wait_for(reached.wait(), 10)
                short = {"x-gateway-deadline-ms": "300"}
                hedged = await client.get("/v1/c", headers=short)
                release.set()
                held = await holder
                after = [await client.get("/plain/chat") for _ in range(3)]
        finally:
            await gateway.aclose()
    assert hedged.status_code == 504
    assert hedged.headers["x-gateway-attempts"] == "2"  # the primary and its hedge
    assert held.status_code == 200
    assert [r.status_code for r in after] == [200] * 3, [r.headers for r in after]
    assert only.count == 4  # the holder and the three after


async def test_tpm_counts_the_request_estimate(recorded: Recorded) -> None:
    async with upstream(status_handler(200, b"ok")) as only:
        conf = {
            "upstreams": {"only": {"url": only.url, "tpm": 1000}},
            "routes": [
                {
                    "id": "chat",
                    "prefix": "/v1/",
                    "plan": ["only"],
                    "replayable_methods": ["POST"],
                }
            ],
        }
        gateway = Gateway(host_app, config=conf, telemetry=recorded.telemetry)
        try:
            async with client_for(gateway) as client:
                body = {"model": "m", "max_tokens": 400, "messages": []}
                statuses = [
                    (await client.post("/v1/chat", json=body)).status_code for _ in range(3)
                ]
        finally:
            await gateway.aclose()
    # ~10 input tokens + 400 output tokens each: two fit in 1000, the third does not.
    assert statuses == [200, 200, 503]
    assert only.count == 2


async def test_an_error_answer_without_usage_gives_its_token_estimate_back(
    recorded: Recorded,
) -> None:
    # A caller asks for an output limit the upstream refuses at once (OpenAI: 400 "max_tokens
    # is too large"): nothing was generated. Its estimate stayed counted against tpm for a
    # minute, so one such request a minute left every other caller capacity-skipped.
    refusal = b'{"error": {"type": "invalid_request_error", "message": "max_tokens too large"}}'
    async with upstream(status_handler(400, refusal)) as only:
        conf = {
            "upstreams": {"only": {"url": only.url, "tpm": 1000, "rpm": 3}},
            "routes": [
                {
                    "id": "chat",
                    "prefix": "/v1/",
                    "plan": ["only"],
                    "replayable_methods": ["POST"],
                }
            ],
        }
        gateway = Gateway(host_app, config=conf, telemetry=recorded.telemetry)
        try:
            async with client_for(gateway) as client:
                body = {"model": "m", "max_tokens": 900, "messages": []}
                statuses = [
                    (await client.post("/v1/chat", json=body)).status_code for _ in range(4)
                ]
        finally:
            await gateway.aclose()
    # Each is ~910 tokens of the 1000: without the estimate given back, the second was
    # skipped for capacity (503). The requests still count against rpm: the fourth is not.
    assert statuses == [400, 400, 400, 503]
    assert only.count == 3


async def test_an_error_answer_the_walk_moves_past_gives_its_token_estimate_back(
    recorded: Recorded,
) -> None:
    # A pool's 401 on a path its keys may not use (moving to the next key), a 503 failing
    # over: the answer is not relayed, nothing was generated. Its estimate stayed counted, so
    # one request per key held the pool's tpm for a minute.
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(200, b"ok")) as backup,
    ):
        conf = {
            "gateway": {"breaker": NO_BREAKER},
            "upstreams": {
                "primary": {"url": primary.url, "tpm": 1000},
                "backup": {"url": backup.url},
            },
            "routes": [
                {
                    "id": "chat",
                    "prefix": "/v1/",
                    "plan": ["primary", "backup"],
                    "retries": 1,
                    "replayable_methods": ["POST"],
                }
            ],
        }
        gateway = Gateway(host_app, config=conf, telemetry=recorded.telemetry)
        try:
            async with client_for(gateway) as client:
                body = {"model": "m", "max_tokens": 900, "messages": []}
                responses = [await client.post("/v1/chat", json=body) for _ in range(3)]
        finally:
            await gateway.aclose()
    assert [r.status_code for r in responses] == [200] * 3
    assert [r.headers.get("x-gateway-skipped") for r in responses] == [None] * 3
    assert primary.count == 3


async def test_repeats_under_load_stay_within_the_budget(recorded: Recorded) -> None:
    budget = {"percent": 20, "min_per_second": 0.5, "window_ms": 10_000}
    async with upstream(status_handler(503)) as primary:
        conf = {
            "gateway": {"repeat_budget": budget, "breaker": NO_BREAKER},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["primary"], "retries": 5,
                 "backoff_ms": 0}
            ],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf, telemetry=recorded.telemetry)
        try:
            async with client_for(gateway) as client:
                responses = await asyncio.gather(*(client.get("/v1/chat") for _ in range(40)))
        finally:
            await gateway.aclose()
    assert all(r.status_code == 502 for r in responses)
    assert {r.json()["error"]["code"] for r in responses} == {"upstream_failed"}
    repeats = primary.count - 40
    assert 0 < repeats <= 40 * 0.2 + 0.5 * 10  # without the budget: 200 repeats
    assert recorded.skips()[("primary", "repeat_budget")] >= 1


async def test_without_the_budget_every_repeat_runs(recorded: Recorded) -> None:
    # The negative control for the test above: a generous budget changes the count.
    budget = {"percent": 1000, "min_per_second": 1000}
    async with upstream(status_handler(503)) as primary:
        conf = {
            "gateway": {"repeat_budget": budget, "breaker": NO_BREAKER},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["primary"], "retries": 5,
                 "backoff_ms": 0}
            ],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf, telemetry=recorded.telemetry)
        try:
            async with client_for(gateway) as client:
                await asyncio.gather(*(client.get("/v1/chat") for _ in range(40)))
        finally:
            await gateway.aclose()
    assert primary.count == 40 * 6


@pytest.mark.e2e
async def test_two_gateway_processes_share_the_count_through_redis(
    redis_url: str, tmp_path: Path
) -> None:
    async with upstream(status_handler(503)) as primary, upstream(limited_backup(5)) as backup:
        path = tmp_path / "gateway.toml"
        path.write_text(
            f"""
[gateway]
state = "{redis_url}"

[upstreams.primary]
url = "{primary.url}"

[upstreams.backup]
url = "{backup.url}"
rpm = 5

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retries = 1
backoff_ms = 0
failover_status = [429, 503]
"""
        )
        ports = [free_port(), free_port()]
        logs = [tmp_path / "one.log", tmp_path / "two.log"]
        with ExitStack() as stack:
            processes = [
                stack.enter_context(serve_process(path, port, log))
                for port, log in zip(ports, logs, strict=True)
            ]
            for process, port, log in zip(processes, ports, logs, strict=True):
                await wait_listening(process, port, log)
            async with httpx.AsyncClient(timeout=10) as client:
                statuses = [
                    (await client.get(f"http://127.0.0.1:{port}/v1/chat")).status_code
                    for _ in range(4)
                    for port in ports
                ]
    assert backup.count == 5  # 4 + 4 failovers, 5 slots between the two processes
    assert sorted(statuses)[:5] == [200] * 5
    assert all(status in (502, 503) for status in sorted(statuses)[5:])


async def test_a_hedge_over_the_budget_is_not_started(recorded: Recorded) -> None:
    budget = {"percent": 0, "min_per_second": 0}  # no repeat at all
    async with upstream(status_handler(200, b"slow primary", delay=0.3)) as primary:
        conf = {
            "gateway": {"repeat_budget": budget},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["primary"], "retries": 1,
                 "hedge_after_ms": 20}
            ],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf, telemetry=recorded.telemetry)
        try:
            async with client_for(gateway) as client:
                response = await client.get("/v1/chat")
        finally:
            await gateway.aclose()
    assert response.text == "slow primary"  # the first attempt runs on and is served
    assert response.headers["x-gateway-attempts"] == "1"
    assert primary.count == 1
    assert recorded.skip_events() == [("primary", "repeat_budget")]


async def test_a_caller_that_leaves_during_the_backoff_gives_the_repeats_slot_back() -> None:
    """The repeat admitted before `backoff_ms` was never sent when the caller hangs up
    during the backoff: it takes no slot of the upstream's `rpm` (rpm = 2: the next request
    still gets its first attempt, and only its own repeat is over the limit)."""
    from tests.helpers import http_scope, request_then_disconnect

    async with upstream(status_handler(503)) as primary:
        conf = {
            "gateway": {"breaker": NO_BREAKER},
            "upstreams": {"primary": {"url": primary.url, "rpm": 2}},
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["primary"], "retries": 1,
                 "backoff_ms": 3_000, "deadline_ms": 10_000}
            ],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf)
        sent: list[Any] = []

        async def send(message: Any) -> None:
            sent.append(message)

        try:
            with anyio.fail_after(5):
                await gateway(http_scope("GET", "/v1/x"), request_then_disconnect(0.5), send)
            assert sent == [] and primary.count == 1  # left in the backoff: no repeat sent
            async with client_for(gateway) as client:
                response = await client.get("/v1/x")
        finally:
            await gateway.aclose()
    assert primary.count == 2  # the second request's first attempt had its slot
    assert response.headers["x-gateway-attempts"] == "1"
    assert response.headers["x-gateway-skipped"] == "primary;reason=capacity"


async def test_a_chunked_body_over_replay_buffer_counts_its_size_against_tpm() -> None:
    """A body sent without Content-Length (chunked) and larger than `replay_buffer` is
    read whole before the walk: its size is known and counts against `tpm` as a declared
    length does. 8,000 bytes are about 2,000 tokens: over tpm = 1000, never sent there."""

    async def chunked() -> Any:
        for _ in range(8):
            yield b"a" * 1000

    async with upstream(status_handler(200, b"ok")) as only:
        conf = {
            "gateway": {"replay_buffer": 1024},
            "upstreams": {"only": {"url": only.url, "tpm": 1000}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["only"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                sized = await client.post("/v1/chat", content=b"a" * 8000)
                streamed = await client.post("/v1/chat", content=chunked())
        finally:
            await gateway.aclose()
    assert sized.status_code == streamed.status_code == 503
    assert streamed.headers["x-gateway-skipped"] == "only;reason=capacity"
    assert only.count == 0


async def test_the_usage_record_lists_a_skip_where_the_walk_met_it() -> None:
    """primary is full (rpm = 1), backup answers: the trail `fallback-mw usage` shows is
    [primary skipped: capacity, backup 200], the walk's order, not the attempts first and
    the skips after them."""
    from fallback_mw.budget import AttemptOutcome
    from fallback_mw.store.ledgers.memory import MemoryLedger

    async with upstream(status_handler(200)) as primary, upstream(status_handler(200)) as backup:
        conf = {
            "upstreams": {"primary": {"url": primary.url, "rpm": 1}, "backup": {"url": backup.url}},
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}
            ],
        }
        ledger = MemoryLedger()
        gateway = Gateway(host_app, config=conf, ledger=ledger)
        try:
            async with client_for(gateway) as client:
                assert (await client.get("/v1/x")).status_code == 200
                assert (await client.get("/v1/x")).headers["x-gateway-provider"] == "backup"
        finally:
            await gateway.aclose()
    first, second = await ledger.usage()
    assert first.attempts == (AttemptOutcome("primary", status=200),)
    assert second.attempts == (
        AttemptOutcome("primary", skipped="capacity"),
        AttemptOutcome("backup", status=200),
    )


class SlowRelease(MemoryHealth):
    """Breakers whose release of an admission takes a round trip (a Redis state's): it
    answers once the caller has gone."""

    def __init__(self) -> None:
        super().__init__()
        self.releasing = asyncio.Event()
        self.caller_gone = asyncio.Event()

    async def release(self, upstream: str, admission: Any = None) -> None:
        self.releasing.set()
        await self.caller_gone.wait()
        await super().release(upstream, admission)


async def test_a_repeat_the_deadline_cut_in_its_backoff_gives_back_its_rpm_count() -> None:
    """The deadline passed while the walk waited `backoff_ms` before a repeat: the repeat,
    counted against the upstream's rpm, is taken back (the breaker's admission, then the
    count). A caller that hung up during the first of those round trips cut the second:
    the count stood for a request never sent, the upstream's rpm short by one for a
    minute. Both are made however the caller leaves."""
    async with upstream(status_handler(503)) as only:
        conf = {
            "upstreams": {"only": {"url": only.url, "rpm": 2}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["only"], "retries": 1,
                        "backoff_ms": 200}],
        }  # fmt: skip
        health = SlowRelease()
        gateway = Gateway(host_app, config=conf, health=health)
        asked = False

        async def receive() -> Message:
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await health.releasing.wait()  # hangs up while the repeat is given back
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            return None

        try:
            scope = http_scope("GET", "/v1/c", headers=[(b"x-gateway-deadline-ms", b"50")])
            cut = asyncio.ensure_future(gateway(scope, receive, send))
            await asyncio.wait_for(health.releasing.wait(), 10)
            await asyncio.sleep(0)  # the walk is cancelled
            health.caller_gone.set()
            await asyncio.wait_for(cut, 10)
            async with client_for(gateway) as client:
                after = await client.get("/v1/c")  # rpm 2: the first attempt and this one
        finally:
            await gateway.aclose()
    assert after.headers["x-gateway-attempts"] == "1", after.headers  # its repeat: no room
    assert only.count == 2


async def test_a_hedged_answer_replaces_its_own_token_estimate() -> None:
    """A slow first attempt hedged: the hedge waited for the upstream's one connection
    (the first attempt held it), the first attempt answered with its usage, and the hedge
    ended unsent, giving back its own count. The usage went to the request's latest
    count, the hedge's, already given back: the served attempt's estimate (its max_tokens)
    stayed in the upstream's tpm for the minute instead of the 10 tokens it used, and the
    upstream was skipped for `capacity` with room left."""
    first = asyncio.Event()

    async def answers(request: web.Request) -> web.StreamResponse:
        if not first.is_set():
            first.set()
            await asyncio.sleep(0.1)  # past hedge_after_ms: the hedge starts and waits
        usage = {"prompt_tokens": 4, "completion_tokens": 6}
        return web.json_response({"model": "m", "usage": usage})

    body = json.dumps({"model": "m", "max_tokens": 400, "messages": []}).encode()
    estimate = estimate_tokens(len(body), json.loads(body))
    # Room for a request and its hedge (2 estimates), and for two more requests after
    # one that used 10 tokens; not for them after one whose estimate stayed.
    tpm = 2 * estimate + 5
    async with upstream(answers) as only:
        conf = {
            "upstreams": {"only": {"url": only.url, "tpm": tpm, "max_connections": 1}},
            "routes": [
                {"id": "plain", "prefix": "/plain/", "plan": ["only"],
                 "replayable_methods": ["POST"]},
                {"id": "hedged", "prefix": "/v1/", "plan": ["only"], "retries": 1,
                 "hedge_after_ms": 20, "replayable_methods": ["POST"]},
            ],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                hedged = await client.post("/v1/chat", content=body)
                after = [(await client.post("/plain/chat", content=body)) for _ in range(2)]
        finally:
            await gateway.aclose()
    assert hedged.status_code == 200
    assert hedged.headers["x-gateway-attempts"] == "2"  # the hedge started, never sent
    assert [r.status_code for r in after] == [200, 200], [r.headers for r in after]
    assert only.count == 3


async def test_a_refused_repeat_says_allowance_not_budget() -> None:
    """ "Budget" is money here (402 budget_exceeded): a 502 that said "the upstream's budget
    for repeats is spent" read to an operator as a spend limit. It names the repeat
    allowance, and the key that sets it."""
    allowance = {"percent": 0, "min_per_second": 0}
    async with upstream(status_handler(503)) as primary:
        conf = {
            "gateway": {"repeat_budget": allowance, "breaker": NO_BREAKER},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["primary"], "retries": 1,
                 "backoff_ms": 0}
            ],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                answer = await client.get("/v1/chat")
        finally:
            await gateway.aclose()
    error = answer.json()["error"]
    assert (answer.status_code, error["rule"]) == (502, "repeat_budget"), error
    assert "repeat allowance" in error["message"], error["message"]
    assert "budget" not in error["message"].replace("[gateway.repeat_budget]", ""), error
