"""The slim install: the base package serves with memory state and no store while every
optional dependency is blocked; a feature whose extra is missing is refused at load in one
line naming the extra. Each case runs in a fresh interpreter with the extra's modules set to
None in sys.modules, which makes importing them fail as if they were not installed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

OPTIONAL = ["uvicorn", "asyncpg", "redis", "httpx", "httpcore", "opentelemetry.sdk"]
HOSTS = ["starlette", "fastapi", "django"]


def run_blocked(blocked: list[str], body: str) -> subprocess.CompletedProcess[str]:
    code = f"import sys\nfor _name in {blocked!r}:\n    sys.modules[_name] = None\n"
    return subprocess.run(
        [sys.executable, "-c", code + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_base_install_serves_a_failover_with_every_optional_dependency_blocked() -> None:
    # A failing primary and a backup on aiohttp (a base dependency), the Gateway driven as a
    # raw ASGI app: the whole request path of the base install, nothing optional imported.
    result = run_blocked(
        OPTIONAL + HOSTS,
        """
        import asyncio, json
        from aiohttp import web
        from fallback_mw import Gateway

        async def host(scope, receive, send):
            raise AssertionError("routed requests never reach the host app")

        async def main():
            async def fail(request):
                return web.Response(status=503)
            async def ok(request):
                return web.json_response({"served": "backup"})
            ports = []
            runners = []
            for handler in (fail, ok):
                app = web.Application()
                app.router.add_route("*", "/{tail:.*}", handler)
                runner = web.AppRunner(app)
                await runner.setup()
                site = web.TCPSite(runner, "127.0.0.1", 0)
                await site.start()
                runners.append(runner)
                ports.append(site._server.sockets[0].getsockname()[1])
            gateway = Gateway(host, config={
                "upstreams": {
                    "primary": {"url": f"http://127.0.0.1:{ports[0]}"},
                    "backup": {"url": f"http://127.0.0.1:{ports[1]}"},
                },
                "routes": [{"id": "api", "prefix": "/v1/", "plan": ["primary", "backup"],
                            "retries": 1, "replayable_methods": ["POST"]}],
            })
            sent = []
            body = [{"type": "http.request", "body": b"{}", "more_body": False}]
            async def receive():
                if body:
                    return body.pop(0)
                await asyncio.Event().wait()  # the client stays connected
            async def send(message):
                sent.append(message)
            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                     "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
                     "raw_path": b"/v1/chat/completions", "query_string": b"",
                     "root_path": "", "headers": [(b"content-type", b"application/json")],
                     "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80)}
            await gateway(scope, receive, send)
            for runner in runners:
                await runner.cleanup()
            start = sent[0]
            headers = {k.decode(): v.decode() for k, v in start["headers"]}
            payload = b"".join(m.get("body", b"") for m in sent[1:])
            print(json.dumps({"status": start["status"],
                              "provider": headers.get("x-gateway-provider"),
                              "body": payload.decode(),
                              "loaded": sorted(m for m in ("aiohttp", "uvicorn", "httpx")
                                               if sys.modules.get(m) is not None)}))

        asyncio.run(main())
        """,
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {
        "status": 200,
        "provider": "backup",
        "body": '{"served": "backup"}',
        "loaded": ["aiohttp"],
    }


@pytest.mark.parametrize(
    ("blocked", "gateway", "message"),
    [
        (
            ["redis"],
            {"state": "redis://:s3cret@127.0.0.1:6379/0"},
            "state = \"redis://...\" needs the redis extra: pip install 'fallback_mw[redis]'",
        ),
        (
            ["asyncpg"],
            {"store": "postgresql://admin:s3cret@127.0.0.1:5432/test"},
            'store = "postgresql://..." needs the postgres extra: '
            "pip install 'fallback_mw[postgres]'",
        ),
        (
            ["httpx", "httpcore"],
            {"engine": "httpx"},
            "engine = \"httpx\" needs the httpx extra: pip install 'fallback_mw[httpx]'",
        ),
    ],
)
def test_a_feature_without_its_extra_is_refused_at_load_in_one_line(
    blocked: list[str], gateway: dict[str, str], message: str
) -> None:
    result = run_blocked(
        blocked,
        f"""
        from fallback_mw import ConfigError, load_config
        try:
            load_config({{"gateway": {gateway!r}}})
        except ConfigError as exc:
            print(repr(str(exc)), exc.__cause__, exc.__suppress_context__ or exc.__context__)
        else:
            print("loaded")
        """,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{message!r} None None"
    assert "s3cret" not in result.stdout


@pytest.mark.parametrize(
    ("blocked", "module", "extra"),
    [
        (["redis"], "fallback_mw.health.redis", "redis"),
        (["asyncpg"], "fallback_mw.store.ledgers.postgres", "postgres"),
        (["asyncpg"], "fallback_mw.store.postgres", "postgres"),
        (["httpx"], "fallback_mw.upstream.httpx_engine", "httpx"),
    ],
)
def test_a_module_needing_a_missing_extra_says_which_on_import(
    blocked: list[str], module: str, extra: str
) -> None:
    # The backstop for code that reaches a backend without load_config (e.g. create_health).
    result = run_blocked(
        blocked,
        f"""
        from fallback_mw import ConfigError
        try:
            import {module}
        except ConfigError as exc:
            print(exc)
        """,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(
        f"needs the {extra} extra: pip install 'fallback_mw[{extra}]'"
    )


def test_the_same_features_load_when_their_extras_are_installed() -> None:
    # The negative control: nothing blocked, the same three configurations load.
    result = run_blocked(
        [],
        """
        from fallback_mw import load_config
        for gateway in ({"state": "redis://127.0.0.1:6379/0"},
                        {"store": "postgresql://postgres@127.0.0.1:5432/test"},
                        {"engine": "httpx"}):
            load_config({"gateway": gateway})
        print("loaded")
        """,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "loaded"
