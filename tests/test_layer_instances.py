"""Nothing per-request on a shared instance (STYLE.md; OpenTelemetry's ASGI bug, where one
request reported another's size because the middleware kept it on itself): after many
concurrent requests of every outcome kind, the Gateway's and each of its four layers'
attributes are the same objects holding the same values as before them. And the
configuration is computed once, when the layers are built: serving those requests parses
or validates none of it. The requests run interleaved through the real Gateway (a raw ASGI
harness, so a caller can leave mid-stream) against real aiohttp upstreams on 127.0.0.1."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import pydantic
import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.request.types import Message
from tests.helpers import http_scope
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

ENV = {"PRIMARY_KEY": "sk-primary-0001", "BACKUP_KEY": "sk-backup-0002"}
ROUNDS = 12


async def primary(request: web.Request) -> web.StreamResponse:
    path = request.path
    if path.endswith("/fail"):
        return web.Response(status=503, text="busy")
    if path.endswith("/bad"):
        return web.Response(status=400, text="no")
    if path.endswith("/moved"):
        return web.Response(status=302, headers={"location": "/v1/ok"})
    if path.endswith("/slow"):
        await asyncio.sleep(5)  # past first_byte_timeout_ms: the walk moves on
    if path.endswith("/stream"):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(50):
            await response.write(b'data: {"x": 1}\n\n')
            await asyncio.sleep(0.02)
        return response
    return web.json_response({"usage": {"prompt_tokens": 3, "completion_tokens": 4}})


def config(primary_url: str, backup_url: str) -> dict[str, Any]:
    route = {"plan": ["primary", "backup"], "retries": 1, "backoff_ms": 0}
    return {
        "gateway": {
            "max_request_body": 1024,
            "replay_buffer": 1024,
            "max_concurrency": 1000,
            # Outcomes the same for every round: no breaker opens under the 503s.
            "breaker": {"window": 10_000, "min_calls": 10_000},
        },
        "upstreams": {
            "primary": {
                "url": primary_url,
                "auth_env": "PRIMARY_KEY",
                "first_byte_timeout_ms": 200,
            },
            "backup": {"url": backup_url, "auth_env": "BACKUP_KEY"},
        },
        "routes": [
            {"id": "chat", "prefix": "/v1/", **route},
            {"id": "paid", "prefix": "/paid/", "budget": "tiny", **route},
        ],
        "budgets": {"tiny": {"limit": 0.000001, "window": "total", "default_hold": 0.01}},
    }


async def call(
    gateway: Gateway,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    caller: int,
    leave_after_first_chunk: bool = False,
) -> int:
    """One request through the gateway's ASGI interface, its tenant, session and query
    its caller's own; its status (0: none sent)."""
    status = 0
    gone = asyncio.Event()
    asked = False

    async def receive() -> Message:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif leave_after_first_chunk and message.get("body"):
            gone.set()
            raise OSError("the client left")  # ASGI HTTP 2.4: the server's word for it

    own = str(caller).encode()
    headers = [(b"x-tenant-id", b"t-" + own), (b"x-session-id", b"s-" + own)]
    await gateway(http_scope(method, path, b"q=" + own, headers), receive, send)
    return status


# (method, path, body, leave after the first chunk) -> the status the caller sees
KINDS: dict[tuple[str, str, bytes, bool], int] = {
    ("GET", "/v1/ok", b"", False): 200,  # served by the primary
    ("GET", "/v1/fail", b"", False): 200,  # 503, failed over to the backup
    ("GET", "/v1/slow", b"", False): 200,  # first-byte timeout, failed over
    ("GET", "/v1/bad", b"", False): 400,  # served as-is
    ("GET", "/v1/moved", b"", False): 302,  # relayed, never followed
    ("POST", "/v1/fail", b"{}", False): 502,  # not replayable: the local error
    ("POST", "/v1/ok", b"x" * 2048, False): 413,  # over max_request_body
    ("TRACE", "/v1/ok", b"", False): 405,  # a method the route does not take
    ("GET", "/paid/ok", b"", False): 402,  # the budget guard's refusal
    ("GET", "/elsewhere", b"", False): 404,  # the host app
    ("GET", "/v1/stream", b"", True): 200,  # the caller leaves mid-stream
}


