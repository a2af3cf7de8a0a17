"""`fallback-mw capacity`: the primary's peak minute from real usage records (SQLite and
the real PostgreSQL) against each fallback's declared rpm / tpm, through `main`."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from fallback_mw.budget import UsageRecord
from fallback_mw.cli import main
from fallback_mw.store.ledgers import open_ledger


def write_config(tmp_path: Path, store: str, backup_tpm: int = 200_000) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(
        f"""
[gateway]
store = "{store}"

[upstreams.primary]
url = "http://127.0.0.1:9001"
auth_env = "PRIMARY_KEY_NOT_SET_HERE"

[upstreams.backup]
url = "http://127.0.0.1:9002"
rpm = 600
tpm = {backup_tpm}

[upstreams.search]
url = "http://127.0.0.1:9003"

[upstreams.spare]
url = "http://127.0.0.1:9004"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retries = 1

[[routes]]
id = "search"
prefix = "/search/"
plan = ["search", "spare"]
retries = 1
""",
        encoding="utf-8",
    )
    return path


async def seed(store: str) -> None:
    ledger = open_ledger(store)
    now = datetime.now(UTC)
    peak = (now - timedelta(hours=2)).replace(second=0, microsecond=0)
    quiet = peak - timedelta(minutes=30)
    try:
        for i in range(11):  # the peak minute: 11 requests, 1,100,000 tokens
            await ledger.record_usage(
                UsageRecord(request_id=f"p{i}", route="chat", tenant="t",
                            at=peak + timedelta(seconds=i * 5), input_tokens=60_000,
                            output_tokens=40_000)
            )  # fmt: skip
        for i in range(3):  # a quieter minute, and a request without reported usage
            await ledger.record_usage(
                UsageRecord(request_id=f"q{i}", route="chat", tenant="t",
                            at=quiet + timedelta(seconds=i), input_tokens=1000 if i else None,
                            output_tokens=10 if i else None)
            )  # fmt: skip
        # Older than --since: bigger, and ignored.
        await ledger.record_usage(
            UsageRecord(request_id="old", route="chat", tenant="t", at=now - timedelta(days=9),
                        input_tokens=9_000_000, output_tokens=0)
        )  # fmt: skip
        for i in range(4):
            await ledger.record_usage(
                UsageRecord(request_id=f"s{i}", route="search", tenant="t",
                            at=peak + timedelta(seconds=i))
            )  # fmt: skip
    finally:
        await ledger.aclose()


async def cli(*argv: str) -> int:
    status: int = await anyio.to_thread.run_sync(main, list(argv))
    return status


@pytest.mark.anyio
async def test_capacity_prints_the_ratio_and_exits_1_when_a_backup_cannot_carry(
    ledger_store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await seed(ledger_store)
    config = write_config(tmp_path, ledger_store)
    capsys.readouterr()
    assert await cli("capacity", "--config", str(config), "--since", "7d") == 1
    out, err = capsys.readouterr()
    # The exit status is explained on stderr, in the CLI's one-line convention.
    assert err == (
        "fallback-mw: error: capacity: 1 fallback(s) cannot carry the peak with margin 1.2: "
        "chat -> backup\n"
    )
    chat = next(line for line in out.splitlines() if line.startswith("chat "))
    assert chat.split() == [
        "chat", "primary", "11", "1,100,000", "backup", "600", "0.02x", "200,000", "5.50x",
        "CANNOT", "CARRY",
    ]  # fmt: skip
    assert "a full failover at peak" in out and "sends backup 5.5x its token limit" in out
    assert "it needs tpm >= 1,320,000" in out  # 1.1M x margin 1.2
    # A fallback that declares nothing is unknown, never fine.
    search = next(line for line in out.splitlines() if line.startswith("search "))
    assert search.split()[-1] == "unknown"
    assert "spare declares no rpm" in out
    assert "PRIMARY_KEY" not in out  # names of secrets are not its business either

    assert await cli("capacity", "--config", str(config), "--json", "--margin", "1") == 1
    report = json.loads(capsys.readouterr().out)
    (chat_json,) = [r for r in report["routes"] if r["route"] == "chat"]
    assert chat_json["peak"]["requests"] == 11 and chat_json["peak"]["tokens"] == 1_100_000
    (backup,) = chat_json["fallbacks"]
    assert backup["tokens"]["ratio"] == pytest.approx(5.5)
    assert backup["requests"]["verdict"] == "carries"
    assert backup["verdict"] == "cannot_carry"


@pytest.mark.anyio
async def test_a_backup_that_carries_the_peak_exits_0_and_strict_counts_unknowns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    await seed(store)
    config = write_config(tmp_path, store, backup_tpm=1_400_000)
    assert await cli("capacity", "--config", str(config)) == 0  # 1.1M x 1.2 <= 1.4M
    out = capsys.readouterr().out
    assert "carries" in next(line for line in out.splitlines() if line.startswith("chat "))
    assert await cli("capacity", "--config", str(config), "--margin", "1.3") == 1
    capsys.readouterr()
    # search's fallback declares nothing: unknown, which --strict does not accept.
    assert await cli("capacity", "--config", str(config), "--strict") == 1
    # A window with no traffic: nothing observed is unknown too.
    assert await cli("capacity", "--config", str(config), "--since", "1m") == 0
    out = capsys.readouterr().out
    assert "no traffic" in out and "unknown" in out


def test_bad_invocations_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    config = write_config(tmp_path, store)
    assert main(["capacity", "--config", str(config), "--margin", "-1"]) == 2
    assert main(["capacity", "--config", str(config), "--margin", "lots"]) == 2
    assert main(["capacity", "--config", str(config), "--since", "a while"]) == 2
    assert main(["capacity", "--store", "redis://127.0.0.1/0"]) == 2
    bare = tmp_path / "bare.toml"
    bare.write_text("[gateway]\n", encoding="utf-8")
    assert main(["capacity", "--config", str(bare)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 5 and all(line.startswith("fallback-mw: error: ") for line in lines)
    assert "Traceback" not in err


def test_an_unreachable_store_exits_1_without_its_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["capacity", "--store", "postgresql://postgres:pw-secret@127.0.0.1:1/x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fallback-mw: error: ") and "pw-secret" not in err


def test_check_shows_declared_capacity_and_the_shadow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(
        """
