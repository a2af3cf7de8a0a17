"""Time and clocks as a platform team meets them: durations at their limits, and the
windows, cool-downs and expiries that must not follow a wall-clock step (NTP, VM resume)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from fallback_mw import Gateway
from fallback_mw.config import ConfigError, load_config
from fallback_mw.health.memory import MemoryHealth
from tests.helpers import client_for, gateway_client
from tests.test_cli_admin import cli, expires_at, host_app
from tests.test_credential_pool import Clock, key_a_back_after, limited, two_keys
from tests.test_credential_pool import gateway_client as pool_client
from tests.test_faults import config as faults_config
from tests.test_faults import get
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.anyio

THIRTY_ONE_DAYS_MS = 31 * 86_400_000


def timed(url: str, engine: str, *, upstream_ms: int, hedge_ms: int = 0) -> dict[str, Any]:
    timeouts = {
        key: upstream_ms
        for key in ("connect_timeout_ms", "first_byte_timeout_ms", "idle_timeout_ms")
    }
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine},
        "upstreams": {"p": {"url": url, **timeouts}, "b": {"url": url + "/b"}},
        "routes": [
            {"id": "chat", "prefix": "/v1/", "plan": ["p", "b"], "retries": 2,
             "hedge_after_ms": hedge_ms},
        ],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("where", "key"),
    [
        ("upstreams.p", "connect_timeout_ms"),
        ("upstreams.p", "first_byte_timeout_ms"),
        ("upstreams.p", "idle_timeout_ms"),
        ("routes['chat']", "hedge_after_ms"),
    ],
)
async def test_a_timer_too_long_for_a_float_is_refused_at_load_naming_its_key(
    where: str, key: str
) -> None:
    # 1e400 ms loaded (`check` said valid) and every request then ended in a bare 500: the
    # conversion to seconds raised OverflowError on the request path.
    conf = timed("http://127.0.0.1:9", "aiohttp", upstream_ms=1000)
    section = conf["upstreams"]["p"] if where.startswith("upstreams") else conf["routes"][0]
    section[key] = 10**400
    with pytest.raises(ConfigError, match=re.escape(f"{where}.{key}: must be at most 2678400000")):
        load_config(conf)


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_the_longest_timers_the_loader_takes_serve_on_both_engines(engine: str) -> None:
    async with upstream(status_handler(200, b"ok")) as up:
        conf = timed(up.url, engine, upstream_ms=THIRTY_ONE_DAYS_MS, hedge_ms=THIRTY_ONE_DAYS_MS)
        async with gateway_client(conf) as client:
            response = await client.get("/v1/x")
    assert response.status_code == 200, response.text
    assert response.text == "ok" and response.headers["x-gateway-provider"] == "p"


class SteppedClocks:
    """The process's clocks after an NTP correction steps the wall clock: `step_wall` moves
    the first, `advance` both (the time that really passed). Each reads the real clock it
    replaces, taken before any patch."""

    def __init__(self) -> None:
        self.wall_offset = 0.0
        self.passed = 0.0
        self._time = time.time
        self._monotonic = time.monotonic

    def time(self) -> float:
        return self._time() + self.wall_offset + self.passed

    def monotonic(self) -> float:
        return self._monotonic() + self.passed

    def step_wall(self, seconds: float) -> None:
        self.wall_offset += seconds

    def advance(self, seconds: float) -> None:
        self.passed += seconds


@pytest.mark.parametrize("step", [-3600.0, 3600.0])
async def test_the_rpm_window_rolls_with_time_passed_not_with_the_wall_clock(step: float) -> None:
    # The rolling minute of a declared rpm was kept on the wall clock: an NTP step back of
    # an hour kept the last minute's requests counted for that hour (every request skipped
    # as `capacity`, 503 route_exhausted with a Retry-After of 3660 s), and a step forward
    # emptied the window at once (the upstream's declared limit exceeded).
    clocks = SteppedClocks()
    async with upstream(status_handler(200, b"ok")) as up:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"]},
            "upstreams": {"only": {"url": up.url, "rpm": 2}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["only"]}],
        }
        # The wall clock is stepped for the whole process, as NTP steps it for every reader;
        # the monotonic one is the clock the gateway is built with, stepped only while it is
        # built (the event loop's timers keep the real one). Both builds read them so: a
        # compiled module does not read its own module's `time` name, which a patch of
        # `fallback_mw.capacity.memory.time` replaced.
        with mock.patch("time.time", clocks.time):
            with mock.patch("time.monotonic", clocks.monotonic):
                gateway = Gateway(host_app, config=conf)
            try:
                async with client_for(gateway) as client:
                    two = [(await client.get("/v1/a")).status_code for _ in range(2)]
                    assert two == [200, 200]
                    clocks.step_wall(step)  # within the same minute: the rpm is spent
                    refused = await client.get("/v1/a")
                    assert refused.status_code == 503, refused.text
                    assert 1 <= int(refused.headers["retry-after"]) <= 60
                    clocks.advance(61)  # a minute really passed: room for two again
                    two = [(await client.get("/v1/a")).status_code for _ in range(2)]
                    assert two == [200, 200]
            finally:
                await gateway.aclose()
    assert up.count == 4


# --- fault expiries between hosts whose clocks differ (PostgreSQL store) ---------------


@pytest.mark.slow
async def test_gateway_hosts_with_skewed_clocks_start_and_end_a_fault_together(
    pg_url: str,
) -> None:
    # Each host compared the stored expiry with its own wall clock: a gateway ten minutes
    # ahead (broken NTP) never applied a 4-second fault, one ten minutes behind kept it for
    # ten minutes more. They now read it on the database's clock.
    real = time.time
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        status, out, err = await cli(
            "faults", "set", "fail", "--store", pg_url, "--upstream", "primary", "--ttl", "4"
        )
        assert status == 0, err
        expiry = expires_at(out)  # the database's clock, on this machine: this one's too
        conf = faults_config(pg_url, primary.url, backup.url)
        with mock.patch("time.time", lambda: real() + 600):
            ahead = Gateway(host_app, config=conf, environ={})
            try:
                applied = await get(ahead)
            finally:
                await ahead.aclose()
        with mock.patch("time.time", lambda: real() - 600):
            behind = Gateway(host_app, config=conf, environ={})
            try:
                during = await get(behind)
                await asyncio.sleep(max(expiry + 0.3 - real(), 0))
                after = await get(behind)
            finally:
                await behind.aclose()
    assert real() - expiry < 30, "the test itself ran too late to judge the expiry"
    assert (applied.text, applied.headers.get("x-gateway-fault")) == ("backup", "1")
    assert (during.text, during.headers.get("x-gateway-fault")) == ("backup", "1")
    assert after.text == "primary" and "x-gateway-fault" not in after.headers


async def test_a_fault_set_from_a_shell_whose_clock_is_off_lasts_its_ttl(pg_url: str) -> None:
    # `faults set --ttl 60` from an operator's laptop ten minutes ahead stored an expiry
    # eleven minutes away on the gateways' clocks; the ttl is now counted on the store's.
    real = time.time
    with mock.patch("time.time", lambda: real() + 600):
        status, out, err = await cli(
            "faults", "set", "fail", "--store", pg_url, "--upstream", "primary", "--ttl", "60"
        )
    assert status == 0, err
    assert abs(expires_at(out) - (real() + 60)) < 10, out
    _, listed, _ = await cli("faults", "list", "--store", pg_url)
    assert f"expires_at={expires_at(out):.3f}" in listed


# --- Retry-After in each HTTP-date form --------------------------------------------------


@pytest.mark.parametrize(
    "form",
    ["%a, %d %b %Y %H:%M:%S GMT", "%A, %d-%b-%y %H:%M:%S GMT", "%a %b %e %H:%M:%S %Y"],
    ids=["imf-fixdate", "rfc850", "asctime"],
)
async def test_a_pool_credential_cools_until_a_retry_after_date_in_any_http_date_form(
    form: str,
) -> None:
    # RFC 9110 §5.6.7: a recipient MUST accept all three HTTP-date forms. The asctime one
    # (no zone written: it is GMT) read as unreadable, so the key cooled for cooldown_ms
    # (5 s) and was asked again long before the moment the upstream named.
    when = datetime.now(UTC) + timedelta(seconds=120)
    answers = {"key-a": (b'{"error": {"code": "rate_limit_exceeded"}}',
                         {"retry-after": when.strftime(form)})}  # fmt: skip
    clock = Clock()
    async with (
        upstream(limited(answers)) as pool,
        pool_client(two_keys(pool.url), health=MemoryHealth(clock=clock)) as client,
    ):
        response = await client.get("/v1/x")  # key-a: 429, then key-b within the request
        assert (response.status_code, response.text) == (200, "key-b")
        answers.clear()  # key-a would answer now: only its cool-down keeps it out
        clock.now += 100  # well past cooldown_ms, still before the date
        assert not await key_a_back_after(client, pool)
        clock.now += 30
        assert await key_a_back_after(client, pool)


@pytest.mark.slow
async def test_a_game_day_on_a_host_whose_clock_runs_slow_ends_when_its_fault_expires(
    pg_url: str, tmp_path: Path
) -> None:
    # The fault's expiry is the store's clock; this host's runs at half speed (a clock
    # NTP has not disciplined). The exercise read the fault gone before its own end and
    # reported it cleared outside the command (status aborted); it is its expiry.
    config = tmp_path / "gw.toml"
    config.write_text(
        f'[gateway]\nstore = "{pg_url}"\n\n'
        '[upstreams.primary]\nurl = "http://127.0.0.1:9"\n\n'
        '[upstreams.backup]\nurl = "http://127.0.0.1:10"\n\n'
        '[[routes]]\nid = "chat"\nprefix = "/chat/"\nplan = ["primary", "backup"]\nretries = 1\n'
    )
    out = tmp_path / "gd.json"
    real = time.time
    started = real()
    with mock.patch("time.time", lambda: started + (real() - started) / 2):
        status, printed, err = await cli(
            "gameday", "--config", str(config), "--route", "chat", "--fault", "fail",
            "--duration", "2s", "--recovery-wait", "1s", "--owner", "Ana", "--out", str(out),
            "--predict", "error_rate=5%", "--abort", "error_rate=50%",
        )  # fmt: skip
    assert status == 1, err  # no traffic: the prediction has no data
    report = json.loads(out.read_text())
    assert report["status"] == "completed", printed
    assert "cleared outside" not in printed and "time is up: fault cleared" in printed


def _upstream_dates(skew: float, then: float, form: str) -> dict[str, str]:
    """The headers of a 429 from an upstream whose clock is `skew` seconds off this host's,
    naming a moment `then` seconds after its own now."""
    sent = datetime.now(UTC) + timedelta(seconds=skew)
    date = "%a, %d %b %Y %H:%M:%S GMT"
    if form == "retry-after":
        return {"date": sent.strftime(date),
                "retry-after": (sent + timedelta(seconds=then)).strftime(date)}  # fmt: skip
    reset = (sent + timedelta(seconds=then)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"date": sent.strftime(date), "anthropic-ratelimit-requests-remaining": "0",
            "anthropic-ratelimit-requests-reset": reset}  # fmt: skip


@pytest.mark.parametrize("form", ["retry-after", "anthropic-reset"])
@pytest.mark.parametrize("skew", [-600.0, 600.0], ids=["host-ahead", "host-behind"])
async def test_a_moment_an_answer_names_is_counted_from_its_own_date(
    skew: float, form: str
) -> None:
    # A Retry-After date (or a quota's reset time) was counted from this host's clock: with
    # the gateway host ten minutes ahead of the provider's, "come back in 2 minutes" read as
    # long past and the key was asked again at once; ten minutes behind, it was kept out
    # for max_cooldown_ms. The answer's own Date is the moment it is counted from.
    answers = {"key-a": (b'{"error": {"code": "rate_limit_exceeded"}}',
                         _upstream_dates(skew, 120, form))}  # fmt: skip
    clock = Clock()
    async with (
        upstream(limited(answers)) as pool,
        pool_client(two_keys(pool.url), health=MemoryHealth(clock=clock)) as client,
    ):
        response = await client.get("/v1/x")  # key-a: 429, then key-b within the request
        assert (response.status_code, response.text) == (200, "key-b")
        answers.clear()
        clock.now += 100
        assert not await key_a_back_after(client, pool)
        clock.now += 30
        assert await key_a_back_after(client, pool)


@pytest.mark.slow
async def test_a_fault_ends_on_time_on_a_gateway_host_that_was_suspended(
    tmp_path: Path,
) -> None:
    # A gateway carries the store's clock on its monotonic clock between reads of it; that
    # clock stops while the host is suspended (a paused VM), so a fault read before a ten
    # minute pause stayed on for ten minutes past its end. While a fault is set, the
    # store's clock is read again at every wake of the reloader.
    store = f"sqlite:///{tmp_path / 'store.db'}"
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        status, out, err = await cli(
            "faults", "set", "fail", "--store", store, "--upstream", "primary", "--ttl", "3"
        )
        assert status == 0, err
        expiry = expires_at(out)
        gateway = Gateway(
            host_app, config=faults_config(store, primary.url, backup.url), environ={}
        )
        runtime = gateway.services.store
        assert runtime is not None
        runtime.poll_interval = 0.05
        paused = 0.0

        def monotonic() -> float:  # this host's monotonic clock, which stops in a pause
            return time.monotonic() - paused

        runtime.faults._clock = monotonic
        try:
            during = await get(gateway)
            paused = 600.0  # the host was suspended for ten minutes
            await asyncio.sleep(max(expiry + 0.5 - time.time(), 0))
            after = await get(gateway)
        finally:
            await gateway.aclose()
    assert (during.text, during.headers.get("x-gateway-fault")) == ("backup", "1")
    assert after.text == "primary" and "x-gateway-fault" not in after.headers
