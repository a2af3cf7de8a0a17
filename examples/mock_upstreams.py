"""Local mock LLM upstreams, so the examples and docs run offline.

* the **primary** answers 503 to everything (an outage: the gateway fails over);
* the **backup** is shaped like the real APIs: OpenAI `POST /v1/chat/completions` (JSON, or
  SSE chunks ending with `data: [DONE]`, with `usage` in the final chunk when the request
  asks for `stream_options.include_usage`), `GET /v1/models`, and Anthropic
  `POST /v1/messages` (JSON, or SSE `message_start` ... `message_stop` with `usage`).

Run alone: `python examples/mock_upstreams.py` prints the two URLs and serves until Ctrl-C.
Only aiohttp is needed (a base dependency of fallback_mw).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

REPLY = "Hello from the backup upstream."


@dataclass
class MockUpstream:
    url: str = ""
    requests: list[str] = field(default_factory=list)  # "METHOD /path", in arrival order
    credentials: list[str] = field(default_factory=list)  # the key each request carried
    idempotency_keys: list[str] = field(default_factory=list)  # "" when none was sent


@dataclass
class Mocks:
    primary: MockUpstream
    backup: MockUpstream


def _tokens(text: str) -> int:
    return max(1, len(text.split()))


def _prompt_tokens(body: dict[str, Any]) -> int:
    text = " ".join(
        part if isinstance(part, str) else json.dumps(part)
        for message in body.get("messages", [])
        for part in [message.get("content", "")]
    )
    return _tokens(text + " " + str(body.get("system", "")))


async def _json_body(request: web.Request) -> dict[str, Any] | None:
    """The body when it is a JSON object of the shape both real APIs take (`messages` a
    list of objects, `model` a string when given); None otherwise (their 400)."""
    try:
        body = json.loads(await request.read())
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    messages = body.get("messages", [])
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    if not isinstance(body.get("model", ""), str):
        return None
    return body


def _invalid_request() -> web.Response:
    # What both real APIs answer to a body that is not a JSON object of their shape.
    error = {
        "message": "the body must be a JSON object with `messages` a list of objects and "
        "`model` a string",
        "type": "invalid_request_error",
    }
    return web.json_response({"error": error}, status=400)


async def _sse(
    request: web.Request, events: list[tuple[str | None, dict[str, Any] | str]]
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
    )
    await response.prepare(request)
    for event, data in events:
        payload = data if isinstance(data, str) else json.dumps(data)
        head = f"event: {event}\n" if event else ""
        await response.write(f"{head}data: {payload}\n\n".encode())
        await asyncio.sleep(0)  # one write per event: the client sees a real stream
    await response.write_eof()
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _json_body(request)
    if body is None:
        return _invalid_request()
    model = body.get("model", "mock-model")
    prompt, completion = _prompt_tokens(body), _tokens(REPLY)
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    base = {"id": "chatcmpl-mock", "created": int(time.time()), "model": model}
    if not body.get("stream"):
        return web.json_response(
            {
                **base,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": REPLY},
                        "finish_reason": "stop",
                        "logprobs": None,
                    }
                ],
                "usage": usage,
            }
        )
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    chunk = {**base, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    deltas += [{"content": word} for word in REPLY.split(" ") for word in [word + " "]]
    events: list[tuple[str | None, dict[str, Any] | str]] = [
        (None, {**chunk, **extra, "choices": [{"index": 0, "delta": d, "finish_reason": None}]})
        for d in deltas
    ]
    events.append(
        (None, {**chunk, **extra, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    )
    if include_usage:
        events.append((None, {**chunk, "choices": [], "usage": usage}))
    events.append((None, "[DONE]"))
    return await _sse(request, events)


async def messages(request: web.Request) -> web.StreamResponse:
    body = await _json_body(request)
    if body is None:
        return _invalid_request()
    model = body.get("model", "mock-model")
    prompt, completion = _prompt_tokens(body), _tokens(REPLY)
    message = {
        "id": "msg_mock",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": REPLY}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": completion},
    }
    if not body.get("stream"):
        return web.json_response(message)
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "usage": {"input_tokens": prompt, "output_tokens": 1},
    }
    events: list[tuple[str | None, dict[str, Any] | str]] = [
        ("message_start", {"type": "message_start", "message": start}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        ("ping", {"type": "ping"}),
    ]
    events += [
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": word + " "},
            },
        )
        for word in REPLY.split(" ")
    ]
    events += [
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": completion},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return await _sse(request, events)


async def models(request: web.Request) -> web.StreamResponse:
    return web.json_response(
        {
            "object": "list",
            "data": [{"id": "mock-model", "object": "model", "created": 0, "owned_by": "mock"}],
        }
    )


def _recording(state: MockUpstream, app: web.Application) -> web.Application:
    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        state.requests.append(f"{request.method} {request.path}")
        headers = request.headers
        state.credentials.append(headers.get("x-api-key") or headers.get("authorization") or "")
        state.idempotency_keys.append(headers.get("idempotency-key", ""))
        response: web.StreamResponse = await handler(request)
        return response

    app.middlewares.append(record)
    return app


def primary_app(state: MockUpstream) -> web.Application:
    async def outage(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response(
            {"error": {"message": "overloaded", "type": "server_error"}}, status=503
        )

    app = _recording(state, web.Application())
    app.router.add_route("*", "/{tail:.*}", outage)
    return app


def backup_app(state: MockUpstream) -> web.Application:
    app = _recording(state, web.Application())
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_get("/v1/models", models)
    return app


@asynccontextmanager
async def start_mocks(host: str = "127.0.0.1") -> AsyncIterator[Mocks]:
    """Both mocks on free loopback ports for as long as the context is open."""
    mocks = Mocks(primary=MockUpstream(), backup=MockUpstream())
    runners = []
    try:
        for state, build in ((mocks.primary, primary_app), (mocks.backup, backup_app)):
            runner = web.AppRunner(build(state), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, host, 0)
            await site.start()
            runners.append(runner)
            port = runner.addresses[0][1]
            state.url = f"http://{host}:{port}"
        yield mocks
    finally:
        for runner in runners:
            await runner.cleanup()


def config_for_mocks(template: Path, mocks: Mocks, out: Path) -> Path:
    """The example's config with its two upstream URLs pointed at the running mocks."""
    text = template.read_text(encoding="utf-8")
    text = text.replace("http://127.0.0.1:9001", mocks.primary.url)
    text = text.replace("http://127.0.0.1:9002", mocks.backup.url)
    out.write_text(text, encoding="utf-8")
    return out


