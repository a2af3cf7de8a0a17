"""A gateway on a host that is having a bad day: out of file descriptors. What the host
lacks is the gateway's own condition, never an upstream's failure (SPEC §5 "local
conditions are not upstream failures"): a burst that exhausts `ulimit -n` must not open
every upstream's breaker for the callers that come after it."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fallback_mw import Gateway
from fallback_mw.health.memory import MemoryHealth
from tests.helpers import client_for, documented_rules, free_port
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

ENGINES = ["aiohttp", "httpx"]


class Descriptors:
    """Every file descriptor this process may open taken (as under `ulimit -n` with a burst
    of connections in flight): the next socket() fails with EMFILE. `take` takes again
    those freed meanwhile (a connection the gateway closed): the upstreams share this
    process, and one freed descriptor would let a connect through to a listener that
    cannot accept it."""

    def __init__(self) -> None:
        self.taken: list[int] = []

    def take(self) -> None:
        while True:
            try:
                self.taken.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
                return


@contextlib.contextmanager
def no_file_descriptors_left() -> Iterator[Descriptors]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 4096), hard))
    descriptors = Descriptors()
    try:
        descriptors.take()
        yield descriptors
    finally:
        for fd in descriptors.taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def config(primary: str, backup: str, warm: str, engine: str) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine},
        "upstreams": {
            "primary": {"url": primary},
            "backup": {"url": backup},
            "warm": {"url": warm},
        },
        "routes": [
            {"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1},
            {"id": "warm", "prefix": "/warm/", "plan": ["warm"]},
        ],
    }


def breaker_marks(gateway: Gateway, name: str) -> list[int]:
    health = gateway.services.health
    assert isinstance(health, MemoryHealth)
    return list(health.breaker(name).outcomes)


@pytest.mark.parametrize("engine", ENGINES)
async def test_running_out_of_file_descriptors_is_the_gateways_503_never_a_breaker_mark(
    engine: str,
) -> None:
    """Under `ulimit -n 64` and a burst of requests, connecting to an upstream failed with
    EMFILE: each was booked as the upstream's transport failure (`could not connect`), both
    upstreams' breakers opened, and for the next cooldown every caller got 503
    route_exhausted from healthy upstreams. It is now the gateway's own 503 `overloaded`
    (nothing sent, no breaker mark), and the gateway serves as soon as descriptors free."""
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
        upstream(status_handler(200, b"warm")) as warm,
    ):
        gateway = Gateway(host_app, config=config(primary.url, backup.url, warm.url, engine))
        try:
            async with client_for(gateway) as client:
                # Every module on the path imported; its connection stays pooled (a closed
                # one's descriptor, freed mid-request, would let a connect through).
                assert (await client.get("/warm/x")).status_code == 200
                answers = []
                with no_file_descriptors_left() as descriptors:
                    for _ in range(8):  # more than min_calls: a breaker would have opened
                        descriptors.take()
                        answers.append(await client.get("/v1/x"))
                marks = breaker_marks(gateway, "primary") + breaker_marks(gateway, "backup")
                after = await client.get("/v1/x")
        finally:
            await gateway.aclose()
    for answer in answers:
        assert answer.status_code == 503, answer.text
        error = json.loads(answer.content)["error"]
        assert error["code"] == "overloaded", error
        assert "file descriptors" in error["message"], error
        assert "ulimit -n" in error["message"], error
        assert answer.headers["retry-after"] == "1"  # as max_concurrency's overloaded
    assert 1 not in marks, marks  # no failure booked to either upstream
    assert after.status_code == 200 and after.content == b"primary"
    assert after.headers["x-gateway-attempts"] == "1"


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_connection_this_host_cannot_open_goes_on_to_the_backup(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EADDRNOTAVAIL is also what connecting to an address this host has no route of its
    own to gives (an IPv6 literal in a container with IPv6 off): the primary's every
    request ended in 503 `overloaded`, the backup never asked. Nothing was sent, so the
    next candidate is (no breaker mark either way)."""
    import socket

    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
        upstream(status_handler(200, b"warm")) as warm,
    ):
        port = int(primary.url.rsplit(":", 1)[1].split("/")[0])
        connect = socket.socket.connect

        def no_route(self: socket.socket, address: Any) -> None:
            if isinstance(address, tuple) and address[1] == port:
                raise OSError(errno.EADDRNOTAVAIL, os.strerror(errno.EADDRNOTAVAIL))
            connect(self, address)

        monkeypatch.setattr(socket.socket, "connect", no_route)
        gateway = Gateway(host_app, config=config(primary.url, backup.url, warm.url, engine))
        try:
            async with client_for(gateway) as client:
                answers = [await client.get("/v1/x") for _ in range(6)]
            marks = breaker_marks(gateway, "primary")
        finally:
            await gateway.aclose()
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.content == b"backup"
        assert answer.headers["x-gateway-provider"] == "backup"
        assert answer.headers["x-gateway-attempts"] == "2"
    assert 1 not in marks, marks  # the primary is not blamed for this host's routes