[upstreams.primary]
url = "http://127.0.0.1:9001"

[upstreams.backup]
url = "http://127.0.0.1:9002"
rpm = 600
tpm = 200000

[upstreams.candidate]
url = "http://127.0.0.1:9003"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retries = 1
shadow = "candidate"
shadow_percent = 5
""",
        encoding="utf-8",
    )
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2. backup   http://127.0.0.1:9002  no credential  (rpm 600, tpm 200000)" in out
    assert "shadow candidate 5.0% http://127.0.0.1:9003" in out


@pytest.mark.anyio
async def test_a_token_peak_from_partly_metered_traffic_is_named_a_lower_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Streams sent without usage report no tokens: when most of the window's requests
    reported none, the token peak counts only the few that did. The report says so
    (printed and in JSON) rather than present a backup as carrying it without a word."""
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    ledger = open_ledger(store)
    minute = (datetime.now(UTC) - timedelta(hours=1)).replace(second=0, microsecond=0)
    try:
        for i in range(10):  # 10 requests, 2 of them reporting 10,000 tokens
            metered = i < 2
            await ledger.record_usage(
                UsageRecord(request_id=f"r{i}", route="chat", tenant="t",
                            at=minute + timedelta(seconds=i), chosen="primary",
                            input_tokens=6_000 if metered else None,
                            output_tokens=4_000 if metered else None)
            )  # fmt: skip
    finally:
        await ledger.aclose()
    config = write_config(tmp_path, store, backup_tpm=200_000)
    assert await cli("capacity", "--config", str(config)) == 0
    out = capsys.readouterr().out
    chat = next(line for line in out.splitlines() if line.startswith("chat "))
    assert chat.split()[3] == "20,000"
    assert (
        "chat: 80% of the window's requests reported no token usage (e.g. streams without "
        "usage): the token peak counts only the 20% that did, so the real peak may be higher"
    ) in out
    assert "search:" in out and "search: 0%" not in out  # no traffic: its own note