HOW_TO_CALL = """\
gateway: {url}   ({own} is the app's own route)
primary {primary} answers 503; backup {backup} is OpenAI-shaped
try:
  curl -s {url}{own}
  curl -si {url}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model": "gpt-4o-mini", "messages": [{{"role": "user", "content": "hi"}}]}}'
or the openai SDK with base_url="{url}/v1" (see the example's README.md)
Ctrl-C stops everything."""


async def run_example(app: str, app_dir: Path, listener: socket.socket, own_route: str) -> int:
    """The mocks, then the example's ASGI `app` ("module:attr" in `app_dir`) on uvicorn with
    its gateway.toml pointed at them (through GATEWAY_CONFIG); prints how to call it. Returns
    uvicorn's exit status (non-zero when the app failed to start; uvicorn said why)."""
    import uvicorn  # fallback_mw's "serve" extra

    sys.path.insert(0, str(app_dir))  # where uvicorn imports `app` from
    # The mocks ignore credentials; the gateway still refuses to start without them.
    os.environ.setdefault("PRIMARY_API_KEY", "mock-primary-key")
    os.environ.setdefault("BACKUP_API_KEY", "mock-backup-key")
    async with start_mocks() as mocks:
        with tempfile.TemporaryDirectory() as tmp:
            config = config_for_mocks(app_dir / "gateway.toml", mocks, Path(tmp) / "gateway.toml")
            os.environ["GATEWAY_CONFIG"] = str(config)
            server = uvicorn.Server(uvicorn.Config(app, access_log=False))
            serving = asyncio.create_task(_serve(server, listener))
            # uvicorn has no started event: poll its flag.
            while not server.started and not serving.done():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            if server.started:
                bound = listener.getsockname()[1]
                print(
                    HOW_TO_CALL.format(
                        url=f"http://127.0.0.1:{bound}",
                        own=own_route,
                        primary=mocks.primary.url,
                        backup=mocks.backup.url,
                    ),
                    flush=True,
                )
            return await serving


async def _serve(server: Any, listener: socket.socket) -> int:
    # uvicorn ends a failed start-up with sys.exit(3); raised out of a task, SystemExit
    # escapes the event loop as a traceback after uvicorn's own one-line reason.
    try:
        await server.serve(sockets=[listener])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def listen(port: int) -> socket.socket:
    """The example's socket on 127.0.0.1, bound before anything starts: a busy port is one
    line naming the way out, not uvicorn's traceback after the mocks are up."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("127.0.0.1", port))
    except (OSError, OverflowError) as exc:
        listener.close()
        raise SystemExit(
            f"cannot listen on 127.0.0.1:{port}: {getattr(exc, 'strerror', None) or exc}; "
            "pass --port N for another port, or --port 0 for a free one"
        ) from None
    return listener


def missing_packages(needs: dict[str, str]) -> str | None:
    """One line naming what to install when a module the example imports is not there
    (`needs`: module -> what pip installs it, `fallback_mw[extra]` or a package), instead of
    a traceback after the mocks started; None when everything is importable."""
    absent = [module for module in needs if importlib.util.find_spec(module) is None]
    if not absent:
        return None
    wanted = list(dict.fromkeys(needs[module] for module in absent))
    extras = [w.removeprefix("fallback_mw[").removesuffix("]") for w in wanted if "[" in w]
    install = " ".join(
        ([f"'fallback_mw[{','.join(extras)}]'"] if extras else [])
        + [w for w in wanted if "[" not in w]
    )
    return f"this example needs {', '.join(absent)}, not installed here: pip install {install}"


def example_main(app: str, app_dir: Path, own_route: str, needs: dict[str, str]) -> None:
    parser = argparse.ArgumentParser(
        description="The mock upstreams and this example app on uvicorn, offline."
    )
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    port = parser.parse_args().port
    missing = missing_packages({"uvicorn": "fallback_mw[serve]", **needs})
    if missing is not None:
        raise SystemExit(missing)
    status = 0
    with listen(port) as listener, suppress(KeyboardInterrupt):
        status = asyncio.run(run_example(app, app_dir, listener, own_route))
    sys.exit(status)


async def _serve_forever() -> None:
    async with start_mocks() as mocks:
        print(f"primary (answers 503): {mocks.primary.url}")
        print(f"backup (OpenAI / Anthropic shaped): {mocks.backup.url}", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    with suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever())
