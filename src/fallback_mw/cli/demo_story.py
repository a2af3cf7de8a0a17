"""The story `fallback-mw demo` tells: a failing primary, a backup and the gateway on
loopback ports (free ones by default; with `--port P`: the gateway on P, the primary on
P+1 and the backup on P+2). Imported by cli/demo.py only when the demo runs (it needs
uvicorn, the serve extra; the caller is aiohttp, in the base install).

Everything runs in one event loop in this process (two aiohttp upstreams, the gateway on
uvicorn) and is torn down before returning, so the demo leaves nothing behind. The demo's
credentials are handed to the Gateway directly; the process environment is not touched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

from fallback_mw.cli.app import Failed, Refused
from fallback_mw.cli.serve import not_found_app
from fallback_mw.cli.serve_logging import uvicorn_colours
from fallback_mw.gateway import Gateway

DEMO_ENVIRON = {"DEMO_PRIMARY_KEY": "demo-primary-key", "DEMO_BACKUP_KEY": "demo-backup-key"}
CALLER_KEY = "caller-key-that-must-not-travel"
BUDGET_LIMIT = "0.03"
BUDGET_HOLD = "0.01"


def _cannot_listen(port: int, exc: OSError) -> str:
    # asyncio's bind error carries its own sentence ("error while attempting to bind on
    # address ('127.0.0.1', P): address already in use") as strerror: say it once, plainly.
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    return (
        f"cannot listen on 127.0.0.1:{port} ({reason}); the demo uses --port P, P+1 and "
        "P+2: choose another P, or leave --port out for free ports"
    )


@dataclass
class DemoUpstream:
    name: str
    status: int
    url: str = ""
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    caller_key_seen: bool = False


@asynccontextmanager
async def _upstream(name: str, status: int, port: int) -> AsyncIterator[DemoUpstream]:
    state = DemoUpstream(name=name, status=status)

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        state.requests.append((request.method, request.path))
        if any(CALLER_KEY in value for value in request.headers.values()):
            state.caller_key_seen = True
        if status >= 500:
            return web.json_response({"error": f"{name} is down"}, status=status)
        return web.json_response({"object": "list", "data": [], "served_by": name}, status=status)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise Failed(f"{name}: {_cannot_listen(port, exc)}") from None
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    state.url = f"http://127.0.0.1:{port}"
    try:
        yield state
    finally:
        await runner.cleanup()


def demo_config(primary: DemoUpstream, backup: DemoUpstream) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "deadline_ms": 5000},
        "upstreams": {
            "primary": {"url": primary.url, "auth_env": "DEMO_PRIMARY_KEY"},
            "backup": {
                "url": backup.url,
                "auth_header": "x-api-key",
                "auth_scheme": "",
                "auth_env": "DEMO_BACKUP_KEY",
            },
        },
        "routes": [
            {"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1},
            {"id": "metered", "prefix": "/metered/", "plan": ["backup"], "budget": "demo"},
        ],
        "budgets": {
            "demo": {"limit": BUDGET_LIMIT, "window": "total", "default_hold": BUDGET_HOLD}
        },
    }


@asynccontextmanager
async def _gateway(config: dict[str, Any], port: int) -> AsyncIterator[str]:
    import uvicorn

    app = Gateway(not_found_app, config=config, environ=DEMO_ENVIRON)
    if app.config_error is not None:
        # The demo's own configuration always loads; what the environment adds may not
        # (OTEL_PROPAGATORS naming a propagator not installed): one line, as serve says it.
        raise Refused(app.config_error)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as exc:
        sock.close()
        await app.aclose()
        raise Failed(f"gateway: {_cannot_listen(port, exc)}") from None
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            lifespan="on",
            log_level="warning",
            access_log=False,
            use_colors=uvicorn_colours(),
        )
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()  # raises what stopped the server
                raise RuntimeError("the gateway server stopped during startup")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


@dataclass
class Answer:
    status_code: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class DemoClient:
    """The demo's caller: aiohttp (in the base install), answers read whole."""

    def __init__(self, session: ClientSession, base_url: str) -> None:
        self._session, self._base = session, base_url

    async def request(self, method: str, path: str, **kwargs: Any) -> Answer:
        async with self._session.request(method, self._base + path, **kwargs) as response:
            headers = {name.lower(): value for name, value in response.headers.items()}
            return Answer(response.status, headers, await response.read())

    async def get(self, path: str, **kwargs: Any) -> Answer:
        return await self.request("GET", path, **kwargs)

    async def post(self, path: str, **kwargs: Any) -> Answer:
        return await self.request("POST", path, **kwargs)