LAYERS = ("Gateway", "RouteResolver", "BudgetGuard", "CredentialInjector", "PlanWalker")


def layers(gateway: Gateway) -> dict[str, object]:
    resolver = gateway.resolver
    guard = resolver.app
    injector = guard.app  # type: ignore[attr-defined]
    walker = injector.app
    found = {"Gateway": gateway, "RouteResolver": resolver, "BudgetGuard": guard}
    found |= {"CredentialInjector": injector, "PlanWalker": walker}
    assert [type(layer).__name__ for layer in found.values()] == list(LAYERS), found
    return found


def held(value: object) -> object:
    """What an attribute holds, to compare: a builtin container's items, the attributes
    of the layers' own small helpers (the concurrency count); else nothing beyond the
    object's identity (the next layer is compared on its own)."""
    if isinstance(value, dict | list | set | bytearray):
        return value.copy()
    module = type(value).__module__
    if module.startswith("fallback_mw.layers") and type(value).__name__ not in LAYERS:
        return attributes(value)
    return None


def attributes(layer: object) -> dict[str, tuple[int, object]]:
    names = set(getattr(layer, "__dict__", {}))
    for cls in type(layer).__mro__:
        names.update(name for name in getattr(cls, "__slots__", ()) if hasattr(layer, name))
    return {name: (id(value), held(value)) for name in names for value in [getattr(layer, name)]}


async def test_no_layer_keeps_anything_of_a_request_on_itself() -> None:
    async with upstream(primary) as p, upstream(status_handler(200, b"backup")) as b:
        gateway = Gateway(host_app, config=config(p.url, b.url), environ=ENV)
        try:
            # One of each first: what a layer builds once, lazily (the resolver's facts
            # of the route table it serves), is built before the count starts.
            for caller, (kind, status) in enumerate(KINDS.items()):
                method, path, body, leave = kind
                got = await call(
                    gateway, method, path, body, caller=caller, leave_after_first_chunk=leave
                )
                assert got == status, kind
            before = {name: attributes(layer) for name, layer in layers(gateway).items()}
            kinds = list(KINDS.items()) * ROUNDS
            statuses = await asyncio.gather(
                *(
                    call(gateway, method, path, body, caller=caller, leave_after_first_chunk=leave)
                    for caller, ((method, path, body, leave), _) in enumerate(kinds, len(KINDS))
                )
            )
            assert statuses == [status for _, status in kinds]
            after = {name: attributes(layer) for name, layer in layers(gateway).items()}
        finally:
            await gateway.aclose()
    for name in before:
        assert after[name] == before[name], name


PYDANTIC = str(Path(pydantic.__file__).parent)
CONFIG = str(Path(__file__).resolve().parent.parent / "src" / "fallback_mw" / "config")
# What a local error's message quotes of the configuration: text, no parsing.
CONFIG_TEXT = {"budget_section", "command_option"}


async def test_no_configuration_is_parsed_or_validated_while_serving() -> None:
    ran: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith(PYDANTIC):
            ran[f"pydantic: {code.co_name}"] += 1
        elif code.co_filename.startswith(CONFIG) and code.co_name not in CONFIG_TEXT:
            ran[f"{Path(code.co_filename).name}: {code.co_name}"] += 1

    async with upstream(primary) as p, upstream(status_handler(200, b"backup")) as b:
        gateway = Gateway(host_app, config=config(p.url, b.url), environ=ENV)
        try:
            for caller, (kind, status) in enumerate(list(KINDS.items()) * 2):
                method, path, body, leave = kind
                if caller >= len(KINDS):  # after one of each: built what a layer builds lazily
                    sys.setprofile(profile)
                try:
                    got = await call(
                        gateway, method, path, body, caller=caller, leave_after_first_chunk=leave
                    )
                finally:
                    sys.setprofile(None)
                assert got == status, kind
        finally:
            await gateway.aclose()
    assert ran == {}