async def test_the_host_limit_rule_is_one_the_rule_table_explains(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An on-call engineer looking up the 503's `rule: host_limit` (the log line's
    rule=host_limit) in docs/failover.md's rule table found no row: the table stopped at
    the rules that came before it."""
    import logging
    import socket

    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
        upstream(status_handler(200, b"warm")) as warm,
    ):
        ports = {int(u.url.rsplit(":", 1)[1].split("/")[0]) for u in (primary, backup)}
        connect = socket.socket.connect

        def no_route(self: socket.socket, address: Any) -> None:
            if isinstance(address, tuple) and address[1] in ports:
                raise OSError(errno.EADDRNOTAVAIL, os.strerror(errno.EADDRNOTAVAIL))
            connect(self, address)

        monkeypatch.setattr(socket.socket, "connect", no_route)
        gateway = Gateway(host_app, config=config(primary.url, backup.url, warm.url, "aiohttp"))
        try:
            async with client_for(gateway) as client:
                answer = await client.get("/v1/x")
        finally:
            await gateway.aclose()
    assert answer.status_code == 503, answer.text
    rule = json.loads(answer.content)["error"]["rule"]
    assert rule == "host_limit"
    assert f"rule={rule}" in caplog.text
    assert rule in documented_rules()


# Runs in a fresh interpreter: what the first request imports has not been imported by this
# test process (anyio's asyncio backend, its CancelScope) when the descriptors run out.
FIRST_REQUEST = """
import asyncio, json, os, resource, sys

from fallback_mw import Gateway

config = {
    "gateway": {"allow_hosts": ["127.0.0.1"], "store": sys.argv[1]},
    "upstreams": {"primary": {"url": "http://127.0.0.1:9"}},
    "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"], "budget": "acme"}],
    "budgets": {"acme": {"limit": 10, "window": "total", "default_hold": 0.01}},
}


async def host(scope, receive, send):
    raise AssertionError("a routed request reached the host app")


async def call(gateway):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": "/v1/x", "raw_path": b"/v1/x", "query_string": b"",
        "headers": [(b"host", b"gw")], "client": ("127.0.0.1", 1), "server": ("gw", 80),
    }
    try:
        await gateway(scope, receive, send)
    except Exception as exc:  # a server answers this with a bare 500
        return {"raised": repr(exc)}
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return {"status": status, "body": json.loads(body)}


async def main():
    async with Gateway(host, config=config) as gateway:  # started as the lifespan does
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 4096), hard))
        taken = []
        while True:
            try:
                taken.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        try:
            answer = await call(gateway)
        finally:
            for fd in taken:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        answer["later"] = await call(gateway)
    print(json.dumps(answer))


