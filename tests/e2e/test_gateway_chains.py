"""A gateway in front of another gateway, as platform teams chain them: two (or one)
`fallback-mw serve` processes on real sockets, each one's plan naming the other."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from aiohttp import web

from tests.helpers import free_port, log_text, serve_process, wait_listening
from tests.upstreams import closed_port_url, status_handler, upstream

pytestmark = pytest.mark.e2e

A_KEY = "team-a-secret-51c9e0"
B_KEY = "team-b-secret-7d22f4"
CALLER_KEY = "caller-secret-0be381"
REQUEST_LINE = "gateway request route="
STRIP_VIA = 'strip_headers = ["via"]'


def gateway_config(
    path: Path, route_id: str, upstream_url: str, env: str, gateway: str = ""
) -> Path:
    path.write_text(
        f"""
[gateway]
allow_hosts = ["127.0.0.1", "localhost"]
deadline_ms = 4000
{gateway}

[upstreams.next]
url = "{upstream_url}"
auth_env = "{env}"

[[routes]]
id = "{route_id}"
prefix = "/v1/"
plan = ["next"]
""",
        encoding="utf-8",
    )
    return path


@asynccontextmanager
async def gateways(tmp_path: Path, *configs: tuple[Path, int]) -> AsyncIterator[list[Path]]:
    env = dict(os.environ, TEAM_A_KEY=A_KEY, TEAM_B_KEY=B_KEY, OTEL_TRACES_EXPORTER="none")
    env["OTEL_METRICS_EXPORTER"] = "none"
    logs = [tmp_path / f"serve-{port}.log" for _, port in configs]
    with ExitStack() as stack:
        processes = [
            stack.enter_context(serve_process(config, port, log, env=env))
            for (config, port), log in zip(configs, logs, strict=True)
        ]
        for process, (_, port), log in zip(processes, configs, logs, strict=True):
            await wait_listening(process, port, log)
        yield logs


def request_lines(logs: list[Path]) -> list[str]:
    return [line for log in logs for line in log_text(log).splitlines() if REQUEST_LINE in line]


async def wait_for_line(logs: list[Path], needle: str, limit: float = 30.0) -> None:
    """Until a request line holding `needle` is written (after the answer, at the end)."""
    deadline = time.monotonic() + limit
    while not any(needle in line for line in request_lines(logs)):
        assert time.monotonic() < deadline, "\n".join(request_lines(logs)[-5:])
        await anyio.sleep(0.05)


@pytest.mark.anyio
async def test_two_gateways_whose_plans_name_each_other_end_the_loop_at_once(
    tmp_path: Path,
) -> None:
    """Team A's plan names team B's gateway, and B's names A's. Each gateway stripped what
    the other sent and forwarded it again: one request became a stream of requests going
    round (thousands a second) that never ended, not even after the caller got its 504.
    Now the gateway that sees a request come back refuses it (508 `loop_detected`), and
    that answer goes back out: three requests in all."""
    port_a, port_b = free_port(), free_port()
    config_a = gateway_config(
        tmp_path / "a.toml", "team-a", f"http://127.0.0.1:{port_b}", "TEAM_A_KEY"
    )
    config_b = gateway_config(
        tmp_path / "b.toml", "team-b", f"http://127.0.0.1:{port_a}", "TEAM_B_KEY"
    )
    async with gateways(tmp_path, (config_a, port_a), (config_b, port_b)) as logs:
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.get(
                f"http://127.0.0.1:{port_a}/v1/models",
                headers={"authorization": f"Bearer {CALLER_KEY}"},
            )
        elapsed = time.monotonic() - started
        assert answer.status_code == 508, answer.text
        # Each line is written as its request ends: the caller's (A's first) last.
        await wait_for_line(logs[1:], "route=team-b outcome=served status=508")
        await wait_for_line(logs[:1], "route=team-a outcome=served status=508")
        lines = request_lines(logs)
    error = answer.json()["error"]
    assert error["code"] == "loop_detected"
    assert error["rule"] == "loop"
    assert error["route"] == "team-a"  # refused where it came back: A, on its way round
    assert "'team-a'" in error["message"] and "plan" in error["message"]
    # The caller reads who answered it: A, through its candidate `next` (B).
    assert answer.headers["x-gateway-route"] == "team-a"
    assert answer.headers["x-gateway-provider"] == "next"
    assert answer.headers.get_list("x-gateway-route") == ["team-a"]
    assert answer.headers["x-should-retry"] == "false"  # a retry would go round again
    assert elapsed < 30  # no deadline ran out
    # Caller -> A -> B -> A (refused): three requests, the first two answered by relay.
    assert len(lines) == 3, "\n".join(lines[:10])
    assert sum("route=team-a" in line for line in lines) == 2
    for secret in (A_KEY, B_KEY, CALLER_KEY):
        assert all(secret not in log_text(log) for log in logs)


@pytest.mark.anyio
async def test_a_plan_naming_its_own_gateway_through_a_relay_ends_at_once(
    tmp_path: Path,
) -> None:
    """A plan whose candidate is the gateway itself behind something serve cannot see
    through at start (a TCP relay, a port forward; a plain `localhost` spelling of its own
    address is refused at start, tests/e2e/test_serve_own_address.py): each request was
    forwarded to itself again and again."""
    port = free_port()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                writer.write(chunk)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            inner_reader, inner_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, inner_writer), pipe(inner_reader, writer))

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    relay_port = server.sockets[0].getsockname()[1]
    config = gateway_config(
        tmp_path / "a.toml", "team-a", f"http://127.0.0.1:{relay_port}", "TEAM_A_KEY"
    )
    try:
        async with gateways(tmp_path, (config, port)) as logs:
            async with httpx.AsyncClient(timeout=60) as client:
                answer = await client.get(f"http://127.0.0.1:{port}/v1/models")
            assert answer.status_code == 508, answer.text
            await wait_for_line(logs, "status=508 chosen=next")
            lines = request_lines(logs)
    finally:
        server.close()
        await server.wait_closed()
    assert answer.json()["error"]["code"] == "loop_detected"
    assert len(lines) == 2, "\n".join(lines[:10])


@pytest.mark.anyio
async def test_a_chain_of_two_gateways_serves_and_says_so_in_via(tmp_path: Path) -> None:
    """A -> B -> upstream is a chain, not a loop: served. Each gateway names itself in
    `Via` (RFC 9110 §7.6.3: a gateway sends it in each request it forwards) with a
    pseudonym, never a host or port; the upstream gets B's key only."""
    async with upstream(status_handler(200, b'{"ok": true}')) as model:
        port_a, port_b = free_port(), free_port()
        config_a = gateway_config(
            tmp_path / "a.toml", "team-a", f"http://127.0.0.1:{port_b}", "TEAM_A_KEY"
        )
        config_b = gateway_config(tmp_path / "b.toml", "team-b", model.url, "TEAM_B_KEY")
        async with (
            gateways(tmp_path, (config_a, port_a), (config_b, port_b)),
            httpx.AsyncClient(timeout=60) as client,
        ):
            answer = await client.get(
                f"http://127.0.0.1:{port_a}/v1/models",
                headers={"authorization": f"Bearer {CALLER_KEY}", "via": "1.1 corp-proxy"},
            )
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-gateway-route"] == "team-a"
    assert model.count == 1
    headers = model.received[0].headers
    assert dict(headers)["authorization"] == f"Bearer {B_KEY}"
    via = ", ".join(value for name, value in headers if name == "via")
    entries = [entry.strip().split() for entry in via.split(",")]
    assert entries[0] == ["1.1", "corp-proxy"]  # the caller's, kept in order
    assert len(entries) == 3
    for protocol, pseudonym in entries[1:]:
        assert protocol == "1.1"
        assert pseudonym.startswith("fallback-mw-")
        assert str(port_a) not in pseudonym and str(port_b) not in pseudonym
    assert entries[1] != entries[2]  # two gateways, two names


