"""The edges of what a request's records take for a credential (request/secrets.py, SPEC §9),
each met through a request: a credential of exactly MIN_SECRET characters, a piece of one
of exactly MIN_PIECE, a caller's key in the query however a server reads its name or
value, and one that begins inside the recorded part of a value and runs past it. Hand-made
mutants that moved each edge by one, or dropped a spelling, passed every test before."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fallback_mw import Gateway
from tests import test_telemetry_secrets as ordinary
from tests.helpers import http_scope
from tests.test_telemetry_leak import call
from tests.test_telemetry_secrets import CALLER_TOKEN, Recorded, carried
from tests.upstreams import host_app, upstream

# The gateway and what it records, as the module of the ordinary values sets them up.
everything_logged = ordinary.everything_logged
recorded = ordinary.recorded

pytestmark = pytest.mark.anyio


async def tenant_recorded(
    recorded: Recorded, headers: list[tuple[bytes, bytes]], query: bytes = b""
) -> str:
    status, _, _ = await recorded.request("GET", headers, query=query)
    assert status == 200
    span_tenant = recorded.request_span().attributes["gateway.tenant"]
    (record,) = await recorded.gateway.services.ledger.usage(route="chat")  # type: ignore[union-attr]
    assert record.tenant == span_tenant
    return str(span_tenant)


@pytest.mark.parametrize(("token", "redacted"), [("Zq8wL2pX", True), ("Zq8wL2p", False)])
async def test_a_credential_of_exactly_min_secret_characters_is_known_one_shorter_is_not(
    recorded: Recorded, token: str, redacted: bool
) -> None:
    """MIN_SECRET (8): a caller token of 8 characters sent again as the tenant id is
    recorded redacted; one of 7 would match ordinary text and is not searched for."""
    headers = [(b"authorization", f"Bearer {token}".encode()), (b"x-tenant-id", token.encode())]
    tenant = await tenant_recorded(recorded, headers)
    assert tenant == ("[REDACTED]" if redacted else token)


@pytest.mark.parametrize(("length", "redacted"), [(32, True), (31, False)])
async def test_a_piece_of_exactly_min_piece_characters_is_known_one_shorter_is_not(
    recorded: Recorded, length: int, redacted: bool
) -> None:
    """MIN_PIECE (32): a tenant id that is a 32-character piece from inside a longer key
    (not its beginning) is that key, recorded redacted; a 31-character piece is an
    ordinary word."""
    key = "sk-proj-" + "".join(f"{n:02d}Qz" for n in range(20))  # 88 characters
    piece = key[20 : 20 + length]
    headers = [(b"x-api-key", key.encode()), (b"x-tenant-id", piece.encode())]
    tenant = await tenant_recorded(recorded, headers)
    assert tenant == ("[REDACTED]" if redacted else piece)


@pytest.mark.parametrize(
    "query",
    [
        f"Api.Key={CALLER_TOKEN}",  # the name as PHP reads it (api_key)
        f"page=2;api_key={CALLER_TOKEN}",  # `;` separates parameters too
        "api_key=" + CALLER_TOKEN.replace("-", "%2D"),  # the value as a server reads it
    ],
)
async def test_a_callers_key_in_the_query_in_any_spelling_is_known_as_a_credential(
    recorded: Recorded, query: str
) -> None:
    """The query keys the gateway strips are read as the servers that read them loosely
    do (`canonical_query_key`, `;`, percent-decoding): a key sent so, and again as the
    tenant id, is the caller's credential."""
    headers = [(b"x-tenant-id", CALLER_TOKEN.encode())]
    assert await tenant_recorded(recorded, headers, query.encode()) == "[REDACTED]"
    (received,) = recorded.upstream.received
    assert CALLER_TOKEN.lower() not in received.query.lower().replace("%2d", "-")


async def test_a_credential_that_begins_in_the_recorded_part_and_runs_past_it_is_known(
    recorded: Recorded,
) -> None:
    """A value is searched in its first MAX_RECORDED (256) characters, and a credential that
    begins there is followed past them: a header name whose 400 would quote those 256
    characters quotes none of a key that begins at its 251st (the error names 'a request
    header' instead)."""
    name = b"x-" + b"n" * 248 + CALLER_TOKEN.lower().encode()  # the key begins at 250
    headers = [(b"authorization", f"Bearer {CALLER_TOKEN}".encode()), (name, b"\xff\xfe")]
    status, body, text = await recorded.request("GET", headers)
    assert status == 400 and carried(text + body.decode()) == []
    message = json.loads(body)["error"]["message"]
    assert "'a request header' has bytes >= 0x80" in message, message
    assert CALLER_TOKEN.lower()[:6] not in message


async def echo_the_model(request: Any) -> Any:
    from aiohttp import web

    asked = json.loads(await request.read()).get("model")
    payload = {"model": asked, "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    return web.json_response(payload)


async def test_a_callers_credential_an_upstream_echoes_as_the_model_is_not_recorded() -> None:
    """Upstreams that answer with the model they were asked for (vLLM, Ollama, echo
    services) hand back a caller's token sent as the model: the usage record keeps
    neither the answer's model nor the asked one when it is a credential of the request
    (a hand-made mutant that recorded the answer's model as it came passed every test:
    the tests' upstream always named its own)."""
    async with upstream(echo_the_model) as answering:
        config = {
            "upstreams": {"primary": {"url": answering.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=config)
        try:
            body = json.dumps({"model": CALLER_TOKEN, "messages": []}).encode()
            headers = [
                (b"authorization", f"Bearer {CALLER_TOKEN}".encode()),
                (b"content-type", b"application/json"),
            ]
            status, out = await call(
                gateway, http_scope("POST", "/v1/chat/completions", b"", headers), body
            )
            records = await gateway.services.ledger.usage(route="chat")  # type: ignore[union-attr]
        finally:
            await gateway.aclose()
    assert status == 200 and CALLER_TOKEN in out.decode()  # the caller's own answer
    (record,) = records
    assert carried(repr(record)) == []
    assert record.model is None