asyncio.run(main())
"""


def test_the_first_budgeted_request_with_no_descriptor_left_fails_closed_never_a_bare_500(
    tmp_path: Path,
) -> None:
    """`serve` under `ulimit -n 64`, its first requests a burst: the budgeted route's first
    ledger call imported anyio's asyncio backend (anyio imports its parts on first use), the
    import could not open its file (EMFILE), and the OSError, then the same failure in the
    settlement's shield, went out of the gateway: a bare 500 and a traceback in the log.
    It is now 503 budget_unavailable (fail closed), and the ledger works once descriptors
    free."""
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    done = subprocess.run(
        [sys.executable, "-c", FIRST_REQUEST, store],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.splitlines()[-1])
    assert "raised" not in answer, (answer, done.stderr)
    assert answer["status"] == 503, answer
    assert answer["body"]["error"]["code"] == "budget_unavailable", answer
    assert "Traceback" not in done.stderr, done.stderr
    # Once descriptors are back the ledger answers: the hold is taken, the upstream (a
    # closed port) is what fails.
    later = answer["later"]
    assert later["status"] == 502 and later["body"]["error"]["code"] == "upstream_failed", later


SLOW_NAME = "slow-dns.test"  # a name whose lookup the event loop's resolver holds


@pytest.fixture
async def slow_resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    """The running loop's getaddrinfo (both engines resolve through it) holding every lookup
    of SLOW_NAME for 30 s: a resolver that is slow or does not answer (a DNS server gone,
    its packets dropped)."""
    import asyncio

    loop = asyncio.get_running_loop()
    original = loop.getaddrinfo

    async def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == SLOW_NAME:
            await asyncio.sleep(30)
        return await original(host, *args, **kwargs)

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.usefixtures("slow_resolver")
async def test_connect_timeout_covers_the_lookup_of_the_upstreams_name(engine: str) -> None:
    """A primary named by a host whose DNS lookup hangs: connect_timeout_ms (documented as
    the connect) did not cover the lookup on either engine, so every request waited the
    whole route deadline and ended in 504 deadline_exceeded, never reaching the backup. The
    lookup is now part of the connect: the attempt times out within connect_timeout_ms and
    the backup serves."""
    async with upstream(status_handler(200, b"backup")) as backup:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1", SLOW_NAME], "engine": engine},
            "upstreams": {
                "primary": {"url": f"http://{SLOW_NAME}:9", "connect_timeout_ms": 300},
                "backup": {"url": backup.url},
            },
            "routes": [
                {
                    "id": "chat",
                    "prefix": "/v1/",
                    "plan": ["primary", "backup"],
                    "retries": 1,
                    "deadline_ms": 10000,
                }
            ],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                started = time.monotonic()
                answer = await client.get("/v1/x")
                took = time.monotonic() - started
        finally:
            await gateway.aclose()
    assert answer.status_code == 200, answer.text
    assert answer.content == b"backup"
    assert answer.headers["x-gateway-attempts"] == "2"
    assert took < 5, took  # the connect timeout (0.3 s), not the 10 s deadline


@contextlib.contextmanager
def small_disk(where: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs mounted at `where` (root with CAP_SYS_ADMIN, else the test skips):
    a disk that can really fill up, for SQLite's own failure."""
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def fill(disk: Path) -> None:
    with (disk / "filler").open("wb", buffering=0) as filler, contextlib.suppress(OSError):
        while True:
            filler.write(b"\0" * 65536)


def test_a_store_on_a_full_disk_says_the_disk_is_full(tmp_path: Path) -> None:
    """The route store's disk filled up: `routes add` and even `routes list` answered
    'cannot open the SQLite store ...: disk I/O error' (SQLite's words for the WAL index it
    could not create), the budgeted routes' log line 'SQLite ledger unreachable
    (OperationalError)'. Both now say the disk holding the store is full; once it has room
    again, the store works as before."""
    import asyncio
    from decimal import Decimal

    from fallback_mw.budget import LedgerUnavailable
    from fallback_mw.config import BudgetConfig
    from fallback_mw.store.ledgers.sqlite import SQLiteLedger
    from tests.test_cli_admin import run_cli

    with small_disk(tmp_path / "disk") as disk:
        store = f"sqlite:///{disk / 'gw.db'}"
        add = ["routes", "add", "--store", store, "--prefix", "/a/"]
        assert run_cli(*add, "--id", "a", "--upstream", "http://127.0.0.1:9")[0] == 0
        fill(disk)
        status, _, err = run_cli(*add, "--id", "b", "--upstream", "http://127.0.0.1:9")
        assert status == 1, err
        assert f"the disk holding {disk} is full" in err, err
        status, _, err = run_cli("routes", "list", "--store", store)
        assert status == 1 and f"the disk holding {disk} is full" in err, err

        ledger = SQLiteLedger(str(disk / "gw.db"))
        budget = BudgetConfig(limit=Decimal("10"), window="total", default_hold=Decimal("0.01"))
        try:
            with pytest.raises(LedgerUnavailable, match=f"the disk holding {disk} is full"):
                asyncio.run(ledger.hold("acme", budget, Decimal("0.01")))
        finally:
            asyncio.run(ledger.aclose())

        (disk / "filler").unlink()  # room again
        status, out, err = run_cli("routes", "list", "--store", store)
        assert status == 0 and "a" in out, err