@pytest.mark.anyio
async def test_a_plan_naming_another_route_of_its_own_gateway_is_a_chain(tmp_path: Path) -> None:
    """Route `front`'s plan names its own gateway's route `pool` (by its `/pool` path), whose
    plan names the model: the request passes the gateway twice, each time by another route,
    and is served. Only a request that comes back to a route it already passed is a loop."""
    async with upstream(status_handler(200, b'{"ok": true}')) as model:
        port = free_port()
        config = tmp_path / "gateway.toml"
        config.write_text(
            f"""
[gateway]
allow_hosts = ["127.0.0.1", "localhost"]

[upstreams.pool]
url = "http://localhost:{port}/pool"
auth_env = "TEAM_A_KEY"

[upstreams.model]
url = "{model.url}"
auth_env = "TEAM_B_KEY"

[[routes]]
id = "front"
prefix = "/v1/"
plan = ["pool"]

[[routes]]
id = "pool"
prefix = "/pool/"
plan = ["model"]
""",
            encoding="utf-8",
        )
        async with gateways(tmp_path, (config, port)), httpx.AsyncClient(timeout=60) as client:
            answer = await client.get(f"http://127.0.0.1:{port}/v1/models")
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-gateway-route"] == "front"
    assert model.count == 1
    assert model.received[0].path == "/pool/v1/models"


