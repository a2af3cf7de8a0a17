"""A budgeted request while another process holds the SQLite ledger's write lock (an
operator's `sqlite3` shell in `BEGIN EXCLUSIVE`): refused 503 `budget_unavailable` (fail
closed) within the request's deadline or the ledger's own timeout, whichever comes first.
The two ledger calls before the walk (the stored budget's read, queued behind other
requests' holds, and the hold) each waited the 5 s busy timeout: a request with a 5 s
deadline was answered after up to 9.6 s, a 504 when the lock went meanwhile."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from fallback_mw import Gateway
from fallback_mw.store.ledgers.sqlite import SQLiteLedger
from tests.helpers import http_scope, request_then_disconnect
from tests.test_budget_guard import gateway_config
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()  # until the test closes stdin
conn.execute("COMMIT")
"""


class LockedElsewhere:
    """Another process holding `path`'s write lock until `release()`."""

    def __init__(self, path: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        assert self.process.stdout.readline() == "locked\n"

    def release(self) -> None:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.close()
        self.process.wait(timeout=10)
        self.process.stdout.close()


def config(url: str, path: Path, deadline_ms: int) -> dict[str, Any]:
    conf = gateway_config({"primary": url}, store=f"sqlite:///{path}")
    conf["routes"][0]["deadline_ms"] = deadline_ms
    return conf


@pytest.fixture
def ledger_path(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "ledger.db"


async def answer_of(
    gateway: Gateway, headers: list[tuple[bytes, bytes]] | None = None
) -> tuple[int, dict[str, Any], float]:
    """Status, error and seconds to the response head of one budgeted POST (the usage
    record written after the answer is not the caller's wait)."""
    started = time.monotonic()
    head: list[tuple[int, float]] = []
    body = bytearray()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            head.append((message["status"], time.monotonic() - started))
        elif message["type"] == "http.response.body":
            body.extend(message.get("body", b""))

    scope = http_scope("POST", "/v1/chat", headers=headers or ())
    await gateway(scope, request_then_disconnect(60), send)
    status, took = head[0]
    error = json.loads(body)["error"] if status >= 400 else {}
    return status, error, took


async def answer_into(
    answers: list[tuple[int, dict[str, Any], float]],
    gateway: Gateway,
    headers: list[tuple[bytes, bytes]],
) -> None:
    answers.append(await answer_of(gateway, headers))


async def test_a_locked_ledger_refuses_within_the_route_deadline(ledger_path: Path) -> None:
    async with upstream(status_handler(200)) as primary:
        gateway = Gateway(host_app, config=config(primary.url, ledger_path, 1200))
        try:
            assert (await answer_of(gateway))[0] == 200
            lock = LockedElsewhere(ledger_path)
            try:
                refused = await answer_of(gateway)
                # The caller's own shorter deadline bounds the wait too.
                shortened = await answer_of(gateway, [(b"x-gateway-deadline-ms", b"600")])
            finally:
                lock.release()
            assert (await answer_of(gateway))[0] == 200
        finally:
            await gateway.aclose()
    for status, error, _ in (refused, shortened):
        assert status == 503
        assert (error["code"], error["attempts"]) == ("budget_unavailable", 0)
        assert "did not answer within" in error["message"]
    # The busy timeout is 5 s: before, both waited it out (5.0 s each).
    assert refused[2] < 3.5, refused
    assert shortened[2] < 3.0, shortened
    assert primary.count == 2  # the two served before and after; nothing while locked


async def test_a_locked_ledger_refuses_within_one_ledger_timeout_not_two(
    ledger_path: Path,
) -> None:
    # Requests a moment apart: each one's stored-budget read queued behind the hold before
    # it (up to the busy timeout), then its own hold waited the busy timeout again.
    ledger = SQLiteLedger(str(ledger_path), busy_timeout=1.5)
    async with upstream(status_handler(200)) as primary:
        gateway = Gateway(host_app, config=config(primary.url, ledger_path, 20_000), ledger=ledger)
        try:
            assert (await answer_of(gateway))[0] == 200
            answered: list[tuple[int, float]] = []

            async def one(delay: float) -> None:
                await anyio.sleep(delay)
                started = time.monotonic()

                async def send(message: dict[str, Any]) -> None:
                    if message["type"] == "http.response.start":
                        answered.append((message["status"], time.monotonic() - started))

                await gateway(http_scope("POST", "/v1/chat"), request_then_disconnect(60), send)

            lock = LockedElsewhere(ledger_path)
            try:
                with anyio.fail_after(30):
                    async with anyio.create_task_group() as group:
                        for n in range(6):
                            group.start_soon(one, n * 0.4)
            finally:
                lock.release()
        finally:
            await gateway.aclose()
    assert [status for status, _ in answered] == [503] * 6
    slowest = max(seconds for _, seconds in answered)
    assert slowest < 2.5, answered  # one busy timeout (1.5 s) and a margin; before: 3 s


async def test_a_caller_deadline_of_a_few_ms_is_the_deadline_s_504_not_the_ledger_s_503(
    ledger_path: Path,
) -> None:
    """Callers sending x-gateway-deadline-ms 1..5 to a healthy SQLite ledger were now and
    then answered 503 budget_unavailable ("the budget ledger did not answer within 1 ms"),
    as if the ledger had failed, when a hold taking a few ms more than usual (a write
    another process made, a checkpoint) outlasted the caller's own deadline. Such a
    request is the deadline's: 504 deadline_exceeded, rule `deadline`. Held by another
    process for the moment (every hold waits), each of them is; a longer wait is still
    the ledger's 503 (test_a_locked_ledger_refuses_within_the_route_deadline)."""
    async with upstream(status_handler(200)) as primary:
        conf = config(primary.url, ledger_path, 10_000)
        conf["budgets"]["acme"]["limit"] = "1000"  # room for every request
        gateway = Gateway(host_app, config=conf)
        try:
            assert (await answer_of(gateway))[0] == 200  # the ledger is there and healthy
            short = [[(b"x-gateway-deadline-ms", str(ms).encode())] for ms in [1, 2, 3, 4, 5]]
            served = [await answer_of(gateway, headers) for headers in short * 4]
            lock = LockedElsewhere(ledger_path)
            waited: list[tuple[int, dict[str, Any], float]] = []
            try:
                # At once: each request's usage record, written after its answer, waits out
                # the ledger's 5 s busy timeout under the lock; one after another took 25 s.
                async with anyio.create_task_group() as group:
                    for headers in short:
                        group.start_soon(lambda h=headers: answer_into(waited, gateway, h))
            finally:
                lock.release()
            assert (await answer_of(gateway))[0] == 200
        finally:
            await gateway.aclose()
    answers = {(status, error.get("code"), error.get("rule")) for status, error, _ in served}
    assert answers <= {(200, None, None), (504, "deadline_exceeded", "deadline")}, answers
    for status, error, took in waited:
        assert (status, error["code"], error["rule"]) == (504, "deadline_exceeded", "deadline")
        assert "x-gateway-deadline-ms" in error["message"]
        assert error["attempts"] == 0
        assert took < 1.0


async def test_a_refused_requests_record_carries_its_own_duration_not_the_writes_wait(
    ledger_path: Path,
) -> None:
    # The 503's usage record waits for the lock (up to the busy timeout) after the answer
    # went: its duration_ms is the request's (arrival to the refusal), not that wait.
    async with upstream(status_handler(200)) as primary:
        gateway = Gateway(host_app, config=config(primary.url, ledger_path, 1200))
        try:
            assert (await answer_of(gateway))[0] == 200
            lock = LockedElsewhere(ledger_path)
            refused: list[tuple[int, dict[str, Any], float]] = []
            ended: list[float] = []

            async def one() -> None:
                started = time.monotonic()
                refused.append(await answer_of(gateway))
                ended.append(time.monotonic() - started)  # after the record's write

            async with anyio.create_task_group() as group:
                group.start_soon(one)
                try:
                    await anyio.sleep(3.5)  # the answer at 1.2 s, the write waiting since
                finally:
                    lock.release()
        finally:
            await gateway.aclose()
    conn = sqlite3.connect(ledger_path)
    try:
        rows = conn.execute("SELECT status, duration_ms FROM fmw_usage ORDER BY at").fetchall()
    finally:
        conn.close()
    assert refused[0][0] == 503
    assert ended and ended[0] > 3.0, ended  # the write did wait for the lock
    assert [status for status, _ in rows] == [200, 503], rows
    duration = rows[1][1] / 1000
    assert abs(duration - refused[0][2]) < 0.5, (rows, refused)