def test_eval_on_a_full_disk_keeps_the_last_artifact_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fallback-mw eval --out` on a disk that filled up: the table was printed, and the
    artifact of the run before was truncated to an empty file (written in place), so a
    full disk destroyed the last good result. The files are replaced whole or not at all:
    the earlier ones stay as they were, and the one error line says why."""
    from tests.cli_runner import run_cli

    with small_disk(tmp_path / "disk") as disk:
        out, page = disk / "eval.json", disk / "eval.html"
        out.write_text('{"the": "last run"}\n')
        page.write_text("<html>last run</html>\n")
        fill(disk)
        assert run_cli(["eval", "--requests", "2", "--out", str(out)]) == 1
        printed = capsys.readouterr()
        assert "verdict:" in printed.out  # the table itself is printed
        assert printed.err.strip() == (
            f"fallback-mw: error: cannot write {out}: No space left on device"
        )
        assert out.read_text() == '{"the": "last run"}\n'
        assert page.read_text() == "<html>last run</html>\n"
        assert sorted(p.name for p in disk.iterdir()) == ["eval.html", "eval.json", "filler"]


def test_eval_out_replaced_whole_keeps_the_files_permissions(tmp_path: Path) -> None:
    """The whole-or-nothing write (a temporary file renamed over the artifact) made every
    artifact mode 0600 whatever the umask, and an existing one lost its mode: a report
    another user or a web server read (0644) became unreadable to them. A new file gets
    the umask's mode, as before; a replaced one keeps its own."""
    from tests.cli_runner import run_cli

    out, page = tmp_path / "eval.json", tmp_path / "eval.html"
    previous = os.umask(0o022)
    try:
        assert run_cli(["eval", "--requests", "1", "--out", str(out)]) == 0
        assert [oct(p.stat().st_mode & 0o777) for p in (out, page)] == ["0o644"] * 2
        out.chmod(0o640)
        page.chmod(0o604)
        assert run_cli(["eval", "--requests", "1", "--out", str(out)]) == 0
    finally:
        os.umask(previous)
    assert [oct(p.stat().st_mode & 0o777) for p in (out, page)] == ["0o640", "0o604"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.html", "eval.json"]


def test_eval_out_through_a_symlink_writes_the_file_it_names(tmp_path: Path) -> None:
    """An --out that is a symlink (`results/latest.json` -> a shared volume's file): the
    whole-or-nothing write renamed its new file over the link, so the file the link named
    kept the run before's result and the link was gone. The file it names is replaced (a
    temporary file beside it), the link kept."""
    from tests.cli_runner import run_cli

    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "eval.json").write_text('{"the": "last run"}\n')
    (shared / "eval.html").write_text("<html>last run</html>\n")
    results = tmp_path / "results"
    results.mkdir()
    for name in ("eval.json", "eval.html"):
        (results / name).symlink_to(shared / name)
    assert run_cli(["eval", "--requests", "1", "--out", str(results / "eval.json")]) == 0
    for name in ("eval.json", "eval.html"):
        assert (results / name).is_symlink(), name
    assert json.loads((shared / "eval.json").read_text())["arms"]
    assert "last run" not in (shared / "eval.html").read_text()
    assert sorted(p.name for p in shared.iterdir()) == ["eval.html", "eval.json"]


@pytest.mark.parametrize("limit", [10, 12])
def test_serve_under_an_open_file_limit_too_low_to_start_says_so(
    tmp_path: Path, limit: int
) -> None:
    """`serve` under `ulimit -n 12`: its event loop could not start (no descriptor for its
    own socketpair), and the command said 'unexpected internal error (RuntimeError); please
    report it' (under 10, 'OSError: Too many open files'). Either is now the one error line
    naming the limit to raise."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.primary]\nurl = "http://127.0.0.1:9"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    command = [sys.executable, "-m", "fallback_mw", "serve", "--config", str(config)]
    done = subprocess.run(
        ["bash", "-c", f'ulimit -n {limit} && exec "$@"', "bash", *command,
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if "fallback-mw: error:" in line]
    assert errors == [
        f"fallback-mw: error: out of file descriptors (EMFILE): raise the open-file limit "
        f"(ulimit -n, now {limit}; systemd LimitNOFILE)"
    ], done.stderr