@pytest.mark.anyio
async def test_the_inner_gateways_answers_reach_the_caller_under_the_outer_rules(
    tmp_path: Path,
) -> None:
    """Team B's refusals are statuses to team A's walk: its 402 is relayed as it came (not
    in `failover_status`), naming B's route in its body; its 502 `upstream_failed` fails
    over to A's next candidate. The caller reads A's `x-gateway-*` fields, once each: B's,
    and those an upstream forges, are not relayed."""
    forged = {"x-gateway-provider": "forged", "x-gateway-attempts": "99"}
    async with (
        upstream(status_handler(200, b'{"ok": true}', **forged)) as model,
        upstream(status_handler(200, b'{"direct": true}', **forged)) as direct,
    ):
        port_a, port_b = free_port(), free_port()
        config_b = tmp_path / "b.toml"
        config_b.write_text(
            f"""
[gateway]
allow_hosts = ["127.0.0.1"]

[budgets.spent]
limit = 0.000001
window = "total"
default_hold = 0.01

[upstreams.model]
url = "{model.url}"
auth_env = "TEAM_B_KEY"

[upstreams.gone]
url = "{closed_port_url()}"
auth_env = "TEAM_B_KEY"

[[routes]]
id = "b-budget"
prefix = "/v1/"
plan = ["model"]
budget = "spent"

[[routes]]
id = "b-down"
prefix = "/down/"
plan = ["gone"]
""",
            encoding="utf-8",
        )
        config_a = tmp_path / "a.toml"
        config_a.write_text(
            f"""
[gateway]
allow_hosts = ["127.0.0.1"]

[upstreams.teamb]
url = "http://127.0.0.1:{port_b}"
auth_env = "TEAM_A_KEY"

[upstreams.direct]
url = "{direct.url}"
auth_env = "TEAM_A_KEY"

[[routes]]
id = "team-a"
prefix = "/"
plan = ["teamb", "direct"]
retries = 1
""",
            encoding="utf-8",
        )
        async with (
            gateways(tmp_path, (config_a, port_a), (config_b, port_b)),
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port_a}", timeout=60) as client,
        ):
            refused = await client.get("/v1/models")
            failed_over = await client.get("/down/models")
    assert refused.status_code == 402, refused.text
    assert refused.json()["error"]["code"] == "budget_exceeded"
    assert refused.json()["error"]["route"] == "b-budget"  # who refused: B's route
    assert refused.headers.get_list("x-gateway-route") == ["team-a"]
    assert refused.headers.get_list("x-gateway-provider") == ["teamb"]
    assert refused.headers.get_list("x-gateway-attempts") == ["1"]
    assert failed_over.status_code == 200, failed_over.text
    assert failed_over.json() == {"direct": True}
    assert failed_over.headers.get_list("x-gateway-provider") == ["direct"]
    assert failed_over.headers.get_list("x-gateway-attempts") == ["2"]
    assert model.count == 0 and direct.count == 1


@pytest.mark.anyio
async def test_a_caller_leaving_a_stream_through_two_gateways_closes_the_models_stream(
    tmp_path: Path,
) -> None:
    """SSE through A and B: the caller reads two events and hangs up; A cancels its attempt,
    B sees its caller gone and closes its connection to the model, which stops streaming."""
    closed: list[int] = []
    gone = anyio.Event()

    async def events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        number = 0
        try:
            for number in range(600):  # a minute of events
                await response.write(f"data: {number}\n\n".encode())
                await asyncio.sleep(0.1)
        finally:
            # Cancelled (the connection closed: handler_cancellation) or a write refused.
            closed.append(number)
            gone.set()
        return response

    async with upstream(events) as model:
        port_a, port_b = free_port(), free_port()
        config_a = gateway_config(
            tmp_path / "a.toml", "team-a", f"http://127.0.0.1:{port_b}", "TEAM_A_KEY"
        )
        config_b = gateway_config(tmp_path / "b.toml", "team-b", model.url, "TEAM_B_KEY")
        async with (
            gateways(tmp_path, (config_a, port_a), (config_b, port_b)),
            httpx.AsyncClient(timeout=60) as client,
        ):
            seen = []
            async with client.stream("GET", f"http://127.0.0.1:{port_a}/v1/stream") as answer:
                async for line in answer.aiter_lines():
                    if line.startswith("data:"):
                        seen.append(line)
                    if len(seen) == 2:
                        break
            with anyio.fail_after(30):
                await gone.wait()
    assert seen == ["data: 0", "data: 1"]
    assert closed[0] < 300  # stopped well before the stream's end


