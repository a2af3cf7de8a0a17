"""`fallback-mw gameday`: what it refuses before setting anything, how it reads its
predictions and abort criteria, and what it computes from usage records."""

from __future__ import annotations

import asyncio
import socket
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from fallback_mw.budget import AttemptOutcome, UsageRecord
from fallback_mw.cli import main
from fallback_mw.cli.game_day.observe import judge, observe, windowed
from fallback_mw.cli.game_day.spec import SpecError, parse_abort, parse_duration, parse_prediction
from fallback_mw.store.routes import Fault, open_store
from tests.helpers import sqlite_db

# --- spec -----------------------------------------------------------------------------


def test_predictions_and_criteria_parse() -> None:
    assert parse_prediction("breaker_open_s=20").value == 20
    assert parse_prediction("p99_ms=3500").value == 3500
    assert parse_prediction("error_rate=1%").value == pytest.approx(0.01)
    assert parse_prediction("error_rate=0.02").value == pytest.approx(0.02)
    criterion = parse_abort("error_rate=1%/60s")
    assert (criterion.threshold, criterion.window_s) == (pytest.approx(0.01), 60)
    assert parse_abort("p99_ms=6000").window_s == 60  # the default window
    assert parse_abort("secondary_429=5%/2m").window_s == 120
    assert parse_duration("15m") == 900 and parse_duration("500ms") == 0.5


@pytest.mark.parametrize(
    "bad",
    ["breaker_open_s", "nonsense=3", "p99_ms=fast", "p99_ms=35%", "error_rate=150%", "p99_ms=-1"],
)
def test_bad_predictions_are_refused(bad: str) -> None:
    with pytest.raises(SpecError):
        parse_prediction(bad)


@pytest.mark.parametrize("bad", ["breaker_open_s=3", "error_rate=1%/0s", "p99_ms=6000/soon"])
def test_bad_abort_criteria_are_refused(bad: str) -> None:
    with pytest.raises(SpecError):
        parse_abort(bad)


@pytest.mark.parametrize("bad", ["0", "-5m", "2d", "25h", "fifteen"])
def test_bad_durations_are_refused(bad: str) -> None:
    with pytest.raises(SpecError):
        parse_duration(bad)


# --- observe ---------------------------------------------------------------------------

T0 = 1_800_000_000.0


def record(
    at: float,
    *,
    ms: float | None = 10.0,
    outcome: str = "served",
    chosen: str | None = "primary",
    attempts: tuple[AttemptOutcome, ...] = (),
) -> UsageRecord:
    return UsageRecord(
        request_id=f"r{at}",
        route="chat",
        tenant="t",
        at=datetime.fromtimestamp(at, UTC),
        candidates=("primary", "backup"),
        attempts=attempts,
        chosen=chosen,
        outcome=outcome,
        duration_ms=ms,
    )


def test_observe_counts_what_happened() -> None:
    fell_back = (
        AttemptOutcome("primary", status=503, failure="fault"),
        AttemptOutcome("backup", status=200),
    )
    skipped = (
        AttemptOutcome("primary", skipped="breaker_open"),
        AttemptOutcome("backup", status=429),
    )
    records = [
        record(T0 + 1.0, attempts=(AttemptOutcome("primary", status=200),)),
        record(T0 + 2.0, chosen="backup", attempts=fell_back, ms=40),
        record(T0 + 3.5, chosen="backup", attempts=skipped, ms=1000),
        record(T0 + 4.0, outcome="upstream_failed", chosen=None, ms=3000),
        record(T0 + 5.0, outcome="client_disconnected", chosen=None),  # the caller's doing
    ]
    seen = observe(records, t0=T0, primary="primary", faulted_upstream="primary")
    assert seen["requests"] == 5
    assert seen["errors"] == 1 and seen["error_rate"] == 0.2
    assert seen["fallbacks"] == 2
    assert seen["first_fallback_s"] == pytest.approx(2.0 - 0.04)
    assert seen["breaker_open_s"] == pytest.approx(3.5 - 1.0)
    assert (seen["secondary_calls"], seen["secondary_429"]) == (2, 1)
    assert seen["p99_ms"] == 3000 and seen["p50_ms"] == 40
    assert windowed("error_rate", records[-2:], "primary") == 0.5
    assert windowed("secondary_429", records[:2], "primary") == 0.0


def test_predictions_are_judged_as_upper_bounds_and_missing_data_never_passes() -> None:
    observed = {"p99_ms": 3000.0, "breaker_open_s": None, "error_rate": 0.0}
    results = judge(
        (
            parse_prediction("p99_ms=3500"),
            parse_prediction("p99_ms=2999"),
            parse_prediction("breaker_open_s=20"),
            parse_prediction("error_rate=1%"),
        ),
        observed,
    )
    assert [r["result"] for r in results] == ["pass", "fail", "no data", "pass"]


# --- refusals: exit 2, nothing set ------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    config = tmp_path / "gw.toml"
    config.write_text(
        f'[gateway]\nstore = "{url}"\n\n'
        '[upstreams.primary]\nurl = "http://127.0.0.1:9"\n\n'
        '[upstreams.backup]\nurl = "http://127.0.0.1:10"\n\n'
        '[[routes]]\nid = "chat"\nprefix = "/chat/"\nplan = ["primary", "backup"]\nretries = 1\n'
    )
    return str(config)


async def _faults(config: str) -> list[Fault]:
    url = f"sqlite:///{Path(config).parent / 'store.db'}"
    route_store = open_store(url)
    try:
        return await route_store.load_faults()
    finally:
        await route_store.aclose()


