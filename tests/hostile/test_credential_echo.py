"""An upstream that echoes the credential the gateway injected (a debug endpoint, an
echo service, a misconfigured proxy) must not hand it to the caller in a response field:
callers never hold provider keys (SPEC §1, §4)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import random
from collections.abc import Awaitable, Callable
from decimal import Decimal
from urllib.parse import quote, unquote

import httpx
import pytest
from aiohttp import web
from multidict import CIMultiDict
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fallback_mw import Gateway
from fallback_mw.credentials import EchoMask, _body_secrets
from fallback_mw.telemetry import Telemetry
from tests.helpers import client_for, gateway_client
from tests.hostile.test_hostile_upstreams import raw_upstream, read_head
from tests.upstreams import host_app, serve_asgi, status_handler, upstream

pytestmark = pytest.mark.anyio

ENGINES = ["aiohttp", "httpx"]
SECRET = "sk-provider-0123456789abcdef"
POOL = ("sk-pool-one-0123456789", "sk-pool-two-0123456789")


async def echo(request: web.Request) -> web.StreamResponse:
    given = request.headers.get("authorization") or request.headers.get("x-api-key", "")
    return web.Response(
        text="ok",
        headers={
            "authorization": given,
            "x-echo": f"you sent {given}",
            "www-authenticate": f'Bearer realm="api", token="{given}"',
            "x-request-id": "req-1",
        },
    )


@pytest.mark.parametrize("engine", ENGINES)
async def test_an_echoed_provider_credential_never_reaches_the_caller(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ECHO_KEY", SECRET)
    monkeypatch.setenv("POOL_ONE", POOL[0])
    monkeypatch.setenv("POOL_TWO", POOL[1])
    async with upstream(echo) as single, upstream(echo) as pooled:
        conf = {
            "gateway": {"engine": engine},
            "upstreams": {
                "single": {"url": single.url, "auth_env": "ECHO_KEY"},
                "pooled": {
                    "url": pooled.url,
                    "auth_header": "x-api-key",
                    "auth_scheme": "",
                    "auth_env": ["POOL_ONE", "POOL_TWO"],
                },
            },
            "routes": [
                {"id": "a", "prefix": "/a/", "plan": ["single"]},
                {"id": "b", "prefix": "/b/", "plan": ["pooled"]},
            ],
        }
        async with gateway_client(conf) as client:
            for path in ("/a/x", "/b/x", "/b/y"):
                response = await client.get(path, headers={"authorization": "Bearer caller"})
                assert response.status_code == 200
                assert response.text == "ok"
                fields = "\n".join(f"{k}: {v}" for k, v in response.headers.multi_items())
                for secret in (SECRET, *POOL):
                    assert secret not in fields, path
                assert response.headers["x-request-id"] == "req-1"  # the rest is relayed
    injected = ("authorization", f"Bearer {SECRET}")
    assert all(injected in r.headers for r in single.received)  # it was sent, and echoed


MIXED = "sk-Proj-AbCdEf0123456789"


async def echo_in_names(request: web.Request) -> web.StreamResponse:
    given = request.headers.get("authorization", "").removeprefix("Bearer ")
    return web.Response(
        text="ok",
        headers={f"x-debug-{given}": "1", "x-upper": given.upper(), "x-request-id": "req-1"},
    )


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_credential_echoed_in_a_field_name_or_another_case_never_reaches_the_caller(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The relay lowercases field names, so a key echoed as (part of) a name arrives in
    # lowercase: `x-debug-sk-proj-abcdef0123456789: 1` still hands the caller the key.
    monkeypatch.setenv("ECHO_KEY", MIXED)
    async with upstream(echo_in_names) as single:
        conf = {
            "gateway": {"engine": engine},
            "upstreams": {"single": {"url": single.url, "auth_env": "ECHO_KEY"}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        async with gateway_client(conf) as client:
            response = await client.get("/a/x")
    assert response.status_code == 200
    assert response.text == "ok"
    fields = "\n".join(f"{k}: {v}" for k, v in response.headers.multi_items()).lower()
    assert MIXED.lower() not in fields
    assert response.headers["x-request-id"] == "req-1"  # the rest is relayed


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_cookie_one_callers_upstream_set_never_goes_with_another_callers_request(
    engine: str,
) -> None:
    # The upstream's Set-Cookie is the caller's to keep (it is relayed); the gateway's own
    # client must not keep it and send it upstream with the next caller's request.
    cookies: list[str | None] = []

    async def sets_a_session(request: web.Request) -> web.StreamResponse:
        cookies.append(request.headers.get("cookie"))
        response = web.Response(text="ok")
        response.set_cookie("session", "caller-a-session")
        return response

    async with upstream(sets_a_session) as origin:
        conf = {
            "gateway": {"engine": engine},
            "upstreams": {"origin": {"url": origin.url}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["origin"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as caller_a, client_for(gateway) as caller_b:
                first = await caller_a.get("/a/login")
                assert "caller-a-session" in first.headers["set-cookie"]
                assert (await caller_b.get("/a/whoami")).status_code == 200
        finally:
            await gateway.aclose()
    assert cookies == [None, None]


LONG_KEY = "sk-" + "a1b2c3d4" * 30  # longer than the meter keeps of a model (MAX_NAME)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("key", [SECRET, LONG_KEY], ids=["key", "long-key-cut"])
async def test_a_credential_echoed_as_the_answering_model_is_never_recorded(
    engine: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The model an answer says answered goes to gen_ai.response.model, the usage record
    # and `fallback-mw usage`: an upstream putting its key there (upper-cased here) had
    # it written into the operator's telemetry and ledger.
    async def model_is_the_key(request: web.Request) -> web.StreamResponse:
        given = request.headers["authorization"].removeprefix("Bearer ")
        usage = {"prompt_tokens": 3, "completion_tokens": 4}
        return web.json_response({"model": given.upper(), "usage": usage})

    monkeypatch.setenv("ECHO_KEY", key)
    spans = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(spans))
    async with upstream(model_is_the_key) as single:
        conf = {
            "gateway": {"engine": engine},
            "upstreams": {"single": {"url": single.url, "auth_env": "ECHO_KEY"}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"], "budget": "b"}],
            "budgets": {"b": {"limit": "100", "default_hold": "0.5"}},
            "prices": {"m": {"input_per_mtok": "1", "output_per_mtok": "1"}},
        }
        gateway = Gateway(host_app, config=conf, telemetry=Telemetry(tracer_provider=provider))
        try:
            async with client_for(gateway) as client:
                response = await client.post("/a/chat", json={"model": "m", "max_tokens": 5})
            assert response.status_code == 200
            assert response.json()["usage"]["completion_tokens"] == 4  # relayed as it is
            ledger = gateway.services.ledger
            assert ledger is not None
            (record,) = await ledger.usage()
        finally:
            await gateway.aclose()
    provider.shutdown()
    (request_span,) = [s for s in spans.get_finished_spans() if s.name == "gateway.request"]
    assert "gen_ai.response.model" not in (request_span.attributes or {})
    assert request_span.attributes["gen_ai.usage.output_tokens"] == 4  # the meter read it
    assert record.model == "m"  # the requested model, which also priced it
    assert record.cost == Decimal("0.000007")
    recorded = request_span.to_json() + repr(record)
    assert key[:40].lower() not in recorded.lower()


async def echo_in_body(request: web.Request) -> web.StreamResponse:
    given = request.headers.get("authorization", "").removeprefix("Bearer ")
    if request.path.endswith("/stream"):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        event = b'data: {"echo": "%s"}\n\n' % given.encode()
        for start in range(0, len(event), 5):  # the key split over several chunks
            await response.write(event[start : start + 5])
            await asyncio.sleep(0.001)
        await response.write_eof()
        return response
    error = {"error": {"message": f"Incorrect API key provided: {given}", "type": "auth"}}
    return web.json_response(error, status=401)


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_credential_echoed_in_the_body_never_reaches_the_caller(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An upstream's error body quoting the key it was sent (a debug or echo service, a
    # provider's verbose 401), or a stream echoing it, handed the caller the provider key.
    # The key is masked with as many `*`, so every length and framing still holds.
    monkeypatch.setenv("ECHO_KEY", SECRET)
    masked = "*" * len(SECRET)
    async with upstream(echo_in_body) as single:
        conf = {
            "gateway": {"engine": engine, "allow_hosts": ["127.0.0.1"]},
            "upstreams": {"single": {"url": single.url, "auth_env": "ECHO_KEY"}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                error = await client.get("/a/chat", timeout=30)
                stream = await client.get("/a/stream", timeout=30)
        finally:
            await gateway.aclose()
    assert error.status_code == 401
    assert error.json()["error"]["message"] == f"Incorrect API key provided: {masked}"
    assert int(error.headers["content-length"]) == len(error.content)
    assert stream.status_code == 200
    assert stream.content == b'data: {"echo": "%s"}\n\n' % masked.encode()
    assert all(("authorization", f"Bearer {SECRET}") in r.headers for r in single.received)


async def echo_in_a_wide_body(request: web.Request) -> web.StreamResponse:
    """The echoed key in a JSON error written in the path's encoding (UTF-16 / UTF-32),
    sent a few bytes at a time (the key split over chunks, at odd offsets too)."""
    encoding = request.path.rsplit("/", 1)[-1]
    given = request.headers.get("authorization", "").removeprefix("Bearer ")
    error = {"error": {"message": f"Incorrect API key provided: {given}", "type": "auth"}}
    body = json.dumps(error).encode(encoding)
    response = web.StreamResponse(
        status=401, headers={"content-type": f"application/json; charset={encoding}"}
    )
    await response.prepare(request)
    for start in range(0, len(body), 7):
        await response.write(body[start : start + 7])
        await asyncio.sleep(0.001)
    await response.write_eof()
    return response


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32"])
async def test_a_credential_echoed_in_a_utf16_or_utf32_body_never_reaches_the_caller(
    engine: str, encoding: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The mask looked for the key's UTF-8 bytes only: a JSON error in UTF-16 or UTF-32
    # (`json.loads`, so httpx's and the SDKs' `.json()`, reads both) carried it to the
    # caller whole. It is masked as that text spells it, `*` for each character.
    monkeypatch.setenv("ECHO_KEY", SECRET)
    async with upstream(echo_in_a_wide_body) as single:
        conf = {
            "gateway": {"engine": engine, "allow_hosts": ["127.0.0.1"]},
            "upstreams": {"single": {"url": single.url, "auth_env": "ECHO_KEY"}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                error = await client.get(f"/a/{encoding}", timeout=30)
        finally:
            await gateway.aclose()
    assert error.status_code == 401
    masked = "*" * len(SECRET)
    assert error.json()["error"]["message"] == f"Incorrect API key provided: {masked}"
    for wide in ("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"):
        assert SECRET.encode(wide) not in error.content


async def echo_the_token(request: web.Request) -> web.StreamResponse:
    token = request.headers.get("authorization", "").rsplit(" ", 1)[-1]
    error = {"error": {"message": f"Incorrect API key provided: {token}"}, "model": token}
    return web.json_response(error, status=401, headers={"x-key": token})


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_token_quoted_from_a_whole_header_value_never_reaches_the_caller(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A variable holding a whole header value (`Bearer sk-...`, sent as it is under
    `auth_scheme = ""`) was looked for whole: an upstream quoting the token alone, as a
    provider's 401 does, handed the caller the key, in the body and in a field."""
    monkeypatch.setenv("ECHO_KEY", f"Bearer {SECRET}")
    async with upstream(echo_the_token) as single:
        conf = {
            "gateway": {"engine": engine, "allow_hosts": ["127.0.0.1"]},
            "upstreams": {"single": {"url": single.url, "auth_scheme": "", "auth_env": "ECHO_KEY"}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        async with gateway_client(conf) as client:
            response = await client.get("/a/chat")
    assert response.status_code == 401
    assert ("authorization", f"Bearer {SECRET}") in single.received[0].headers
    assert SECRET not in response.text
    assert response.json()["error"]["message"].endswith("*" * len(SECRET))
    assert "x-key" not in response.headers


def test_the_body_mask_catches_a_credential_split_anywhere_and_delays_nothing_else() -> None:
    secret = SECRET.encode()
    body = b'data: {"a": "%s", "b": "sk-pro", "c": "%s"}\n\n' % (secret, secret)
    masked = body.replace(secret, b"*" * len(secret))
    for first in range(len(body)):
        for second in range(first, len(body)):
            mask = EchoMask((secret,))
            pieces = (body[:first], body[first:second], body[second:])
            out = b"".join(mask.feed(piece) for piece in pieces) + mask.flush()
            assert out == masked, (first, second)
    # An end that cannot begin the key is relayed at once: an event's closing blank line.
    mask = EchoMask((secret,))
    assert mask.feed(b'data: {"n": 1}\n\n') == b'data: {"n": 1}\n\n'
    assert mask.feed(b"data: sk-") == b"data: "  # may be the key's beginning: held
    assert mask.feed(b"other\n\n") == b"sk-other\n\n"


class CountingKey(bytes):
    """A credential that counts the checks made of whether a chunk's end begins it."""

    checks = 0

    def startswith(self, prefix: object, *args: object) -> bool:  # type: ignore[override]
        CountingKey.checks += 1
        return super().startswith(prefix, *args)  # type: ignore[arg-type]


def test_the_body_mask_checks_a_bounded_number_of_places_a_chunk() -> None:
    # Whether a chunk's end begins the key was checked at every one of its last bytes equal
    # to the key's first: a body of `s` against a 168-character `sk-...` key cost 167
    # checks (and copies) a chunk, 50x an ordinary body's masking, times every key of a
    # pool. Each check now follows a search for the key's first 16 bytes, or is one of the
    # fewer than 16 places an end shorter than that begins.
    key = CountingKey(b"sk-proj-" + b"Qx7Lm2Zr" * 20)
    chunks = [b"s" * 256, b"sk-proj-" * 32, key[:100], key[100:] + b" " + key[:-1], b"."]
    for chunk in chunks:
        mask = EchoMask((key,))
        CountingKey.checks = 0
        for _ in range(4):
            mask.feed(chunk)
        assert CountingKey.checks <= 4 * 16, (chunk[:20], CountingKey.checks)
    # And what it masks and holds back is as before, the key split anywhere.
    body = b"s" * 300 + bytes(key) + b"ssk-proj-" * 40 + bytes(key)[:-1] + b"."
    masked = body.replace(bytes(key), b"*" * len(key))
    for cut in range(0, len(body), 7):
        mask = EchoMask((key,))
        out = mask.feed(body[:cut]) + mask.feed(body[cut:]) + mask.flush()
        assert out == masked, cut


def test_a_pool_key_that_begins_with_another_is_masked_whole() -> None:
    short, long = "sk-pool-0123456789", "sk-pool-0123456789-and-more"
    found = (("authorization", f"Bearer {short}"), ("authorization", f"Bearer {long}"))
    secrets = _body_secrets(found, "Bearer")
    assert EchoMask(secrets).feed(b"[%s]" % long.encode()) == b"[%s]" % (b"*" * len(long))


async def compressed_echo(request: web.Request) -> web.StreamResponse:
    given = request.headers.get("authorization", "").removeprefix("Bearer ")
    error = {"error": {"message": f"Incorrect API key provided: {given}", "type": "auth"}}
    response = web.json_response(error, status=401)
    response.enable_compression()  # honours the request's Accept-Encoding, as APIs do
    return response


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("coding", ["gzip", "deflate"])
async def test_a_credential_echoed_in_a_compressed_body_never_reaches_the_caller(
    engine: str, coding: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A caller asking for a compressed answer (every HTTP client library does by default)
    # got the echoing upstream's body coded, relayed as it came: the key in it unmasked.
    # From an upstream holding a credential, such a body is relayed decoded, and masked.
    monkeypatch.setenv("ECHO_KEY", SECRET)
    async with upstream(compressed_echo) as single:
        conf = {
            "gateway": {"engine": engine, "allow_hosts": ["127.0.0.1"]},
            "upstreams": {"single": {"url": single.url, "auth_env": "ECHO_KEY"}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.get("/a/x", headers={"accept-encoding": coding})
        finally:
            await gateway.aclose()
    assert ("accept-encoding", coding) in single.received[0].headers  # it did compress
    assert response.status_code == 401
    assert "content-encoding" not in response.headers
    masked = "*" * len(SECRET)
    assert response.json()["error"]["message"] == f"Incorrect API key provided: {masked}"
    assert SECRET not in response.text


CODED_BODY = gzip.compress(b'{"answer": "hello"}')


async def coded_with_validators(request: web.Request) -> web.StreamResponse:
    """A gzip answer with what describes its coded form: a strong ETag, the digests of the
    coded bytes (RFC 9530: Content-Digest and Repr-Digest both cover the coded form), and
    ranges over them."""
    etag = request.query.get("etag", '"v1-gzip"')
    return web.Response(
        body=CODED_BODY,
        headers={
            "content-encoding": "gzip",
            "content-type": "application/json",
            "etag": etag,
            "content-md5": "kjEMTqCQ9ayVGEyWVAbdGA==",
            "digest": "sha-256=X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=",
            "content-digest": "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:",
            "repr-digest": "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:",
            "accept-ranges": "bytes",
            "x-other": "kept",
        },
    )


DIGEST_FIELDS = ("content-md5", "digest", "content-digest", "repr-digest")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("etag", "relayed"),
    [('"v1-gzip"', 'W/"v1-gzip"'), ('W/"v1"', 'W/"v1"')],
    ids=["strong", "weak"],
)
async def test_a_body_relayed_decoded_drops_what_describes_its_coded_form(
    engine: str, etag: str, relayed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Relayed decoded for the mask, the body kept the coded body's strong ETag and its
    # digests: a client checking Content-Digest (RFC 9530) refused a sound answer, and a
    # cache revalidating with the strong ETag held the decoded bytes for the coded ones.
    # As nginx's gzip filter does: digests and Accept-Ranges dropped, the ETag weakened.
    monkeypatch.setenv("ECHO_KEY", SECRET)
    async with upstream(coded_with_validators) as single:
        conf = {
            "gateway": {"engine": engine, "allow_hosts": ["127.0.0.1"]},
            "upstreams": {"single": {"url": single.url, "auth_env": "ECHO_KEY"}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.get("/a/x", params={"etag": etag})
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    assert "content-encoding" not in response.headers
    assert response.json() == {"answer": "hello"}
    assert response.headers["etag"] == relayed
    for name in (*DIGEST_FIELDS, "accept-ranges"):
        assert name not in response.headers, name
    assert response.headers["x-other"] == "kept"


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_head_describes_the_body_a_get_is_relayed(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A GET of a gzip answer from an upstream the gateway sent its key to is relayed
    # decoded, yet the HEAD said `content-encoding: gzip` and the coded length: a client
    # sizing a download by HEAD, or a cache freshening its stored GET with it (RFC 9111
    # §4.3.5), read a body it never gets. The HEAD gets the fields the GET does.
    monkeypatch.setenv("ECHO_KEY", SECRET)
    async with upstream(coded_with_validators) as single:
        conf = {
            "gateway": {"engine": engine, "allow_hosts": ["127.0.0.1"]},
            "upstreams": {"single": {"url": single.url, "auth_env": "ECHO_KEY"}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                got = await client.get("/a/x", headers={"accept-encoding": "gzip"})
                head = await client.head("/a/x", headers={"accept-encoding": "gzip"})
        finally:
            await gateway.aclose()
    assert (got.status_code, head.status_code) == (200, 200)
    described = ("content-encoding", "content-length", "etag", *DIGEST_FIELDS, "accept-ranges")
    assert {n: head.headers.get(n) for n in described} == {n: got.headers.get(n) for n in described}
    assert head.headers["etag"] == 'W/"v1-gzip"' and "content-encoding" not in head.headers
    assert head.headers["x-other"] == "kept"


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_body_relayed_coded_keeps_its_etag_and_digests(engine: str) -> None:
    # No credential of the gateway's went with it: relayed as it came, coded, and what
    # describes the coded form still describes what the caller gets.
    async with upstream(coded_with_validators) as single:
        conf = {
            "gateway": {"engine": engine, "allow_hosts": ["127.0.0.1"]},
            "upstreams": {"single": {"url": single.url}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with (
                serve_asgi(gateway) as base,
                httpx.AsyncClient(base_url=base) as client,
                client.stream("GET", "/a/x") as got,
            ):
                received = b"".join([chunk async for chunk in got.aiter_raw()])
        finally:
            await gateway.aclose()
    assert got.headers["content-encoding"] == "gzip"
    assert received == CODED_BODY
    assert got.headers["etag"] == '"v1-gzip"'
    for name in (*DIGEST_FIELDS, "accept-ranges"):
        assert name in got.headers, name


async def bomb(request: web.Request) -> web.StreamResponse:
    coded = gzip.compress(b" " * (64 * 1024 * 1024))  # 64 MiB of spaces in ~64 KiB
    return web.Response(body=coded, headers={"content-encoding": "gzip"})


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_compressed_body_relayed_decoded_is_held_to_max_response_body(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ECHO_KEY", SECRET)
    async with upstream(bomb) as single:
        conf = {
            "gateway": {
                "engine": engine,
                "allow_hosts": ["127.0.0.1"],
                "max_response_body": 1024 * 1024,
            },
            "upstreams": {"single": {"url": single.url, "auth_env": "ECHO_KEY"}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with (
                serve_asgi(gateway) as base,
                httpx.AsyncClient(base_url=base) as client,
                client.stream("GET", "/a/x", timeout=30) as response,
            ):
                assert response.status_code == 200
                received = 0
                with pytest.raises(httpx.RemoteProtocolError):  # aborted, never complete
                    async for chunk in response.aiter_raw():
                        received += len(chunk)
        finally:
            await gateway.aclose()
    assert received <= 1024 * 1024


def twice_compressed_echo(fields: list[str]) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An app compressing its answer and a proxy in front compressing it again, each
    naming its coding: `Content-Encoding: gzip, gzip` (or two fields), as RFC 9110 §8.4
    lists codings in the order applied."""

    async def handler(request: web.Request) -> web.Response:
        given = request.headers.get("authorization", "").removeprefix("Bearer ")
        error = {"error": {"message": f"Incorrect API key provided: {given}", "type": "auth"}}
        body = gzip.compress(gzip.compress(json.dumps(error).encode()))
        headers = CIMultiDict([("content-type", "application/json")])
        for value in fields:
            headers.add("content-encoding", value)
        return web.Response(status=401, body=body, headers=headers)

    return handler


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fields", [["gzip, gzip"], ["gzip", "gzip"]], ids=["one-field", "two"])
async def test_a_credential_echoed_in_a_body_compressed_twice_never_reaches_the_caller(
    engine: str, fields: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two stacked codings were "not readable": the body was relayed as it came, the key in
    # it unmasked, and httpx (the SDKs' client) undoes both codings for the caller.
    monkeypatch.setenv("ECHO_KEY", SECRET)
    async with upstream(twice_compressed_echo(fields)) as single:
        conf = {
            "gateway": {"engine": engine, "allow_hosts": ["127.0.0.1"]},
            "upstreams": {"single": {"url": single.url, "auth_env": "ECHO_KEY"}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.get("/a/x")
        finally:
            await gateway.aclose()
    assert response.status_code == 401
    assert "content-encoding" not in response.headers  # relayed decoded
    masked = "*" * len(SECRET)
    assert response.json()["error"]["message"] == f"Incorrect API key provided: {masked}"
    assert SECRET not in response.text


async def twice_compressed_bomb(request: web.Request) -> web.StreamResponse:
    coded = gzip.compress(gzip.compress(b" " * (64 * 1024 * 1024)))
    return web.Response(body=coded, headers={"content-encoding": "gzip, gzip"})


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_body_compressed_twice_relayed_decoded_is_held_to_max_response_body(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ECHO_KEY", SECRET)
    async with upstream(twice_compressed_bomb) as single:
        conf = {
            "gateway": {
                "engine": engine,
                "allow_hosts": ["127.0.0.1"],
                "max_response_body": 1024 * 1024,
            },
            "upstreams": {"single": {"url": single.url, "auth_env": "ECHO_KEY"}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with (
                serve_asgi(gateway) as base,
                httpx.AsyncClient(base_url=base) as client,
                client.stream("GET", "/a/x", timeout=30) as response,
            ):
                assert response.status_code == 200
                assert "content-encoding" not in response.headers
                received = 0
                with pytest.raises(httpx.RemoteProtocolError):  # aborted, never complete
                    async for chunk in response.aiter_raw():
                        received += len(chunk)
        finally:
            await gateway.aclose()
    assert received <= 1024 * 1024


BASE64_KEY = "k3Y/a1b2+c3d4/e5f6+g7h8=="  # a base64 key: `/` and `+` in it


def escaping_echo(style: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An error quoting the key as JSON encoders write a string: PHP's json_encode writes
    `/` as `\\/`, .NET's System.Text.Json writes `+` as `\\u002B`, Go's `<>&` as `\\u003c`."""

    async def handler(request: web.Request) -> web.Response:
        given = request.headers.get("authorization", "").removeprefix("Bearer ")
        text = json.dumps({"error": {"message": f"Incorrect API key provided: {given}"}})
        if style == "php":
            text = text.replace("/", "\\/")
        elif style == "dotnet":
            text = text.replace("+", "\\u002B")
        else:
            text = text.replace("/", "\\/").replace("+", "\\u002b")
        return web.Response(status=401, text=text, content_type="application/json")

    return handler


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("style", ["php", "dotnet", "both"])
async def test_a_credential_echoed_with_json_escapes_never_reaches_the_caller(
    engine: str, style: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The key is masked as the body spells it; a JSON encoder escaping `/` or `+` spelled
    # it otherwise, and the caller's JSON reader undid the escapes: the key, unmasked.
    monkeypatch.setenv("ECHO_KEY", BASE64_KEY)
    async with upstream(escaping_echo(style)) as single:
        conf = {
            "gateway": {"engine": engine, "allow_hosts": ["127.0.0.1"]},
            "upstreams": {"single": {"url": single.url, "auth_env": "ECHO_KEY"}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.get("/a/x")
        finally:
            await gateway.aclose()
    assert response.status_code == 401
    message = response.json()["error"]["message"]
    assert message.startswith("Incorrect API key provided: ***")
    assert set(message.removeprefix("Incorrect API key provided: ")) == {"*"}
    assert int(response.headers["content-length"]) == len(response.content)


async def percent_encoded_echo(request: web.Request) -> web.Response:
    """The key quoted in a URL, as URL and form encoders write it: a `Location` to a help
    page naming the key it was sent, and the same link in the error body."""
    given = request.headers.get("authorization", "").removeprefix("Bearer ")
    link = f"https://help.example/keys?key={quote(given, safe='')}&path={quote(given)}"
    body = json.dumps({"error": {"message": "Incorrect API key provided", "help": link}})
    return web.Response(
        status=401,
        text=body,
        content_type="application/json",
        headers={"location": link, "x-request-id": "req-1"},
    )


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_credential_echoed_percent_encoded_never_reaches_the_caller(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A base64 key's `/`, `+` and `=` are `%2F`, `%2B`, `%3D` in a URL: the field and the
    # body carried the key in a spelling any reader decodes, unmasked.
    monkeypatch.setenv("ECHO_KEY", BASE64_KEY)
    async with upstream(percent_encoded_echo) as single:
        conf = {
            "gateway": {"engine": engine, "allow_hosts": ["127.0.0.1"]},
            "upstreams": {"single": {"url": single.url, "auth_env": "ECHO_KEY"}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.get("/a/x")
        finally:
            await gateway.aclose()
    assert response.status_code == 401
    assert "location" not in response.headers  # the field carrying it is dropped
    assert response.headers["x-request-id"] == "req-1"
    help_link = unquote(response.json()["error"]["help"])
    assert BASE64_KEY not in help_link
    assert help_link.startswith("https://help.example/keys?key=***")


async def echo_in_gzip_members(request: web.Request) -> web.Response:
    """A gzip body sent as several members (RFC 1952 §2.2; a server that compresses each
    flush on its own), the key echoed in the second."""
    given = request.headers.get("authorization", "").removeprefix("Bearer ")
    first = b'{"error": {"message": "Incorrect API key provided: '
    body = gzip.compress(first) + gzip.compress(given.encode() + b'"}}')
    return web.Response(
        status=401,
        body=body,
        headers={"content-encoding": "gzip", "content-type": "application/json"},
    )


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_gzip_body_in_several_members_is_relayed_whole_and_masked(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Relayed decoded for the mask, the body ended after its first member: the caller got
    # half a JSON document as a complete answer (urllib3 and browsers read every member).
    monkeypatch.setenv("ECHO_KEY", SECRET)
    async with upstream(echo_in_gzip_members) as single:
        conf = {
            "gateway": {"engine": engine, "allow_hosts": ["127.0.0.1"]},
            "upstreams": {"single": {"url": single.url, "auth_env": "ECHO_KEY"}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.get("/a/x")
        finally:
            await gateway.aclose()
    assert response.status_code == 401
    assert "content-encoding" not in response.headers
    masked = "*" * len(SECRET)
    assert response.json()["error"]["message"] == f"Incorrect API key provided: {masked}"


STORED = gzip.compress(random.Random(7).randbytes(8000))  # an object stored compressed


async def ranged_download(request: web.Request) -> web.Response:
    """A store serving a compressed object by range (S3, GCS and the like keep an object's
    `Content-Encoding` and serve ranges of its coded bytes)."""
    first, _, last = request.headers["range"].removeprefix("bytes=").partition("-")
    start, end = int(first), min(int(last), len(STORED) - 1)
    return web.Response(
        status=206,
        body=STORED[start : end + 1],
        headers={
            "content-encoding": "gzip",
            "content-type": "application/octet-stream",
            "content-range": f"bytes {start}-{end}/{len(STORED)}",
        },
    )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("span", ["0-999", "1000-1999"], ids=["first", "middle"])
async def test_a_range_of_a_compressed_object_is_relayed_as_it_came(engine: str, span: str) -> None:
    # Relayed decoded, a middle range did not decode (the response was aborted) and the
    # first range went out decoded under the coded Content-Range: a resumed download was
    # silently corrupt. A range counts coded bytes: as it came, from an upstream the
    # gateway sent no credential to (from one it did, the mask cannot read it: refused,
    # test_an_answer_the_mask_cannot_read_is_never_relayed_from_an_upstream_holding_a_key).
    async with upstream(ranged_download) as single:
        conf = {
            "gateway": {"engine": engine, "allow_hosts": ["127.0.0.1"]},
            "upstreams": {"single": {"url": single.url}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with (
                serve_asgi(gateway) as base,
                httpx.AsyncClient(base_url=base) as client,
                client.stream("GET", "/a/object", headers={"range": f"bytes={span}"}) as got,
            ):
                received = b"".join([chunk async for chunk in got.aiter_raw()])
        finally:
            await gateway.aclose()
    start, end = (int(n) for n in span.split("-"))
    assert got.status_code == 206
    assert got.headers["content-encoding"] == "gzip"
    assert got.headers["content-range"] == f"bytes {start}-{end}/{len(STORED)}"
    assert received == STORED[start : end + 1]


async def endless_empty_blocks(request: web.Request) -> web.StreamResponse:
    """A gzip stream of empty deflate blocks (five coded bytes each, none decoded), sent
    for as long as the gateway reads: an upstream response with no end and no content."""
    response = web.StreamResponse(headers={"content-encoding": "gzip"})
    await response.prepare(request)
    await response.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff")
    empty = b"\x00\x00\x00\xff\xff" * 4096
    with contextlib.suppress(ConnectionError):
        for _ in range(10_000):  # 200 MB coded, if nothing stops it
            await response.write(empty)
    return response


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_compressed_body_relayed_decoded_is_held_to_max_response_body_coded_too(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Relayed decoded, only the decoded bytes were counted: a coded stream that decodes
    # to nothing was read without bound (relayed coded, it stops at max_response_body).
    monkeypatch.setenv("ECHO_KEY", SECRET)
    async with upstream(endless_empty_blocks) as single:
        conf = {
            "gateway": {
                "engine": engine,
                "allow_hosts": ["127.0.0.1"],
                "max_response_body": 1024 * 1024,
            },
            "upstreams": {"single": {"url": single.url, "auth_env": "ECHO_KEY"}},
            "routes": [{"id": "a", "prefix": "/a/", "plan": ["single"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with (
                serve_asgi(gateway) as base,
                httpx.AsyncClient(base_url=base) as client,
                client.stream("GET", "/a/x", timeout=30) as response,
            ):
                assert response.status_code == 200
                with pytest.raises(httpx.RemoteProtocolError):  # aborted, never complete
                    async for _ in response.aiter_raw():
                        pass
        finally:
            await gateway.aclose()


async def account_ids(request: web.Request) -> web.StreamResponse:
    # What OpenAI (and Anthropic) answer beside every response, about the key's account.
    return web.Response(
        text="{}",
        headers={
            "OpenAI-Organization": "org-operator-0001",
            "OpenAI-Project": "proj_operator0001",
            "anthropic-organization-id": "0e0e0e0e-operator",
            "openai-processing-ms": "12",
            "x-ratelimit-limit-requests": "10000",
            "x-ratelimit-remaining-tokens": "149984",
            "x-request-id": "req-1",
        },
    )


@pytest.mark.parametrize("engine", ENGINES)
async def test_the_account_ids_behind_the_gateways_key_never_reach_the_caller(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # OpenAI answers every request with `openai-organization` / `openai-project`: relayed,
    # they told any caller which organization and project the operator's key belongs to
    # (the gateway strips the caller's own copies on the way in, docs/security.md). They
    # stay in the gateway when it injected its key on the attempt; an upstream it sent no
    # key to answers about whatever the caller's request reached, and is relayed as it is.
    # The rate-limit fields pass either way: SDKs and callers pace themselves by them.
    monkeypatch.setenv("ACCOUNT_KEY", SECRET)
    async with upstream(account_ids) as keyed, upstream(account_ids) as keyless:
        conf = {
            "gateway": {"engine": engine},
            "upstreams": {
                "keyed": {"url": keyed.url, "auth_env": "ACCOUNT_KEY"},
                "keyless": {"url": keyless.url},
            },
            "routes": [
                {"id": "a", "prefix": "/a/", "plan": ["keyed"]},
                {"id": "b", "prefix": "/b/", "plan": ["keyless"]},
            ],
        }
        async with gateway_client(conf) as client:
            injected = await client.get("/a/v1/models")
            bare = await client.get("/b/v1/models")
    assert injected.status_code == bare.status_code == 200
    kept = {
        "openai-processing-ms": "12",
        "x-ratelimit-limit-requests": "10000",
        "x-ratelimit-remaining-tokens": "149984",
        "x-request-id": "req-1",
    }
    for response in (injected, bare):
        for name, value in kept.items():
            assert response.headers.get_list(name) == [value], response.headers
    fields = "\n".join(f"{k}: {v}" for k, v in injected.headers.multi_items())
    for name in ("openai-organization", "openai-project", "anthropic-organization-id"):
        assert name not in injected.headers, fields
    assert "operator" not in fields, fields
    assert bare.headers["openai-organization"] == "org-operator-0001"
    assert bare.headers["openai-project"] == "proj_operator0001"


# Codings the body mask cannot read (the gateway narrows Accept-Encoding to gzip / deflate,
# so an honest upstream never answers in these), as (Content-Encoding, what the local
# error names). "KEY": the credential itself as the coding's name.
UNREADABLE = {
    "br": ("br", "`br`"),
    "zstd": ("zstd", "`zstd`"),
    "six-stacked": (", ".join(["gzip"] * 6), "6 codings"),
    "unknown": ("x-private", "an unregistered coding"),
    "key-as-coding": ("KEY", "an unregistered coding"),
    "gzip-then-br": ("gzip, br", "`br`"),
}


def unreadable_echo(
    coding: str, *, status: int = 200
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An upstream holding the gateway's key that answers with it in a body labelled with a
    coding the gateway cannot undo (what the body holds is for its caller to decode: a
    brotli stream may carry the key in an uncompressed block, byte for byte)."""

    async def handler(request: web.Request) -> web.Response:
        given = request.headers.get("authorization", "").removeprefix("Bearer ")
        return web.Response(
            status=status,
            body=f'{{"error": "you sent {given}"}}'.encode(),
            headers={
                "content-encoding": coding.replace("KEY", SECRET),
                "content-type": "application/json",
            },
        )

    return handler


def hostile_and_backup(
    hostile: str, backup: str, engine: str, **route: object
) -> dict[str, object]:
    return {
        "gateway": {"engine": engine, "allow_hosts": ["127.0.0.1"]},
        "upstreams": {
            "hostile": {"url": hostile, "auth_env": "ECHO_KEY"},
            "backup": {"url": backup},
        },
        "routes": [{"id": "a", "prefix": "/a/", "plan": ["hostile", "backup"], "retries": 1}],
    }


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(UNREADABLE))
async def test_an_answer_the_mask_cannot_read_is_never_relayed_from_an_upstream_holding_a_key(
    engine: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An upstream holding the gateway's key answered in `br` (or zstd, six stacked codings,
    # a coding of its own): relayed as it came, the key in it reached the caller unmasked.
    # The answer is the upstream's failure now (as one the relay cannot carry): the walk
    # fails over, the caller never sees a byte of it.
    monkeypatch.setenv("ECHO_KEY", SECRET)
    coding = UNREADABLE[name][0]
    async with (
        upstream(unreadable_echo(coding)) as hostile,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        gateway = Gateway(host_app, config=hostile_and_backup(hostile.url, backup.url, engine))
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.get("/a/x")
        finally:
            await gateway.aclose()
    assert len(hostile.received) == 1  # it was asked, and it answered with the key
    assert (response.status_code, response.text) == (200, "backup")
    assert response.headers["x-gateway-attempts"] == "2"
    assert "content-encoding" not in response.headers


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(UNREADABLE))
async def test_without_failover_an_answer_the_mask_cannot_read_is_the_local_502(
    engine: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A POST (not replayable): no failover, the local 502 upstream_failed naming the coding
    # (a registered name only: an upstream's own token may be anything, the key included),
    # never the body.
    monkeypatch.setenv("ECHO_KEY", SECRET)
    coding, named = UNREADABLE[name]
    async with (
        upstream(unreadable_echo(coding, status=401)) as hostile,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        conf = hostile_and_backup(hostile.url, backup.url, engine)
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.post("/a/x", content=b"{}")
        finally:
            await gateway.aclose()
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_failed"
    assert named in error["message"]
    assert "you sent" not in response.text
    assert SECRET not in response.text and SECRET.lower() not in response.text.lower()
    assert not backup.received


async def echo_range_of_gzip(request: web.Request) -> web.Response:
    """A 206 of a gzip-coded object carrying the key: a range the mask cannot read (one
    from the middle does not decode), sent unasked."""
    given = request.headers.get("authorization", "").removeprefix("Bearer ")
    coded = gzip.compress(f"you sent {given}".encode())
    return web.Response(
        status=206,
        body=coded,
        headers={
            "content-encoding": "gzip",
            "content-range": f"bytes 0-{len(coded) - 1}/{len(coded) + 100}",
        },
    )


async def echo_stream_in_br(request: web.Request) -> web.StreamResponse:
    """An SSE stream labelled `br`, echoing the key in its first event and going on."""
    given = request.headers.get("authorization", "").removeprefix("Bearer ")
    response = web.StreamResponse(
        headers={"content-type": "text/event-stream", "content-encoding": "br"}
    )
    await response.prepare(request)
    await response.write(f"data: you sent {given}\n\n".encode())
    with contextlib.suppress(ConnectionError):
        for _ in range(20):
            await asyncio.sleep(0.05)
            await response.write(b"data: more\n\n")
    return response


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("answer", ["range-of-gzip", "stream-in-br"])
async def test_a_range_or_a_stream_the_mask_cannot_read_is_never_relayed_with_its_key(
    engine: str, answer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 206 of a coded object was relayed as it came (a middle range does not decode), so
    # an upstream answering `206` with `Content-Encoding: gzip` unasked handed the caller
    # the key inside; an SSE stream in `br` went out event by event. Both are refused at
    # their head, before the commit point: the backup serves.
    monkeypatch.setenv("ECHO_KEY", SECRET)
    handler = echo_range_of_gzip if answer == "range-of-gzip" else echo_stream_in_br
    async with (
        upstream(handler) as hostile,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        gateway = Gateway(host_app, config=hostile_and_backup(hostile.url, backup.url, engine))
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.get("/a/x", headers={"range": "bytes=0-"})
        finally:
            await gateway.aclose()
    assert len(hostile.received) == 1
    assert (response.status_code, response.text) == (200, "backup")
    assert response.headers["x-gateway-attempts"] == "2"


async def gzip_object_with_ranges(request: web.Request) -> web.Response:
    """A stored gzip-coded object served as S3 or nginx's gzip_static serve one: whole,
    or the range the caller asked for (206, still `Content-Encoding: gzip`)."""
    coded = gzip.compress(b'{"object": "' + b"x" * 2000 + b'"}')
    asked = request.headers.get("range", "")
    if not asked.startswith("bytes="):
        return web.Response(body=coded, headers={"content-encoding": "gzip"})
    first, _, last = asked.removeprefix("bytes=").partition("-")
    start, end = int(first), int(last or len(coded) - 1)
    return web.Response(
        status=206,
        body=coded[start : end + 1],
        headers={
            "content-encoding": "gzip",
            "content-range": f"bytes {start}-{end}/{len(coded)}",
        },
    )


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_callers_range_of_a_coded_object_never_opens_the_upstreams_breaker(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A caller asking for ranges of an object the upstream stores gzip-coded gets 206s the
    # mask cannot read: refused, never relayed. Booked as the upstream's failure, a few
    # such requests from one caller opened its breaker, and every other caller's request
    # (whole answers the mask reads) went to the backup for the cooldown (SPEC §5: one
    # caller can never open a breaker for everyone else).
    monkeypatch.setenv("ECHO_KEY", SECRET)
    conf = hostile_and_backup("", "", engine)
    conf["gateway"]["breaker"] = {"window": 4, "min_calls": 2, "cooldown_ms": 60_000}  # type: ignore[index]
    async with (
        upstream(gzip_object_with_ranges) as stored,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        conf["upstreams"]["hostile"]["url"] = stored.url  # type: ignore[index]
        conf["upstreams"]["backup"]["url"] = backup.url  # type: ignore[index]
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                for _ in range(4):
                    ranged = await client.get("/a/x", headers={"range": "bytes=0-99"})
                    assert ranged.headers["x-gateway-attempts"] == "2"  # refused, never relayed
                    assert ranged.text == "backup"
                whole = await client.get("/a/x")
        finally:
            await gateway.aclose()
    assert "x-gateway-skipped" not in whole.headers
    assert whole.headers["x-gateway-provider"] == "hostile"
    assert whole.status_code == 200 and whole.json() == {"object": "x" * 2000}


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_coded_range_nobody_asked_for_is_the_upstreams_failure(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The other side of the test above: a 206 of a gzip-coded object sent to a caller that
    # asked for no range is the upstream's unusable answer (failover-class), booked to its
    # breaker like any. A hand-made mutant that excused every coded 206 as "the caller's
    # own range" passed every test: the upstream was never skipped.
    monkeypatch.setenv("ECHO_KEY", SECRET)
    conf = hostile_and_backup("", "", engine)
    conf["gateway"]["breaker"] = {"window": 2, "min_calls": 2, "cooldown_ms": 60_000}  # type: ignore[index]
    async with (
        upstream(echo_range_of_gzip) as hostile,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        conf["upstreams"]["hostile"]["url"] = hostile.url  # type: ignore[index]
        conf["upstreams"]["backup"]["url"] = backup.url  # type: ignore[index]
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                for _ in range(2):
                    unasked = await client.get("/a/x")
                    assert (unasked.text, unasked.headers["x-gateway-attempts"]) == ("backup", "2")
                after = await client.get("/a/x")
        finally:
            await gateway.aclose()
    assert len(hostile.received) == 2
    assert after.headers["x-gateway-skipped"] == "hostile;reason=breaker_open"
    assert (after.text, after.headers["x-gateway-attempts"]) == ("backup", "1")


@pytest.mark.parametrize("engine", ENGINES)
async def test_the_connection_of_an_answer_the_mask_cannot_read_is_closed(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The refused answer's body is never read: its connection is closed at once (never
    # kept for the next request, never left open until the upstream gives up).
    monkeypatch.setenv("ECHO_KEY", SECRET)
    closed = asyncio.Event()

    async def behaviour(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        body = f"you sent {SECRET}".encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-encoding: br\r\ncontent-length: 100000\r\n\r\n" + body
        )
        await writer.drain()
        while await reader.read(1024):
            pass
        closed.set()

    async with (
        raw_upstream(behaviour) as (url, accepted),
        upstream(status_handler(200, b"backup")) as backup,
    ):
        gateway = Gateway(host_app, config=hostile_and_backup(url, backup.url, engine))
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.get("/a/x")
                await asyncio.wait_for(closed.wait(), 5)
        finally:
            await gateway.aclose()
    assert (response.status_code, response.text) == (200, "backup")
    assert len(accepted) == 1


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", ["br", "six-stacked", "unknown"])
async def test_an_answer_the_mask_cannot_read_is_relayed_as_it_came_without_a_key(
    engine: str, name: str
) -> None:
    # No credential of the gateway's went to the upstream: nothing to mask, and the coded
    # body is relayed as it came (a caller that asked the upstream for it may read it).
    coding = UNREADABLE[name][0]
    async with (
        upstream(unreadable_echo(coding)) as hostile,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        conf = hostile_and_backup(hostile.url, backup.url, engine)
        conf["upstreams"]["hostile"].pop("auth_env")  # type: ignore[index]
        gateway = Gateway(host_app, config=conf)
        try:
            async with (
                serve_asgi(gateway) as base,
                httpx.AsyncClient(base_url=base) as client,
                client.stream("GET", "/a/x") as got,
            ):
                received = b"".join([chunk async for chunk in got.aiter_raw()])
        finally:
            await gateway.aclose()
    assert got.status_code == 200
    assert got.headers["content-encoding"] == coding
    assert received == b'{"error": "you sent "}'
    assert not backup.received