@pytest.mark.anyio
async def test_a_loop_ends_at_once_when_strip_headers_lists_via(tmp_path: Path) -> None:
    """Operators who keep the caller's `Via` from the vendors (`strip_headers` naming it)
    still have gateways that know a request coming back: the walker reads the `Via` it
    received, not what it forwards. Two such gateways whose plans name each other went
    round until the deadline (the caller's 504), then on after it."""
    port_a, port_b = free_port(), free_port()
    configs = [
        gateway_config(
            tmp_path / "a.toml", "team-a", f"http://127.0.0.1:{port_b}", "TEAM_A_KEY", STRIP_VIA
        ),
        gateway_config(
            tmp_path / "b.toml", "team-b", f"http://127.0.0.1:{port_a}", "TEAM_B_KEY", STRIP_VIA
        ),
    ]
    async with gateways(tmp_path, (configs[0], port_a), (configs[1], port_b)) as logs:
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.get(
                f"http://127.0.0.1:{port_a}/v1/models", headers={"via": "1.1 corp-proxy"}
            )
        assert answer.status_code == 508, answer.text
        await wait_for_line(logs[1:], "route=team-b outcome=served status=508")
        await wait_for_line(logs[:1], "route=team-a outcome=served status=508")
        lines = request_lines(logs)
    assert answer.json()["error"]["code"] == "loop_detected"
    assert len(lines) == 3, "\n".join(lines[:10])


@pytest.mark.anyio
async def test_strip_headers_naming_via_keeps_the_callers_hops_from_the_upstream(
    tmp_path: Path,
) -> None:
    """What `strip_headers = ["via"]` is for still holds: the caller's hops (a corporate
    proxy's name) do not reach the upstream, the gateways' own names do."""
    async with upstream(status_handler(200, b'{"ok": true}')) as model:
        port_a, port_b = free_port(), free_port()
        configs = [
            gateway_config(
                tmp_path / "a.toml", "team-a", f"http://127.0.0.1:{port_b}", "TEAM_A_KEY", STRIP_VIA
            ),
            gateway_config(tmp_path / "b.toml", "team-b", model.url, "TEAM_B_KEY", STRIP_VIA),
        ]
        async with (
            gateways(tmp_path, (configs[0], port_a), (configs[1], port_b)),
            httpx.AsyncClient(timeout=60) as client,
        ):
            answer = await client.get(
                f"http://127.0.0.1:{port_a}/v1/models",
                headers={"via": "1.1 corp-proxy.internal:3128, 1.0 fallback-mw-forged x"},
            )
    assert answer.status_code == 200, answer.text
    via = ", ".join(value for name, value in model.received[0].headers if name == "via")
    assert "corp-proxy" not in via
    entries = [entry.strip().split() for entry in via.split(",")]
    assert [words[1][:12] for words in entries] == ["fallback-mw-"] * 3
    assert entries[0] == ["1.0", "fallback-mw-forged"]  # its comment dropped


@pytest.mark.anyio
async def test_the_outer_deadline_ends_the_inner_gateways_walk(tmp_path: Path) -> None:
    """No deadline is passed on from gateway to gateway (x-gateway-deadline-ms is a caller's
    header, stripped as every x-gateway-* one): when A's deadline passes, A closes its
    connection to B, B counts its caller gone and closes its own to the model. B's walk
    does not outlive A's deadline, and neither side books it to a breaker."""
    cancelled = anyio.Event()

    async def hangs(request: web.Request) -> web.Response:
        try:
            await asyncio.sleep(60)
        finally:
            cancelled.set()  # the connection closed: handler_cancellation
        return web.Response(text="late")

    async with upstream(hangs) as model:
        port_a, port_b = free_port(), free_port()
        config_a = gateway_config(
            tmp_path / "a.toml", "team-a", f"http://127.0.0.1:{port_b}", "TEAM_A_KEY"
        )
        config_a.write_text(
            config_a.read_text(encoding="utf-8").replace(
                "deadline_ms = 4000", "deadline_ms = 1500"
            ),
            encoding="utf-8",
        )
        config_b = gateway_config(tmp_path / "b.toml", "team-b", model.url, "TEAM_B_KEY")
        config_b.write_text(
            config_b.read_text(encoding="utf-8").replace(
                "deadline_ms = 4000", "deadline_ms = 60000"
            ),
            encoding="utf-8",
        )
        async with (
            gateways(tmp_path, (config_a, port_a), (config_b, port_b)) as logs,
            httpx.AsyncClient(timeout=60) as client,
        ):
            answer = await client.get(f"http://127.0.0.1:{port_a}/v1/chat")
            assert answer.status_code == 504, answer.text
            with anyio.fail_after(15):  # B's own deadline is 60 s
                await cancelled.wait()
            await wait_for_line(logs, "route=team-b outcome=client_disconnected", limit=15)
    lines = request_lines(logs)
    assert any("route=team-a outcome=deadline_exceeded" in line for line in lines), lines