BASE = ["gameday", "--route", "chat", "--fault", "fail", "--duration", "5s", "--owner", "Ana"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--abort", "error_rate=1%"], "no --predict"),
        (["--predict", "p99_ms=3500"], "no --abort"),
        (["--predict", "latency=3", "--abort", "error_rate=1%"], "unknown quantity"),
        (["--predict", "p99_ms=1", "--abort", "error_rate=1%", "--candidate", "x"], "not one of"),
        (["--predict", "p99_ms=1", "--abort", "error_rate=1%", "--duration", "25h"], "24h"),
        (["--predict", "alert:FallbackMwBreakerOpen<=90s", "--abort", "p99_ms=1"], "--prometheus"),
        (["--predict", "alert:<=90s", "--abort", "p99_ms=1"], "alert:NAME<=DURATION"),
        (["--predict", "alert:X<=soon", "--abort", "p99_ms=1"], "expected a number"),
        (["--predict", "p99_ms=1", "--abort", "p99_ms=1", "--owner", " "], "--owner NAME"),
        (
            ["--predict", "p99_ms=1", "--abort", "p99_ms=1", "--prometheus", "ftp://x"],
            "expected http(s)://",
        ),
        (
            ["--predict", "p99_ms=1", "--abort", "p99_ms=1", "--prometheus", "http://[x"],
            "expected http(s)://",
        ),
    ],
)
def test_refusals_exit_2_and_set_nothing(
    store: str, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*BASE, "--config", store, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fallback-mw: error: ") and message in err
    assert len(err.strip().splitlines()) == 1
    assert asyncio.run(_faults(store)) == []


@pytest.mark.parametrize(
    "url",
    [
        "admin:hunter2-secret@prom:9090",  # the scheme forgotten
        "htp://admin:hunter2-secret@prom:9090",
        "prom:9090/api?token=hunter2-secret",
        "https://admin:hunter2-secret@prom:9090",
        "https://prom:9090/#hunter2-secret",
    ],
)
def test_a_prometheus_url_refused_never_shows_its_password_or_query(
    store: str, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--prometheus admin:PW@prom:9090` (no scheme) was refused quoting the URL, so the
    password went to the terminal and the CI log."""
    argv = [*BASE, "--config", store, "--predict", "p99_ms=1", "--abort", "p99_ms=1"]
    assert main([*argv, "--prometheus", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fallback-mw: error: --prometheus") and "hunter2" not in err
    assert len(err.strip().splitlines()) == 1
    assert asyncio.run(_faults(store)) == []


def test_refuses_unknown_route_pin_without_candidate_and_a_missing_store(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ok = ["--predict", "p99_ms=1", "--abort", "error_rate=1%", "--owner", "Ana"]
    argv = ["gameday", "--route", "nope", "--fault", "fail", "--duration", "5s", *ok]
    assert main([*argv, "--config", store]) == 2
    assert "unknown route 'nope'" in capsys.readouterr().err
    pin = ["gameday", "--route", "chat", "--fault", "pin", "--duration", "5s", *ok]
    assert main([*pin, "--config", store]) == 2
    assert "--fault pin needs --candidate" in capsys.readouterr().err
    # A pin to the primary changes nothing: an exercise that would pass having done nothing.
    assert main([*pin, "--candidate", "primary", "--config", store]) == 2
    assert "already the first candidate of route 'chat'" in capsys.readouterr().err
    assert main([*BASE, *ok]) == 2
    assert "no store" in capsys.readouterr().err
    assert asyncio.run(_faults(store)) == []


def test_refuses_to_overwrite_a_fault_already_set(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"

    async def preset() -> None:
        route_store = open_store(url)
        try:
            await route_store.set_fault(Fault("hang", "primary", time.time() + 60))
        finally:
            await route_store.aclose()

    asyncio.run(preset())
    argv = [*BASE, "--config", store, "--predict", "p99_ms=1", "--abort", "error_rate=1%"]
    assert main([*argv, "--out", str(tmp_path / "r.json")]) == 2
    assert "already set on 'primary'" in capsys.readouterr().err
    (kept,) = asyncio.run(_faults(store))
    assert kept.kind == "hang"  # the operator's own fault is untouched


# --- incremental record reads, the recovery, the report's events -----------------------


@pytest.mark.anyio
async def test_record_feed_reads_incrementally_from_a_real_ledger(ledger_store: str) -> None:
    """Each poll asks the ledger (SQLite, PostgreSQL) only for records that ended after
    the newest one seen (less the lag allowance): over 20 polls of 50 new records each the
    feed fetches a bounded number per poll, never the whole history again; a record written
    late (its end a little before the newest seen, within the allowance) is still picked
    up, once."""
    from fallback_mw.cli.game_day.run import RECORD_LAG_S, RecordFeed
    from fallback_mw.store.ledgers import open_ledger

    async def work() -> tuple[RecordFeed, list[int]]:
        ledger = open_ledger(ledger_store)
        now = time.time()
        feed = RecordFeed(ledger, "chat", since=now - 1)
        per_poll = []
        try:
            for step in range(20):
                for i in range(50):
                    at = now + step * 10 + i * 0.1  # 10 s of traffic per step
                    await ledger.record_usage(
                        UsageRecord(
                            request_id=f"s{step}-{i}", route="chat", tenant="t",
                            at=datetime.fromtimestamp(at, UTC), duration_ms=5.0,
                        )
                    )  # fmt: skip
                if step == 10:  # a writer that lagged: ended 2 s before the newest seen
                    late = now + 9 * 10 + 4.9 - 2
                    await ledger.record_usage(
                        UsageRecord(
                            request_id="late", route="chat", tenant="t",
                            at=datetime.fromtimestamp(late, UTC), duration_ms=5.0,
                        )
                    )  # fmt: skip
                before = feed.fetched
                await feed.poll()
                per_poll.append(feed.fetched - before)
        finally:
            await ledger.aclose()
        return feed, per_poll

    feed, per_poll = await work()
    assert len(feed.records) == 20 * 50 + 1
    assert len({r.request_id for r in feed.records}) == len(feed.records)
    assert sum(1 for r in feed.records if r.request_id == "late") == 1
    # 50 new records plus at most the lag allowance's worth again (0.1 s apart)
    assert max(per_poll) <= 50 + RECORD_LAG_S / 0.1 + 2
    assert feed.fetched < 2 * len(feed.records)  # a full re-read would be ~10x
    # The abort criteria's window, read from the tail: the same records a full scan finds.
    newest = max(r.at.timestamp() for r in feed.records)
    for window in (0.5, 3.0, 12.0, 60.0):
        brute = [r for r in feed.records if r.at.timestamp() >= newest - window]
        assert feed.ended_since(newest - window) == brute


def test_events_order_the_milestones_and_recovery_is_judged() -> None:
    from fallback_mw.cli.game_day.report import events

    report: dict[str, Any] = {
        "fault": {"seconds_set": 10.0},
        "observed": {"breaker_open_s": 1.5, "first_fallback_s": 0.4, "recovery_s": 0.7},
        "prometheus": {
            "alerts": {
                "FallbackMwBreakerOpen": {"pending_s": 2.0, "firing_s": 3.0, "resolved_s": 12.0},
                "FallbackMwSilentFallback": {"pending_s": 2.0, "firing_s": None},
            }
        },
    }
    listed = events(report)
    assert [(e["event"], e["at_s"]) for e in listed] == [
        ("fault_set", 0.0),
        ("first_fallback", 0.4),
        ("breaker_open", 1.5),
        ("alert_firing", 3.0),
        ("revert", 10.0),
        ("primary_success", 10.7),
    ]
    predictions = (parse_prediction("recovery_s=1"), parse_prediction("alert:Nope<=5s"))
    results = judge(predictions, report["observed"], report["prometheus"])
    assert [(r["observed"], r["result"]) for r in results] == [(0.7, "pass"), (None, "no data")]


def test_refuses_when_prometheus_cannot_be_read(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An alert prediction against a Prometheus that does not answer would only ever say
    NO DATA after the whole exercise: refused before anything is set."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connection refused
        argv = [
            *BASE, "--config", store, "--out", str(tmp_path / "r.json"),
            "--predict", "alert:FallbackMwBreakerOpen<=60s", "--abort", "error_rate=1%",
            "--prometheus", f"http://127.0.0.1:{port}",
        ]  # fmt: skip
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot read /api/v1/alerts" in err and "nothing set" in err
    assert asyncio.run(_faults(store)) == []
    assert not (tmp_path / "r.json").exists()


def test_an_alert_already_firing_before_the_fault_is_not_credited_to_it() -> None:
    """The alert API as Prometheus serves it (a scripted endpoint): an alert firing before
    the fault counts only once it has resolved and fires again; a new one counts at once."""
    from aiohttp import web

    from fallback_mw.cli.game_day.prometheus import AlertWatcher

    script: list[dict[str, str]] = [{"Old": "firing"}]

    async def alerts(_: web.Request) -> web.Response:
        states = script[0]
        listed = [{"labels": {"alertname": n}, "state": s} for n, s in states.items()]
        return web.json_response({"status": "success", "data": {"alerts": listed}})

    async def work() -> dict[str, Any]:
        app = web.Application()
        app.router.add_get("/api/v1/alerts", alerts)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        watcher = AlertWatcher(f"http://127.0.0.1:{port}")
        try:
            await watcher.baseline()
            await watcher.poll(now=T0 + 1)  # Old still firing: not the exercise's
            script[0] = {"Old": "firing", "New": "pending"}
            await watcher.poll(now=T0 + 2)
            script[0] = {"Old": "inactive", "New": "firing"}
            await watcher.poll(now=T0 + 3)
            script[0] = {"Old": "firing", "New": "firing"}  # Old fires again: counts now
            await watcher.poll(now=T0 + 4)
            script[0] = {}
            await watcher.poll(now=T0 + 5)
            return watcher.summary(T0)
        finally:
            await watcher.aclose()
            await runner.cleanup()

    summary = asyncio.run(work())
    assert summary["alerts"] == {
        "New": {"pending_s": 2.0, "firing_s": 3.0, "resolved_s": 5.0},
        "Old": {"pending_s": 4.0, "firing_s": 4.0, "resolved_s": 5.0},
    }
    assert summary["polls"] == 5 and summary["failed_polls"] == 0


def test_without_owner_the_login_running_it_owns_the_abort(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exercise always has an owner: --owner, else the login name running the command."""
    from fallback_mw.cli import build_parser
    from fallback_mw.cli import gameday as command

    argv = ["gameday", "--config", store, "--route", "chat", "--fault", "fail", "--duration", "5s"]
    checks = ["--predict", "p99_ms=1", "--abort", "p99_ms=1"]
    monkeypatch.setattr(command.getpass, "getuser", lambda: "Ana Lima")
    exercise, _ = command._exercise(build_parser().parse_args([*argv, *checks]))
    assert exercise.owner == "Ana Lima"
    named, _ = command._exercise(build_parser().parse_args([*argv, *checks, "--owner", "Bo"]))
    assert named.owner == "Bo"


@pytest.mark.anyio
async def test_a_method_the_route_does_not_forward_is_not_a_customer_visible_error() -> None:
    """A scanner's PROPFIND on a routed path is answered 405 `method_not_allowed`: the
    caller's doing, like a malformed or oversized request. The game day's error_rate (and
    the shipped rules, which exclude the same outcomes) must not count it as an outage."""
    from fallback_mw import Gateway
    from tests.helpers import client_for
    from tests.upstreams import host_app, status_handler, upstream

    async with upstream(status_handler(200, b"ok")) as primary:
        conf = {
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                assert (await client.get("/v1/models")).status_code == 200
                for _ in range(3):
                    response = await client.request("PROPFIND", "/v1/models")
                    assert response.status_code == 405
            ledger = gateway.services.ledger
            assert ledger is not None
            records = await ledger.usage(route="chat")
        finally:
            await gateway.aclose()
    assert sorted(r.outcome or "" for r in records) == ["method_not_allowed"] * 3 + ["served"]
    t0 = min(r.at.timestamp() for r in records) - 1
    seen = observe(records, t0=t0, primary="primary", faulted_upstream="primary")
    assert (seen["errors"], seen["error_rate"]) == (0, 0.0)
    assert windowed("error_rate", records, "primary") == 0.0


@pytest.mark.anyio
async def test_a_response_cut_short_counts_and_the_callers_misframing_does_not() -> None:
    """A response that fails after the commit point (outcome `aborted`) is a broken answer a
    customer got; a streamed body that is not its declared length (400 `bad_request`) and a
    method-override header naming a method the route does not forward (405) are the
    caller's own doing. The game day counts them as the shipped rules do, from the records
    the gateway really writes."""
    import anyio
    import httpx
    from aiohttp import web

    from fallback_mw import Gateway
    from tests.hostile.test_request_framing import drive
    from tests.upstreams import host_app, serve_asgi, upstream

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(status=200)
        await response.prepare(request)
        await response.write(b"partial-")
        if request.path == "/v1/stream":
            await anyio.sleep(0.05)
            assert request.transport is not None
            request.transport.abort()
        return response

    async with upstream(answer) as primary:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "replay_buffer": 1024},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["primary"], "methods": ["GET", "POST"]}
            ],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as url, httpx.AsyncClient(base_url=url) as client:
                assert (await client.get("/v1/models")).status_code == 200
                with pytest.raises(httpx.RemoteProtocolError):
                    await client.get("/v1/stream")
                override = {"x-http-method-override": "DELETE"}
                assert (await client.post("/v1/f", headers=override)).status_code == 405
            status, _ = await drive(gateway, 5000, [b"a" * 2000, b"b" * 1000])
            assert status == 400
            ledger = gateway.services.ledger
            assert ledger is not None
            records = await ledger.usage(route="chat")
        finally:
            await gateway.aclose()
    outcomes = sorted(r.outcome or "" for r in records)
    assert outcomes == ["aborted", "bad_request", "method_not_allowed", "served"]
    t0 = min(r.at.timestamp() for r in records) - 1
    seen = observe(records, t0=t0, primary="primary", faulted_upstream="primary")
    assert (seen["requests"], seen["errors"], seen["error_rate"]) == (4, 1, 0.25)


@pytest.mark.anyio
async def test_an_upstream_5xx_relayed_as_served_is_a_customer_visible_error() -> None:
    """An upstream's 500 (a status outside failover_status) and its 503 as the last
    answer under `on_exhausted = "last_response"` are relayed as they are and booked
    `served`: the game day's error_rate (and its `error_rate` abort) read a route whose
    callers got server errors as error-free. A served 5xx is a customer-visible error, as
    the shipped alert rules now count it; a served 4xx stays the upstream's answer."""
    from aiohttp import web

    from fallback_mw import Gateway
    from tests.helpers import client_for
    from tests.upstreams import host_app, upstream

    async def answer(request: web.Request) -> web.StreamResponse:
        status = {"/v1/boom": 500, "/v1/gone": 503, "/v1/slow-down": 429}.get(request.path, 200)
        return web.Response(status=status, text="answer")

    async with upstream(answer) as primary:
        conf = {
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["primary"],
                 "on_exhausted": "last_response"},
            ],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                for path, status in (
                    ("/v1/ok", 200), ("/v1/boom", 500), ("/v1/gone", 503), ("/v1/slow-down", 429),
                ):  # fmt: skip
                    assert (await client.get(path)).status_code == status
            ledger = gateway.services.ledger
            assert ledger is not None
            records = await ledger.usage(route="chat")
        finally:
            await gateway.aclose()
    assert sorted((r.outcome, r.status) for r in records) == [
        ("served", 200), ("served", 429), ("served", 500), ("served", 503),
    ]  # fmt: skip
    t0 = min(r.at.timestamp() for r in records) - 1
    seen = observe(records, t0=t0, primary="primary", faulted_upstream="primary")
    assert (seen["requests"], seen["errors"], seen["error_rate"]) == (4, 2, 0.5)
    assert windowed("error_rate", records, "primary") == 0.5


@pytest.mark.anyio
async def test_an_overloaded_answer_is_a_customer_visible_error_the_game_day_sees() -> None:
    """Requests beyond `max_concurrency` are answered 503 `overloaded` by the resolver,
    before the budget guard: they leave a usage record too, so a hang game day that piles
    requests up past the limit shows those customers' errors (the alert rules count them
    from the metrics; the command read 0 % while customers got 503s)."""
    import anyio

    from fallback_mw import Gateway
    from tests.helpers import client_for
    from tests.upstreams import host_app, status_handler, upstream

    async with upstream(status_handler(200, b"ok", delay=0.5)) as primary:
        conf = {
            "gateway": {"max_concurrency": 1},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        statuses: list[int] = []
        try:
            async with client_for(gateway) as client:

                async def one(delay: float) -> None:
                    await anyio.sleep(delay)
                    statuses.append((await client.get("/v1/models")).status_code)

                async with anyio.create_task_group() as group:
                    group.start_soon(one, 0.0)
                    group.start_soon(one, 0.2)  # while the first is in flight
            ledger = gateway.services.ledger
            assert ledger is not None
            records = await ledger.usage(route="chat")
        finally:
            await gateway.aclose()
    assert sorted(statuses) == [200, 503]
    assert sorted(r.outcome or "" for r in records) == ["overloaded", "served"]
    t0 = min(r.at.timestamp() for r in records) - 1
    seen = observe(records, t0=t0, primary="primary", faulted_upstream="primary")
    assert (seen["requests"], seen["errors"], seen["error_rate"]) == (2, 1, 0.5)


def test_alerts_about_other_routes_and_upstreams_are_not_credited_to_the_exercise(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Prometheus lists every alert of the fleet. An exercise on route chat (plan primary,
    backup) is credited only with the instances about it: another route's upstream whose
    breaker opens during the window (a real outage elsewhere) must not pass chat's
    `alert:FallbackMwBreakerOpen` prediction, and an alert already firing for another
    route must not hide chat's own firing."""
    import http.server
    import json
    import threading

    polls: list[int] = []

    def alert(name: str, **labels: str) -> dict[str, Any]:
        return {"labels": {"alertname": name, **labels}, "state": "firing"}

    class Alerts(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            polls.append(1)
            listed = [alert("FallbackMwErrorRateAbort", gateway_route_id="other")]
            if len(polls) > 1:  # from the first poll after the baseline
                listed += [
                    alert("FallbackMwBreakerOpen", gateway_upstream="elsewhere"),
                    alert("FallbackMwErrorRateAbort", gateway_route_id="chat"),
                    alert("FallbackMwSilentFallback", gateway_route_id="other"),
                ]
            body = json.dumps({"status": "success", "data": {"alerts": listed}}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Alerts)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    out = tmp_path / "r.json"
    try:
        argv = [
            "gameday", "--config", store, "--route", "chat", "--fault", "fail",
            "--duration", "2s", "--recovery-wait", "1s", "--owner", "Ana", "--out", str(out),
            "--prometheus", f"http://127.0.0.1:{server.server_address[1]}",
            "--predict", "alert:FallbackMwBreakerOpen<=5s",
            "--predict", "alert:FallbackMwErrorRateAbort<=5s",
            "--abort", "error_rate=50%",
        ]  # fmt: skip
        assert main(argv) == 1
    finally:
        server.shutdown()
        server.server_close()
    capsys.readouterr()
    report = json.loads(out.read_text())
    results = {p["name"]: p["result"] for p in report["predictions"]}
    assert results == {
        "alert:FallbackMwBreakerOpen": "no data",  # another upstream's breaker
        "alert:FallbackMwErrorRateAbort": "pass",  # chat's own, despite other's firing
    }
    assert sorted(report["prometheus"]["alerts"]) == ["FallbackMwErrorRateAbort"]
    assert report["prometheus"]["firing_before_the_fault"] == []
    assert asyncio.run(_faults(store)) == []


def test_the_report_page_shows_a_dash_for_what_was_not_observed(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A quantity with no data (no breaker opened, no recovery seen) reads '-' on the
    page, as in the printed report; the page said 'None' (Python's spelling)."""
    import re

    out = tmp_path / "r.json"
    argv = [
        *BASE, "--config", store, "--duration", "1s", "--recovery-wait", "1s",
        "--out", str(out), "--predict", "breaker_open_s=5", "--abort", "error_rate=50%",
    ]  # fmt: skip
    assert main(argv) == 1  # no traffic: NO DATA
    assert "breaker open after -" in capsys.readouterr().out
    page = out.with_suffix(".html").read_text()
    observed = re.search(r'<table class="observed">.*?</table>', page)
    assert observed is not None
    assert "None" not in page
    assert '<td class="text">-</td>' in observed.group(0)


def test_the_report_and_its_page_are_readable_as_the_umask_says(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The JSON report was written mode 0600 (a temporary file renamed over it) whatever
    the umask, beside a page of 0644: a report a CI step, a dashboard or another operator
    read was unreadable to them. Both are written as any file of the command (0666 less
    the umask), and a report replaced keeps its mode."""
    import os

    out = tmp_path / "r.json"
    argv = [
        *BASE, "--config", store, "--duration", "1s", "--recovery-wait", "1s",
        "--out", str(out), "--predict", "breaker_open_s=5", "--abort", "error_rate=50%",
    ]  # fmt: skip
    previous = os.umask(0o022)
    try:
        main(argv)
    finally:
        os.umask(previous)
    capsys.readouterr()
    modes = [oct(path.stat().st_mode & 0o777) for path in (out, out.with_suffix(".html"))]
    assert modes == ["0o644", "0o644"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_the_printed_predictions_table_keeps_its_columns_for_long_predictions(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`alert:FallbackMwFallbackShareAboveCanaryBaseline<=180s` (the prediction the docs
    recommend) is longer than the column the table gave predictions: every row's columns
    still line up under the header."""
    import http.server
    import json
    import threading

    class Alerts(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"status": "success", "data": {"alerts": []}}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Alerts)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    long = "alert:FallbackMwFallbackShareAboveCanaryBaseline<=180s"
    try:
        argv = [
            *BASE, "--config", store, "--duration", "1s", "--recovery-wait", "1s",
            "--out", str(tmp_path / "r.json"), "--predict", "breaker_open_s=5",
            "--predict", long, "--abort", "error_rate=50%",
            "--prometheus", f"http://127.0.0.1:{server.server_address[1]}",
        ]  # fmt: skip
        assert main(argv) == 1  # no traffic, no alert: NO DATA
    finally:
        server.shutdown()
        server.server_close()
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("prediction"))
    table = lines[header : header + 3]
    assert table[2].split()[0] == long, table
    predicted_end = table[0].index("predicted") + len("predicted")
    for line in table[1:]:  # right-aligned values end under their header's end
        assert line[predicted_end - 2 : predicted_end] == " s", table
        assert line.index("NO DATA") == table[0].index("result"), table


@pytest.mark.anyio
async def test_the_faults_own_answer_relayed_to_callers_is_a_customer_visible_error(
    tmp_path: Path,
) -> None:
    """A `revoke` game day on a single-credential primary (a route that does not fail over
    on 401): every caller got the fault's synthetic 401, relayed as `served`. The report
    said `0 customer-visible errors (0.00%)` and passed `error_rate=0.1%`, and the
    `error_rate` abort never held. The fault's own answer is now an error it caused; a
    real upstream's 401 stays the upstream's answer."""
    from fallback_mw import Gateway
    from tests.helpers import client_for
    from tests.test_cli_admin import cli
    from tests.upstreams import host_app, status_handler, upstream

    store = f"sqlite:///{tmp_path / 'gw.db'}"
    async with upstream(status_handler(200, b"ok")) as primary:
        conf = {
            "gateway": {"store": store},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf, environ={})
        runtime = gateway.services.store
        assert runtime is not None
        try:
            async with client_for(gateway) as client:
                assert (await client.get("/v1/x")).status_code == 200  # starts the reloader
                status, _, err = await cli(
                    "faults", "set", "revoke", "--store", store, "--upstream", "primary",
                    "--ttl", "600",
                )  # fmt: skip
                assert status == 0, err
                for _ in range(300):
                    if runtime.faults.active_upstreams() == {"primary"}:
                        break
                    await asyncio.sleep(0.05)
                for _ in range(4):
                    assert (await client.get("/v1/x")).status_code == 401
            ledger = gateway.services.ledger
            assert ledger is not None
            records = await ledger.usage(route="chat")
        finally:
            await gateway.aclose()
    faulted = [r for r in records if r.fault]
    assert len(faulted) == 4 and all(r.outcome == "served" and r.status == 401 for r in faulted)
    t0 = min(r.at.timestamp() for r in faulted) - 1
    seen = observe(faulted, t0=t0, primary="primary", faulted_upstream="primary")
    assert (seen["errors"], seen["error_rate"]) == (4, 1.0)
    assert windowed("error_rate", faulted, "primary") == 1.0
    # A 401 the upstream itself sent is its answer, not an error the exercise caused.
    real = record(T0 + 1.0, attempts=(AttemptOutcome("primary", status=401),))
    assert observe([real], t0=T0, primary="primary", faulted_upstream="primary")["errors"] == 0


@pytest.mark.anyio
async def test_ctrl_c_still_reads_the_records_of_requests_that_ended_after_the_last_poll(
    tmp_path: Path,
) -> None:
    """Ctrl-C ended the watch without one more read: a request that ended after the last
    poll (up to a poll interval of them) or was in flight at the revert was missing from the
    interrupted report, which then showed fewer requests (and errors) than callers saw."""
    import io
    import os
    import signal

    from fallback_mw.cli.app import Console
    from fallback_mw.cli.game_day.run import Exercise
    from fallback_mw.cli.gameday import _run
    from fallback_mw.store.ledgers import open_ledger

    url = f"sqlite:///{tmp_path / 'gw.db'}"
    exercise = Exercise(
        route="chat", fault="fail", target="primary", candidate=None, primary="primary",
        duration_s=60, predictions=(parse_prediction("error_rate=1%"),),
        aborts=(parse_abort("error_rate=50%"),), poll_s=1.0, grace_s=0.5, owner="Ana",
        candidates=("primary", "backup"),
    )  # fmt: skip
    ledger = open_ledger(url)
    assert ledger is not None

    async def write(
        request_id: str, ended: float, chosen: str | None, outcome: str, began: float
    ) -> None:
        # Its duration from `began`: a record is placed by its start (its end less its
        # duration), and on a loaded machine the write runs later than planned.
        await ledger.record_usage(
            UsageRecord(
                request_id=request_id, route="chat", tenant="t", candidates=("primary", "backup"),
                at=datetime.fromtimestamp(ended, UTC), duration_ms=(ended - began) * 1000,
                chosen=chosen, outcome=outcome,
            )
        )  # fmt: skip

    async def caller_traffic_then_ctrl_c() -> None:
        for _ in range(500):  # until the exercise has set its fault
            if await stored(url):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # past the exercise's first poll
        began = time.time() - 0.1
        await write("ended-after-the-last-poll", time.time(), "backup", "served", began)
        began = time.time() - 0.1  # in flight when the operator pressed Ctrl-C
        os.kill(os.getpid(), signal.SIGINT)  # the operator's Ctrl-C
        await asyncio.sleep(0.1)
        await write("in-flight-at-the-revert", time.time(), None, "upstream_failed", began)

    async def stored(store_url: str) -> bool:
        store = open_store(store_url)
        try:
            return bool(await store.load_faults())
        finally:
            await store.aclose()

    console = Console(io.StringIO(), io.StringIO())
    try:
        caller = asyncio.ensure_future(caller_traffic_then_ctrl_c())
        report = await _run(exercise, url, tmp_path / "gd.json", console, None)
        await caller
    finally:
        await ledger.aclose()
    assert report["status"] == "interrupted"
    observed = report["observed"]
    assert (observed["requests"], observed["errors"], observed["fallbacks"]) == (2, 1, 1)


def test_a_pin_game_day_names_the_candidate_it_pinned() -> None:
    """`gameday --route chat --fault pin --candidate backup` printed 'pin 'chat'' (the
    route again, as if the route were what was pinned) and never the candidate; it says
    'pin to 'backup'', as `faults set pin` does."""
    from fallback_mw.cli.game_day.report import report_lines

    report: dict[str, Any] = {
        "status": "completed",
        "route": "chat",
        "fault": {"kind": "pin", "target": "chat", "candidate": "backup", "seconds_set": 3.0},
        "duration_s": 3.0,
        "owner": "alice",
        "abort": None,
        "predictions": [],
        "observed": {"requests": 1},
    }
    first = report_lines(report)[0]
    assert first.startswith("game day completed: route 'chat', pin to 'backup', set 3.0 s"), first
    report["fault"] = {"kind": "fail", "target": "primary", "candidate": None, "seconds_set": 3.0}
    assert "route 'chat', fail 'primary', set" in report_lines(report)[0]


def test_a_pin_game_day_page_names_the_candidate_it_pinned(store: str, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = [
        "gameday", "--route", "chat", "--fault", "pin", "--candidate", "backup",
        "--duration", "1s", "--recovery-wait", "1s", "--config", store, "--out", str(out),
        "--predict", "error_rate=1%", "--abort", "error_rate=50%",
    ]  # fmt: skip
    assert main(argv) == 1  # no traffic: NO DATA
    page = out.with_suffix(".html").read_text()
    assert "<h1>Game day: route chat, pin to &#x27;backup&#x27;</h1>" in page, page[:2000]


@pytest.mark.anyio
async def test_a_fault_cleared_by_hand_ends_the_exercise_there_and_the_next_fault_is_kept(
    tmp_path: Path,
) -> None:
    """The operator ran the one-action revert (`faults clear --all`, as docs/game-day.md
    says) 1 s into an 8 s game day: the command went on as if its fault were set, reported
    it set for the whole 8 s (the requests after the revert counted as under the fault,
    the recovery dated from its own clear at the end), exited 0, and at its end cleared the
    target again, ending the fault a second exercise had set there since. It now sees its
    fault gone at the next poll, ends the exercise there (aborted, exit 1), and clears only
    its own fault."""
    import io

    from fallback_mw.cli.app import Console
    from fallback_mw.cli.game_day.run import Exercise
    from fallback_mw.cli.gameday import _run
    from fallback_mw.store.ledgers import open_ledger

    url = f"sqlite:///{tmp_path / 'gw.db'}"
    exercise = Exercise(
        route="chat", fault="fail", target="primary", candidate=None, primary="primary",
        duration_s=8, predictions=(parse_prediction("error_rate=1%"),),
        aborts=(parse_abort("error_rate=50%"),), poll_s=0.2, grace_s=0.5, owner="Ana",
        recovery_wait_s=1.0, candidates=("primary", "backup"),
    )  # fmt: skip
    ledger = open_ledger(url)
    assert ledger is not None
    store = open_store(url)
    marks: dict[str, float] = {}

    async def write(request_id: str, chosen: str) -> None:
        await ledger.record_usage(
            UsageRecord(
                request_id=request_id, route="chat", tenant="t", candidates=("primary", "backup"),
                at=datetime.now(UTC), duration_ms=1.0, chosen=chosen, outcome="served",
            )
        )  # fmt: skip

    async def operator() -> None:
        for _ in range(500):  # until the exercise has set its fault
            if await store.load_faults():
                break
            await asyncio.sleep(0.02)
        marks["set"] = time.time()
        await write("during-the-fault", "backup")
        await asyncio.sleep(1.0)
        assert await store.clear_faults() == 1  # `faults clear --all`
        marks["reverted"] = time.time()
        # Another exercise takes the target at once.
        assert await store.set_fault(Fault("hang", "primary", time.time() + 60)) is None
        await asyncio.sleep(0.1)
        await write("primary-again", "primary")

    console = Console(io.StringIO(), io.StringIO())
    try:
        caller = asyncio.ensure_future(operator())
        report = await _run(exercise, url, tmp_path / "gd.json", console, None)
        await caller
        left = await store.load_faults()
    finally:
        await ledger.aclose()
        await store.aclose()
    assert report["status"] == "aborted"
    assert report["abort"]["criterion"] == "the fault was cleared outside the command"
    # Dated at the last poll that still saw the fault: before the revert, within a poll.
    seconds_set = report["fault"]["seconds_set"]
    reverted = marks["reverted"] - marks["set"]
    assert reverted - 0.5 <= seconds_set <= reverted + 0.1, (seconds_set, reverted)
    assert report["observed"]["requests"] == 1  # the request after the revert is not its
    assert report["observed"]["recovery_s"] is not None
    assert [(f.kind, f.target) for f in left] == [("hang", "primary")]  # not its to clear


@pytest.mark.anyio
async def test_a_store_outage_mid_exercise_still_reports_and_clears_the_fault_once_it_is_back(
    tmp_path: Path, pg_url: str
) -> None:
    """PostgreSQL went away for about two seconds (a restart, a failover) 0.5 s into a
    60 s game day: the command stopped at once with 'game day stopped: cannot reach the
    store', its one attempt to clear the fault failed, and it exited, leaving the report
    `running` (no HTML page, nothing of what it had observed) and the fault failing the
    primary, with nobody watching the abort criteria, for the rest of its 60 s. It now
    ends the exercise (status `failed`, the report written with what it saw), and retries
    the clear until the store is back."""
    import io
    import json
    from urllib.parse import urlsplit

    from fallback_mw.cli.app import Console
    from fallback_mw.cli.game_day.run import Exercise
    from fallback_mw.cli.gameday import _run
    from tests.tcp_proxy import tcp_proxy

    real = urlsplit(pg_url)
    assert real.hostname is not None and real.port is not None
    async with tcp_proxy(real.hostname, real.port) as proxy:
        url = real._replace(netloc=f"{real.username}@127.0.0.1:{proxy.port}").geturl()
        exercise = Exercise(
            route="chat", fault="fail", target="primary", candidate=None, primary="primary",
            duration_s=60, predictions=(parse_prediction("error_rate=1%"),),
            aborts=(parse_abort("error_rate=50%"),), poll_s=0.2, grace_s=0.5, owner="Ana",
            recovery_wait_s=1.0, candidates=("primary", "backup"),
        )  # fmt: skip
        direct = open_store(pg_url)

        async def outage() -> None:
            for _ in range(500):  # until the exercise has set its fault
                if await direct.load_faults():
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)
            await proxy.cut()
            await asyncio.sleep(2.0)
            await proxy.open()

        out = tmp_path / "gd.json"
        console = Console(io.StringIO(), io.StringIO())
        try:
            operator = asyncio.ensure_future(outage())
            started = time.monotonic()
            report = await asyncio.wait_for(_run(exercise, url, out, console, None), 30)
            took = time.monotonic() - started
            await operator
            left = await direct.load_faults()
        finally:
            await direct.aclose()
    assert left == []  # cleared once the store was back, not left to its 60 s expiry
    assert took < 15, took
    assert report["status"] == "failed" and report["failure"], report
    assert report["fault"]["cleared_at"] is not None
    assert json.loads(out.read_text())["status"] == "failed"
    assert out.with_suffix(".html").exists()


def test_ctrl_c_before_the_fault_is_set_sets_nothing(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C while the command was still reading Prometheus's alert baseline (a slow
    Prometheus: up to 3 s) went on to set the fault, in every gateway sharing the store,
    and cleared it at once: an operator who stopped the exercise before it began still
    injected it (PostgreSQL's NOTIFY reaches the gateways within milliseconds), and got an
    'interrupted' report of a fault set for 0.02 s. Nothing is set now; exit status 130."""
    import os
    import signal
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class SlowPrometheus(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            time.sleep(1.5)
            body = b'{"status": "success", "data": {"alerts": []}}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    async def serials() -> tuple[int, int]:
        route_store = open_store(f"sqlite:///{tmp_path / 'store.db'}")
        try:
            return await route_store.change_serials()
        finally:
            await route_store.aclose()

    before = asyncio.run(serials())
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowPrometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ctrl_c = threading.Timer(0.7, os.kill, (os.getpid(), signal.SIGINT))
    out = tmp_path / "r.json"
    argv = [
        *BASE, "--duration", "30s", "--config", store, "--out", str(out),
        "--prometheus", f"http://127.0.0.1:{server.server_address[1]}",
        "--predict", "error_rate=1%", "--abort", "error_rate=50%",
    ]  # fmt: skip
    try:
        ctrl_c.start()
        status = main(argv)
    finally:
        ctrl_c.cancel()
        server.shutdown()
        server.server_close()
    printed = capsys.readouterr().out
    assert asyncio.run(serials()) == before, printed  # no fault was ever written
    assert "fault set" not in printed
    assert status == 130
    assert not out.exists()


def test_an_alert_name_from_a_shared_prometheus_cannot_drive_the_terminal() -> None:
    """Prometheus takes any text as an alert's name (`promtool check rules` passes one
    holding ESC), and a shared Prometheus holds other teams' rules: the printed report
    wrote the names of the alerts that fired as they came, so a rule named with an escape
    sequence cleared the operator's screen or retitled the terminal. Each is one printable
    line now (the JSON report keeps the name as Prometheus gave it)."""
    from fallback_mw.cli.game_day.report import report_lines

    hostile = "Evil\x1b[2J\x1b]0;pwned\x07\nFallbackMwBreakerOpen firing at +0 s"
    report: dict[str, Any] = {
        "status": "completed",
        "route": "chat",
        "fault": {"kind": "fail", "target": "primary", "candidate": None, "seconds_set": 3.0},
        "duration_s": 3.0,
        "owner": "alice",
        "abort": None,
        "predictions": [],
        "observed": {"requests": 1},
        "prometheus": {
            "alerts": {hostile: {"pending_s": 1.0, "firing_s": 1.0, "resolved_s": None}},
            "polls": 3,
            "failed_polls": 0,
        },
    }
    lines = report_lines(report)
    assert all(line.isprintable() for line in lines), lines
    assert any("Evil?[2J?]0;pwned??FallbackMwBreakerOpen" in line for line in lines), lines


@pytest.mark.parametrize("status", ["aborted", "interrupted", "failed"])
def test_the_page_of_an_exercise_that_did_not_run_to_its_end_is_not_a_green_pass(
    status: str,
) -> None:
    """An exercise that aborted (or was interrupted, or stopped by its store) with every
    prediction met showed its verdict in the page's green 'pass' style, reading
    'aborted: ' and nothing after: mailed around, the page looked like a success. It is
    in the 'fail' style and says every prediction passed, after the status."""
    import re

    from fallback_mw.cli.game_day.html import render

    report: dict[str, Any] = {
        "status": status,
        "route": "chat",
        "owner": "Ana",
        "duration_s": 60.0,
        "fault": {
            "kind": "fail",
            "target": "primary",
            "candidate": None,
            "set_at": "2026-12-05T01:00:00Z",
            "expires_at": "2026-12-05T01:01:00Z",
            "cleared_at": "2026-12-05T01:00:07Z",
            "seconds_set": 7.0,
        },
        "abort": None,
        "failure": "lost the store connection" if status == "failed" else None,
        "predictions": [
            {
                "prediction": "error_rate=1%",
                "name": "error_rate",
                "unit": "%",
                "predicted": 0.01,
                "observed": 0.0,
                "result": "pass",
            },
        ],
        "observed": {"requests": 10},
        "events": [],
    }
    verdict = re.search(r'<p id="verdict" class="(\w+)">([^<]*)</p>', render(report))
    assert verdict is not None
    assert verdict.groups() == ("fail", f"{status}: every prediction passed")
    report["status"] = "completed"
    verdict = re.search(r'<p id="verdict" class="(\w+)">([^<]*)</p>', render(report))
    assert verdict is not None and verdict.groups() == ("pass", "every prediction passed")


@pytest.mark.anyio
async def test_two_exercises_started_at_once_on_one_route_write_two_reports(
    store: str, tmp_path: Path
) -> None:
    """A script started a `fail` game day and a `pin` game day on route chat at once,
    without --out: both took `results/gameday-chat-<second>.json`, and the one that ended
    last overwrote the other's report (and its HTML page). The default name now names the
    fault and its target as well."""
    import sys

    command = [str(Path(sys.executable).with_name("fallback-mw")), "gameday", "--config", store]
    common = [
        *("--route", "chat", "--duration", "1s", "--recovery-wait", "1s", "--owner", "Ana"),
        *("--predict", "error_rate=1%", "--abort", "error_rate=50%"),
    ]
    runs = [
        await asyncio.create_subprocess_exec(
            *command,
            *common,
            *fault,
            cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for fault in (["--fault", "fail"], ["--fault", "pin", "--candidate", "backup"])
    ]
    for process in runs:
        out, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 1, out + err  # no traffic: NO DATA
    reports = sorted(p.name for p in (tmp_path / "results").glob("*.json"))
    assert len(reports) == 2, reports
    assert reports[0].startswith("gameday-chat-fail-primary-"), reports
    assert reports[1].startswith("gameday-chat-pin-backup-"), reports
    assert len(list((tmp_path / "results").glob("*.html"))) == 2


def test_a_slow_prometheus_does_not_hold_back_the_clear_on_ctrl_c(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The exercise's loop awaited each Prometheus poll (up to its 3 s timeout) before it
    looked at Ctrl-C, the abort criteria or the time: with a slow or hung Prometheus the
    fault stayed set up to 3 s after Ctrl-C (and after an abort criterion held), not 'at
    once' as docs/game-day.md says. The polls run beside the loop now."""
    import json
    import os
    import signal
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    asked: list[float] = []

    class SlowPrometheus(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/api/v1/alerts"):
                asked.append(time.time())
                if len(asked) > 1:  # the baseline at once; every poll after it slow
                    time.sleep(2.8)
            body = b'{"status": "success", "data": {"alerts": []}}'
            self.send_response(200 if self.path.startswith("/api/v1/alerts") else 404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowPrometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sent: list[float] = []
    returned = threading.Event()

    def ctrl_c() -> None:
        deadline = time.time() + 20
        while len(asked) < 2 and time.time() < deadline:  # inside the first slow poll
            time.sleep(0.02)
        time.sleep(0.3)
        if not returned.is_set():  # never at pytest itself, had the command ended early
            sent.append(time.time())
            os.kill(os.getpid(), signal.SIGINT)

    operator = threading.Thread(target=ctrl_c, daemon=True)
    out = tmp_path / "r.json"
    argv = [
        *BASE, "--duration", "60s", "--config", store, "--out", str(out),
        "--prometheus", f"http://127.0.0.1:{server.server_address[1]}",
        "--predict", "error_rate=1%", "--abort", "error_rate=50%",
    ]  # fmt: skip
    try:
        operator.start()
        try:
            status = main(argv)
        finally:
            returned.set()
        operator.join(5)
    finally:
        server.shutdown()
        server.server_close()
    assert status == 130, capsys.readouterr()
    cleared_at = json.loads(out.read_text())["fault"]["cleared_at"]
    cleared = datetime.fromisoformat(cleared_at.replace("Z", "+00:00")).timestamp()
    assert cleared - sent[0] < 1.0, cleared - sent[0]


@pytest.mark.anyio
async def test_an_alert_seen_in_a_slow_answer_is_dated_when_prometheus_answered() -> None:
    """The alert state a poll read was dated when the question was sent: an alert first
    seen firing in an answer that took 1.2 s was dated 1.2 s early, so an
    `alert:NAME<=DURATION` prediction (an upper bound) could pass on an alert that fired
    after its bound. It is dated when Prometheus answered."""
    from aiohttp import web

    from fallback_mw.cli.game_day.prometheus import AlertWatcher

    async def alerts(request: web.Request) -> web.Response:
        await asyncio.sleep(1.2)
        firing = {"labels": {"alertname": "FallbackMwBreakerOpen"}, "state": "firing"}
        return web.json_response({"status": "success", "data": {"alerts": [firing]}})

    app = web.Application()
    app.router.add_get("/api/v1/alerts", alerts)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    watcher = AlertWatcher(f"http://127.0.0.1:{port}")
    try:
        asked = time.time()
        await watcher.poll()
        answered = time.time()
    finally:
        await watcher.aclose()
        await runner.cleanup()
    firing_at = watcher.alerts["FallbackMwBreakerOpen"].firing_at
    assert firing_at is not None
    assert asked + 1.1 <= firing_at <= answered, (firing_at - asked, answered - asked)


@pytest.mark.anyio
async def test_a_store_outage_while_the_recovery_is_watched_still_writes_the_report(
    tmp_path: Path, pg_url: str
) -> None:
    """The exercise ran to its end and cleared its fault; PostgreSQL then went away while
    the command watched the recovery: the command stopped with 'PostgreSQL ledger
    unavailable', and the report it had written at the start still said `running` (no
    HTML page, nothing observed), as if the exercise had never ended. The report is
    written, status `failed`, naming the phase the store failed in."""
    import io
    import json
    from urllib.parse import urlsplit

    from fallback_mw.cli.app import Console
    from fallback_mw.cli.game_day.run import Exercise
    from fallback_mw.cli.gameday import _run
    from tests.tcp_proxy import tcp_proxy

    real = urlsplit(pg_url)
    assert real.hostname is not None and real.port is not None
    async with tcp_proxy(real.hostname, real.port) as proxy:
        url = real._replace(netloc=f"{real.username}@127.0.0.1:{proxy.port}").geturl()
        exercise = Exercise(
            route="chat", fault="fail", target="primary", candidate=None, primary="primary",
            duration_s=1.0, predictions=(parse_prediction("error_rate=1%"),),
            aborts=(parse_abort("error_rate=50%"),), poll_s=0.1, grace_s=0.5, owner="Ana",
            recovery_wait_s=20.0, candidates=("primary", "backup"),
        )  # fmt: skip
        direct = open_store(pg_url)

        async def outage_after_the_clear() -> None:
            for _ in range(500):  # until the exercise has set its fault
                if await direct.load_faults():
                    break
                await asyncio.sleep(0.02)
            for _ in range(500):  # then until it has cleared it: the recovery watch
                if not await direct.load_faults():
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            await proxy.cut()

        out = tmp_path / "gd.json"
        console = Console(io.StringIO(), io.StringIO())
        try:
            operator = asyncio.ensure_future(outage_after_the_clear())
            report = await asyncio.wait_for(_run(exercise, url, out, console, None), 30)
            await operator
        finally:
            await direct.aclose()
    assert report["status"] == "failed", report
    assert "while watching the recovery" in report["failure"]
    assert report["fault"]["cleared_at"] is not None
    assert json.loads(out.read_text())["status"] == "failed"
    assert out.with_suffix(".html").exists()


def test_a_report_whose_fault_could_not_be_cleared_says_when_it_expires() -> None:
    """A store that stayed away until the fault's end left it uncleared: the printed
    report read 'set None s of 60 s' (Python's spelling of nothing). It says the fault was
    not cleared and when it expires, the moment it stops injecting."""
    from fallback_mw.cli.game_day.report import report_lines

    report: dict[str, Any] = {
        "status": "failed",
        "failure": "cannot reach the store",
        "route": "chat",
        "fault": {
            "kind": "fail",
            "target": "primary",
            "candidate": None,
            "seconds_set": None,
            "expires_at": "2026-12-05T01:01:00Z",
        },
        "duration_s": 60.0,
        "owner": "alice",
        "abort": None,
        "predictions": [],
        "observed": {"requests": 1},
    }
    first = report_lines(report)[0]
    assert "None" not in first, first
    assert "not cleared (the store failed): it expires 2026-12-05T01:01:00Z" in first


@pytest.mark.anyio
async def test_a_hang_up_clears_the_fault_like_ctrl_c(store: str, tmp_path: Path) -> None:
    """The operator's SSH session dropped during a game day: SIGHUP, left to its default,
    killed the command at once, and its fault went on failing the primary, with nobody
    watching the abort criteria, until its expiry (the whole --duration). A hang-up is
    handled as Ctrl-C and SIGTERM are: the fault is cleared and the report written."""
    import json
    import signal
    import sys

    out = tmp_path / "r.json"
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("fallback-mw")),
        *(*BASE, "--duration", "60s", "--config", store, "--out", str(out)),
        *("--predict", "error_rate=1%", "--abort", "error_rate=50%"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not await _faults(store):
            assert time.monotonic() < deadline, "the fault was never set"
            await asyncio.sleep(0.05)
        process.send_signal(signal.SIGHUP)
        stdout, stderr = await asyncio.wait_for(process.communicate(), 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert await _faults(store) == [], (process.returncode, stdout, stderr)
    assert process.returncode == 130
    assert json.loads(out.read_text())["status"] == "interrupted"


def test_refuses_when_the_ledger_cannot_be_read_and_sets_nothing(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ledger the game day cannot read (here one a newer version migrated, after a
    downgrade) was found out only after the fault was set: every gateway sharing the store
    faulted the route's primary for that moment, then the game day failed. The ledger is
    read first: refused, nothing set."""
    db = Path(store).parent / "store.db"
    assert (
        main(["budgets", "set", "--store", f"sqlite:///{db}", "--budget", "b", "--limit", "1"]) == 0
    )
    with sqlite_db(db) as conn:
        conn.execute("UPDATE fmw_schema SET version = version + 1 WHERE component = 'ledger'")
    argv = [
        *BASE, "--config", store, "--out", str(tmp_path / "r.json"),
        "--predict", "p99_ms=3500", "--abort", "error_rate=1%",
    ]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "ledger schema is version" in err and "nothing set" in err, err
    with sqlite_db(db) as conn:  # no fault was ever written, not even for a moment
        assert conn.execute(
            "SELECT serial FROM fmw_route_changes WHERE name = 'faults'"
        ).fetchone() == (0,)
    assert not (tmp_path / "r.json").exists()


def test_a_report_the_disk_cannot_take_is_still_printed_and_the_error_names_it(
    store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The disk filled up during the exercise: writing the final report failed, and the
    command's whole result was 'fallback-mw: error: OSError: No space left on device' —
    the report is written before it is printed, so what the game day observed (its
    predictions, the recovery) was shown nowhere. It is printed now, and the one error
    line names the file it could not write and why."""
    import errno

    from fallback_mw.cli import gameday
    from fallback_mw.cli.game_day import files

    written = gameday.write_report

    def disk_full_at_the_end(path: Path, report: dict[str, Any]) -> None:
        if report["status"] == "running":
            written(path, report)  # the start still had room
            return
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gameday, "write_report", disk_full_at_the_end)  # at the start
    monkeypatch.setattr(files, "write_report", disk_full_at_the_end)  # the final report
    out = tmp_path / "report.json"
    argv = [
        "gameday", "--route", "chat", "--fault", "fail", "--duration", "1s",
        "--recovery-wait", "1s", "--config", store, "--out", str(out),
        "--predict", "error_rate=1%", "--abort", "error_rate=50%",
    ]  # fmt: skip
    assert main(argv) == 1
    printed = capsys.readouterr()
    assert "game day completed: route 'chat', fail 'primary'" in printed.out, printed.out
    assert "error_rate" in printed.out  # the predictions table
    errors = printed.err.strip().splitlines()
    assert len(errors) == 1, printed.err
    assert errors[0].startswith("fallback-mw: error: cannot write the report"), errors
    assert str(out) in errors[0] and "No space left on device" in errors[0], errors
    assert asyncio.run(_faults(store)) == []  # the fault was cleared all the same


def test_a_report_the_disk_cannot_take_at_the_start_clears_the_fault_and_says_why(
    store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same full disk when the exercise starts: 'OSError: No space left on device',
    nothing saying which file or that the fault just set was cleared again."""
    import errno

    from fallback_mw.cli import gameday

    def disk_full(path: Path, report: dict[str, Any]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gameday, "write_report", disk_full)
    out = tmp_path / "report.json"
    argv = [
        "gameday", "--route", "chat", "--fault", "fail", "--duration", "30s",
        "--config", store, "--out", str(out),
        "--predict", "error_rate=1%", "--abort", "error_rate=50%",
    ]  # fmt: skip
    assert main(argv) == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"fallback-mw: error: cannot write the report {out}: No space")
    assert "fault was cleared" in errors[0], errors
    assert asyncio.run(_faults(store)) == []
