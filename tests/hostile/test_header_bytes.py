"""Caller header values: one rule for both engines (SPEC §12, RFC 9110 §5.5). A value the
rule refuses (a control character but HTAB, bytes >= 0x80 that are not UTF-8) gets the local
400 `bad_request` before any upstream, with no breaker mark; every other field value reaches
the upstream byte for byte, on both engines (leading and trailing SP/HTAB are not part of a
field value and are trimmed, as every HTTP parser does). What an engine refuses
anyway (a URL it cannot build) is local too: never the upstream's failure, never a bare 500."""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fallback_mw import Gateway
from fallback_mw.health.memory import MemoryHealth
from fallback_mw.security.fields import canonical_name, name_forms
from fallback_mw.security.values import only, query_problem, request_header_problem
from fallback_mw.upstream import Timeouts, UpstreamError, UpstreamRequest, make_client
from tests.helpers import http_scope
from tests.upstreams import Upstream, host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

ENGINES = ["aiohttp", "httpx"]


def config(url: str, engine: str) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine},
        "upstreams": {"primary": {"url": url}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }


async def call(gateway: Gateway, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    """One GET straight through the ASGI interface (no server in front to tidy headers)."""
    sent: list[MutableMapping[str, Any]] = []

    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if delivered:  # the caller stays connected until the gateway is done
            await asyncio.Event().wait()
        delivered = True
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await gateway(http_scope("GET", "/v1/x", headers=headers), receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body


def breaker_marks(gateway: Gateway, name: str) -> list[int]:
    health = gateway.services.health
    assert isinstance(health, MemoryHealth)
    return list(health.breaker(name).outcomes)


REFUSED = {
    "escape": b"a\x1bb",
    "bell": b"a\x07b",
    "delete": b"a\x7fb",
    "lone-latin-1": b"caf\xe9",
}
FORWARDED: dict[str, bytes | tuple[bytes, bytes]] = {
    "inner-tab": b"a\tb",
    # Leading and trailing SP/HTAB are not part of the field value (RFC 9110 §5.5).
    "trailing-tab": (b"value\t", b"value"),
    "leading-space": (b" value", b"value"),
    "utf-8": "café ☕".encode(),
    "visible": b"!#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(REFUSED))
async def test_a_value_the_rule_refuses_is_400_before_any_upstream(name: str, engine: str) -> None:
    async with upstream(status_handler(200, b"ok")) as primary:
        gateway = Gateway(host_app, config=config(primary.url, engine))
        try:
            for _ in range(8):  # more than min_calls: a breaker would have opened
                status, body = await call(gateway, [(b"x-note", REFUSED[name])])
                assert status == 400, body
                error = json.loads(body)["error"]
                assert error["code"] == "bad_request"
                assert "x-note" in error["message"]
            marks = breaker_marks(gateway, "primary")
        finally:
            await gateway.aclose()
    assert primary.count == 0
    assert marks == []


def received_header(server: Upstream, name: str) -> bytes:
    values = [v for k, v in server.received[-1].headers if k == name]
    assert len(values) == 1
    return values[0].encode("utf-8", "surrogateescape")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(FORWARDED))
async def test_every_other_value_reaches_the_upstream_byte_for_byte(name: str, engine: str) -> None:
    async with upstream(status_handler(200, b"ok")) as primary:
        gateway = Gateway(host_app, config=config(primary.url, engine))
        try:
            given = FORWARDED[name]
            sent, expected = given if isinstance(given, tuple) else (given, given)
            status, _ = await call(gateway, [(b"x-note", sent)])
            marks = breaker_marks(gateway, "primary")
        finally:
            await gateway.aclose()
    assert status == 200
    assert received_header(primary, "x-note") == expected
    assert 1 not in marks


@pytest.mark.parametrize("engine", ENGINES)
async def test_what_an_engine_refuses_is_local_never_a_bare_500(engine: str) -> None:
    client = make_client(engine, allow_hosts=("127.0.0.1",))
    timeouts = Timeouts(connect=1.0, first_byte=1.0, idle=1.0)
    try:
        for url, headers in (
            ("http://127.0.0.1:1/x", [("x-note", "a\r\nx-injected: 1")]),
            ("http://127.0.0.1:1/x", [("bad name", "v")]),
            ("http://[::1/x", []),
        ):
            with pytest.raises(UpstreamError) as caught:
                await client.send(UpstreamRequest("GET", url, headers, b"", timeouts))
            assert caught.value.kind == "local", (url, caught.value)
    finally:
        await client.aclose()


# The rule written out byte by byte (RFC 9110 §5.1 tchar, §5.5 field values; RFC 9112 §3.2
# for the query): the fast checks in security/values.py must agree with it for any bytes.
_TCHAR_BYTES = frozenset(
    b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
)


def _header_refused_by_the_rule(name: bytes, value: bytes) -> bool:
    if not name or any(byte not in _TCHAR_BYTES for byte in name):
        return True
    if any((byte < 0x20 and byte != 0x09) or byte == 0x7F for byte in value):
        return True
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


_ALPHABET = st.sampled_from(
    [0x00, 0x09, 0x0A, 0x1F, 0x20, 0x23, 0x2D, 0x41, 0x5F, 0x61, 0x7E, 0x7F, 0x80, 0xC3, 0xA9, 0xFF]
)
_BYTES = st.one_of(st.binary(max_size=40), st.lists(_ALPHABET, max_size=40).map(bytes))


@settings(max_examples=600, deadline=None)
@given(_BYTES, _BYTES)
@example(b"content-type", b"application/json")
@example(b"x_api_key", b"a\tb")
@example(b"", b"")
@example(b"x-caf\xc3\xa9", b"ok")
@example(b"accept", b"caf\xc3\xa9 \x7f")
def test_the_header_check_is_the_rule_for_any_bytes(name: bytes, value: bytes) -> None:
    problem = request_header_problem(name, value)
    assert (problem is not None) == _header_refused_by_the_rule(name, value), (name, value)


@settings(max_examples=300, deadline=None)
@given(st.frozensets(st.integers(min_value=0, max_value=255)), _BYTES)
def test_a_table_keeping_some_bytes_leaves_exactly_the_bytes_of_only_those(
    allowed: frozenset[int], data: bytes
) -> None:
    # The header checks' one C loop (`only`): a table that keeps the allowed bytes leaves
    # data as it is exactly when it holds no other byte.
    assert (data.translate(only(allowed)) == data) == all(byte in allowed for byte in data)


def test_the_name_caches_answer_as_the_rule_and_stay_bounded() -> None:
    # The header check keeps the names it found to be tokens, and `name_forms` each name's
    # forms: a caller's made-up names must neither grow them past 1,024 names nor change an
    # answer, and a name over 64 bytes is kept by neither.
    from fallback_mw.security import fields, values

    room = len(values._TOKEN_NAMES) < 1_024  # other tests' names may be there first
    for index in range(1_500):
        name = b"x-made-up-%d" % index
        assert request_header_problem(name, b"v") is None
        assert request_header_problem(name, b"v") is None  # the second time, remembered
        assert name_forms(name) == (name, name)
        bad = b"x made up %d" % index  # a space: no token, never remembered as one
        assert request_header_problem(bad, b"v") == "has a name that is not an HTTP token"
        assert request_header_problem(bad, b"v") == "has a name that is not an HTTP token"
    long = b"x-" + b"n" * 63
    assert request_header_problem(long, b"v") is None
    name_forms(long)
    assert len(values._TOKEN_NAMES) <= 1_024
    assert len(fields._NAME_FORMS) <= 1_024
    assert long not in values._TOKEN_NAMES
    assert long not in fields._NAME_FORMS
    assert not any(b" " in name for name in values._TOKEN_NAMES)
    assert (b"x-made-up-0" in values._TOKEN_NAMES) == room  # kept while there was room


@settings(max_examples=600, deadline=None)
@given(_BYTES)
@example(b"a=1&b=2")
@example(b"a=1#frag")
@example(b"a= 1")
@example(b"q=caf\xc3\xa9")
@example(b"a=\x7f")
def test_the_query_check_is_the_rule_for_any_bytes(query: bytes) -> None:
    refused = any(byte <= 0x20 or byte in (0x7F, 0x23) for byte in query)
    assert (query_problem(query) is not None) == refused, query


async def test_a_callers_long_field_names_and_accept_encoding_are_not_kept() -> None:
    # The field-name check and the Accept-Encoding narrowing keep their answers in small
    # caches (256 and 64 entries), which a caller's own names and values reached: each
    # distinct long one was kept for good, 256 times the largest head the gateway takes
    # (16 MB at the default max_header_bytes, 4 GB at its largest). A long one is now
    # computed each time and kept nowhere.
    import gc
    import tracemalloc

    async with upstream(status_handler(200)) as primary:
        gateway = Gateway(host_app, config=config(primary.url, "aiohttp"))
        try:
            await call(gateway, [])
            gc.collect()
            tracemalloc.start()
            try:
                for index in range(300):
                    name = b"x-%d-" % index + b"n" * 7000
                    coding = b"gzip, " + b"br, " * 1500 + b"%d" % index
                    await call(gateway, [(name, b"v"), (b"accept-encoding", coding)])
                gc.collect()
                # What the gateway's own code made and still holds (not the test upstream's
                # record of what it received).
                ours = tracemalloc.Filter(True, "*/fallback_mw/*")
                snapshot = tracemalloc.take_snapshot().filter_traces([ours])
                kept = sum(stat.size for stat in snapshot.statistics("filename"))
            finally:
                tracemalloc.stop()
        finally:
            await gateway.aclose()
    assert primary.count == 301
    sent = dict(primary.received[-1].headers)
    assert sent["accept-encoding"] == "gzip"  # still narrowed to what the meter reads
    assert kept < 1_000_000, kept


@settings(max_examples=600, deadline=None)
@given(_BYTES)
@example(b"X_Tenant-ID")
@example(b"\xc4_\xe4")  # bytes >= 0x80 as they are: `bytes.lower` is ASCII only
def test_the_canonical_name_is_lower_case_with_dashes_for_any_bytes(name: bytes) -> None:
    # One `translate` where `lower().replace(b"_", b"-")` was: the same bytes for any name.
    expected = name.lower().replace(b"_", b"-")
    assert canonical_name(name) == expected
    assert name_forms(name) == (name.lower(), expected)


@pytest.mark.parametrize(
    "value", [b"keep-alive", b"Keep-Alive", b"close", b"Close", b"KEEP-ALIVE", b"close, x_private"]
)
def test_a_listing_field_names_what_its_tokens_name(value: bytes) -> None:
    # The usual `Connection` values are read from a table, the rest token by token: the
    # same names either way, and never a set another field's reading shares.
    from fallback_mw.security.fields import _connection_named

    expected = {canonical_name(token.strip()) for token in value.split(b",") if token.strip()}
    named = _connection_named([(b"connection", value)])
    assert named == expected
    named.add(b"x-added")
    assert _connection_named([(b"trailer", value)]) == expected