@pytest.mark.anyio
async def test_requests_refused_before_the_plan_are_not_a_peak_a_fallback_must_carry(
    ledger_store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tenant over its budget retrying 29 times in a minute got 402s: no upstream saw
    them, and none would in a failover. The peak is what reached the plan: the request the
    primary carried, a route_exhausted one and one whose body stalled mid-attempt."""
    from fallback_mw.budget.ledger import AttemptOutcome
    from fallback_mw.store.ledgers.memory import MemoryLedger

    minute = (datetime.now(UTC) - timedelta(hours=1)).replace(second=0, microsecond=0)
    records = [
        UsageRecord(request_id="served", route="chat", tenant="t", at=minute, chosen="primary",
                    outcome="served", attempts=(AttemptOutcome("primary", status=200),),
                    input_tokens=100, output_tokens=50),
        UsageRecord(request_id="skipped", route="chat", tenant="t", at=minute,
                    outcome="route_exhausted",
                    attempts=(AttemptOutcome("primary", skipped="capacity"),)),
        *(UsageRecord(request_id=f"r{i}", route="chat", tenant="t",
                      at=minute + timedelta(seconds=i), outcome=outcome)
          for i, outcome in enumerate(
              ["budget_exceeded"] * 25 + ["budget_unavailable", "request_too_large",
                                          "bad_request", "request_timeout"])),
        # A body that stalled while it streamed to an upstream: that one reached the plan.
        UsageRecord(request_id="stalled", route="chat", tenant="t", at=minute,
                    outcome="request_timeout",
                    attempts=(AttemptOutcome("primary", failure="transport"),)),
    ]  # fmt: skip
    memory = MemoryLedger()
    for ledger in (open_ledger(ledger_store), memory):
        try:
            for record in records:
                await ledger.record_usage(record)
            (counted,) = await ledger.usage_per_minute(since=minute - timedelta(minutes=1))
        finally:
            if ledger is not memory:
                await ledger.aclose()
        assert (counted.requests, counted.tokens, counted.metered) == (3, 150, 1)
    config = write_config(tmp_path, ledger_store)
    assert await cli("capacity", "--config", str(config), "--json") == 0
    (chat,) = [r for r in json.loads(capsys.readouterr().out)["routes"] if r["route"] == "chat"]
    assert chat["peak"]["requests"] == 3 and chat["peak"]["metered_share"] == 0.3333


@pytest.mark.anyio
async def test_requests_the_resolver_refused_are_not_a_peak_a_fallback_must_carry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The resolver's refusals leave usage records too (405 from a scanner's TRACE, 431,
    503 overloaded): none reached the plan, and none would in a failover, so a burst of
    them is not a peak the backup must carry. Through a real gateway and its SQLite store."""
    from fallback_mw import Gateway
    from tests.helpers import client_for
    from tests.upstreams import host_app, status_handler, upstream

    store = f"sqlite:///{tmp_path / 'gw.db'}"
    async with upstream(status_handler(200, delay=0.3)) as primary:
        conf = {
            "gateway": {"store": store, "max_header_count": 20, "max_concurrency": 1},
            "upstreams": {"primary": {"url": primary.url}, "backup": {"url": primary.url + "/b"}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"],
                        "retries": 1}],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                async with anyio.create_task_group() as group:  # one served, two overloaded
                    for delay in (0.0, 0.1, 0.1):
                        group.start_soon(_get_after, client, delay)
                for _ in range(5):
                    assert (await client.request("TRACE", "/v1/x")).status_code == 405
                many = {f"x-h{i}": "v" for i in range(30)}
                for _ in range(3):
                    assert (await client.get("/v1/x", headers=many)).status_code == 431
        finally:
            await gateway.aclose()
    assert primary.count == 1
    config = write_config(tmp_path, store)
    assert await cli("capacity", "--config", str(config), "--json") == 0
    (chat,) = [r for r in json.loads(capsys.readouterr().out)["routes"] if r["route"] == "chat"]
    assert chat["peak"]["requests"] == 1, chat


async def _get_after(client: Any, delay: float) -> None:
    await anyio.sleep(delay)
    await client.get("/v1/x")


@pytest.mark.anyio
async def test_the_peak_is_a_rolling_minute_like_the_limit_it_is_checked_against(
    ledger_store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """rpm / tpm are enforced over any 60 seconds: a burst of 12 requests across a minute's
    turn (6 in its last seconds, 6 in the next one's first) is a peak of 12, not two clock
    minutes of 6 each, and a backup with rpm = 10 cannot carry it."""
    turn = (datetime.now(UTC) - timedelta(hours=1)).replace(second=0, microsecond=0)
    ledger = open_ledger(ledger_store)
    try:
        for i in range(12):
            await ledger.record_usage(
                UsageRecord(request_id=f"b{i}", route="chat", tenant="t",
                            at=turn + timedelta(seconds=i - 6), input_tokens=100,
                            output_tokens=50)
            )  # fmt: skip
    finally:
        await ledger.aclose()
    config = write_config(tmp_path, ledger_store)
    text = config.read_text(encoding="utf-8").replace("rpm = 600", "rpm = 10")
    config.write_text(text, encoding="utf-8")
    capsys.readouterr()
    assert await cli("capacity", "--config", str(config), "--json") == 1
    (chat,) = [r for r in json.loads(capsys.readouterr().out)["routes"] if r["route"] == "chat"]
    assert chat["peak"]["requests"] == 12
    assert chat["peak"]["tokens"] == 1800
    assert chat["peak"]["requests_at"] == (turn - timedelta(seconds=6)).isoformat()
    (backup,) = chat["fallbacks"]
    assert backup["requests"]["verdict"] == "cannot_carry"
    assert await cli("capacity", "--config", str(config)) == 1
    out = capsys.readouterr().out
    started = (turn - timedelta(seconds=6)).strftime("%Y-%m-%d %H:%M:%SZ")
    assert f"a full failover at peak (the minute from {started}) sends backup 1.2x" in out


@pytest.mark.anyio
async def test_every_ledger_finds_the_same_rolling_peak_as_counting_every_window(
    ledger_store: str,
) -> None:
    """The SQL ledgers find the busiest 60 seconds in the database (a window function);
    the memory ledger in Python: all agree with counting every window by hand."""
    import random

    from fallback_mw.store.ledgers.memory import MemoryLedger

    rng = random.Random(7)  # 400 requests over 10 minutes, on two routes
    start = (datetime.now(UTC) - timedelta(hours=1)).replace(microsecond=0)
    records = [
        UsageRecord(request_id=f"r{i}", route=rng.choice(["a", "b"]), tenant="t",
                    at=start + timedelta(seconds=rng.uniform(0, 600)),
                    input_tokens=rng.choice([None, rng.randrange(1000)]), output_tokens=None)
        for i in range(400)
    ]  # fmt: skip

    def by_hand(route: str) -> tuple[int, int]:
        mine = [r for r in records if r.route == route]
        seconds = [r.at.replace(microsecond=0) for r in mine]
        requests = tokens = 0
        for first in set(seconds):
            inside = [r for r, s in zip(mine, seconds, strict=True)
                      if first <= s < first + timedelta(seconds=60)]  # fmt: skip
            requests = max(requests, len(inside))
            tokens = max(tokens, sum(r.input_tokens or 0 for r in inside))
        return requests, tokens

    expected = {route: by_hand(route) for route in ("a", "b")}
    for ledger in (open_ledger(ledger_store), MemoryLedger()):
        try:
            for record in records:
                await ledger.record_usage(record)
            found = await ledger.rolling_peaks(since=start - timedelta(minutes=1))
        finally:
            await ledger.aclose()
        assert {p.route: (p.requests, p.tokens) for p in found} == expected
        assert sum(p.total for p in found) == 400


@pytest.mark.anyio
async def test_token_peaks_past_2_to_the_53_stay_exact(
    ledger_store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Eleven answers reporting 10^15 + 7 tokens each (the most one is believed) in one
    # minute: 11,000,000,000,000,077 tokens, past 2^53. SQLite summed them in floating
    # point (TOTAL): `capacity` printed 11,000,000,000,000,076, and the tpm it said was
    # needed with margin 1.2 was computed in floating point too.
    from fallback_mw.store.ledgers.memory import MemoryLedger

    at = (datetime.now(UTC) - timedelta(hours=1)).replace(microsecond=0)
    records = [
        UsageRecord(request_id=f"big{i}", route="chat", tenant="t", at=at,
                    input_tokens=10**15, output_tokens=7)
        for i in range(11)
    ]  # fmt: skip
    exact = 11 * (10**15 + 7)
    for ledger in (open_ledger(ledger_store), MemoryLedger()):
        try:
            for record in records:
                await ledger.record_usage(record)
            peaks = await ledger.rolling_peaks(since=at - timedelta(minutes=1))
            minutes = await ledger.usage_per_minute(since=at - timedelta(minutes=1))
        finally:
            await ledger.aclose()
        assert [(p.route, p.tokens) for p in peaks] == [("chat", exact)]
        assert [(m.route, m.tokens) for m in minutes] == [("chat", exact)]
    config = write_config(tmp_path, ledger_store)
    assert await cli("capacity", "--config", str(config)) == 1
    out = capsys.readouterr().out
    assert f"{exact:,} per minute against tpm = 200,000" in out
    needed = -(-exact * 6 // 5)  # the ceiling of exact x 1.2, in integers
    assert f"with margin 1.2 it needs tpm >= {needed:,})" in out


@pytest.mark.anyio
async def test_token_sums_past_2_to_the_63_still_answer(tmp_path: Path) -> None:
    # Counts edited by hand to near 2^63: an exact sum would overflow SQLite's integers
    # ("integer overflow"); the peaks are then summed approximately, never refused.
    from tests.helpers import sqlite_db

    path = tmp_path / "ledger.db"
    ledger = open_ledger(f"sqlite:///{path}")
    at = (datetime.now(UTC) - timedelta(hours=1)).replace(microsecond=0)
    try:
        for i in range(3):
            await ledger.record_usage(
                UsageRecord(request_id=f"h{i}", route="chat", tenant="t", at=at,
                            input_tokens=1, output_tokens=0)
            )  # fmt: skip
        with sqlite_db(path) as conn:
            conn.execute("UPDATE fmw_usage SET input_tokens = ?", (2**62,))
        peaks = await ledger.rolling_peaks(since=at - timedelta(minutes=1))
        minutes = await ledger.usage_per_minute(since=at - timedelta(minutes=1))
    finally:
        await ledger.aclose()
    assert [(p.route, p.requests) for p in peaks] == [("chat", 3)]
    assert abs(peaks[0].tokens - 3 * 2**62) <= 2**12
    assert abs(minutes[0].tokens - 3 * 2**62) <= 2**12