def _describe(response: Answer) -> str:
    headers = response.headers
    parts = [f"{response.status_code}"]
    for name in ("x-gateway-provider", "x-gateway-attempts"):
        if name in headers:
            parts.append(f"{name}: {headers[name]}")
    return ", ".join(parts)


async def _run(port: int, say: Callable[..., None]) -> bool:
    ok = True
    ports = (port, port + 1, port + 2) if port else (0, 0, 0)
    async with (
        _upstream("primary", 503, ports[1]) as primary,
        _upstream("backup", 200, ports[2]) as backup,
        _gateway(demo_config(primary, backup), ports[0]) as gateway_url,
        ClientSession(timeout=ClientTimeout(total=10)) as session,
    ):
        client = DemoClient(session, gateway_url)
        say("fallback_mw demo: everything below runs on 127.0.0.1 and stops when it ends")
        say(f"  primary  {primary.url}  answers 503 to everything")
        say(f"  backup   {backup.url}  answers 200")
        say(f"  gateway  {gateway_url}  route 'chat': /v1/ -> plan [primary, backup], retries 1")
        say()
        caller = {"authorization": f"Bearer {CALLER_KEY}"}

        say("1. GET is replayable, so a 503 from the primary fails over")
        response = await client.get("/v1/models", headers=caller)
        say(f"   GET /v1/models -> {_describe(response)}")
        say(f"   primary received {len(primary.requests)}, backup received {len(backup.requests)}")
        failed_over = (
            response.status_code == 200
            and response.headers.get("x-gateway-provider") == "backup"
            and response.headers.get("x-gateway-attempts") == "2"
        )
        say("   => FAILED OVER to the backup" if failed_over else "   => unexpected result")
        ok = ok and failed_over
        say()

        say("2. POST is not in this route's replayable_methods (a POST may act twice): no failover")
        before_primary, before_backup = len(primary.requests), len(backup.requests)
        response = await client.post(
            "/v1/chat/completions", json={"model": "demo", "messages": []}, headers=caller
        )
        to_primary = len(primary.requests) - before_primary
        to_backup = len(backup.requests) - before_backup
        say(f"   POST /v1/chat/completions -> {_describe(response)}")
        say(f"   primary received {to_primary}, backup received {to_backup}")
        post_rule = (
            response.status_code == 502
            and response.json()["error"]["code"] == "upstream_failed"
            and to_primary == 1
            and to_backup == 0
        )
        say(
            "   => 502 upstream_failed (never the primary's body); the backup was never contacted"
            if post_rule
            else "   => unexpected result"
        )
        ok = ok and post_rule
        say()

        # Budgets need a ledger; show them only when this build has one that refuses.
        statuses: list[int] = []
        refusal: str | None = None
        before_backup = len(backup.requests)
        for _ in range(5):
            response = await client.get("/metered/models")
            statuses.append(response.status_code)
            if response.status_code == 402:
                refusal = response.json().get("error", {}).get("code")
        served = len(backup.requests) - before_backup
        if refusal == "budget_exceeded":
            say(
                f"3. budget: route 'metered' spends budget 'demo' (limit {BUDGET_LIMIT}, "
                f"hold {BUDGET_HOLD} per request)"
            )
            say(f"   5 x GET /metered/models -> {', '.join(map(str, statuses))}")
            say(f"   backup received {served}")
            budget_rule = served == statuses.count(200) and statuses.count(402) >= 1
            say(
                "   => once the limit is spent: 402 budget_exceeded, no upstream contacted"
                if budget_rule
                else "   => unexpected result"
            )
            ok = ok and budget_rule
        else:
            say("3. budget: skipped (this build has no budget ledger behind the gateway)")
        say()

        leaked = primary.caller_key_seen or backup.caller_key_seen
        say(
            "The caller's Authorization header reached "
            + ("an upstream: UNEXPECTED" if leaked else "no upstream; each got its own key.")
        )
        ok = ok and not leaked
    return ok


def run_story(port: int, say: Callable[..., None]) -> bool:
    """The whole demo on one event loop; True when every result was the expected one."""
    # The per-request log lines would interleave with the story; keep them out of it.
    logging.getLogger("fallback_mw").addHandler(logging.NullHandler())
    return asyncio.run(_run(port, say))
