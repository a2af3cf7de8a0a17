"""Hostile request input through a real server (uvicorn on 127.0.0.1): never a bare 500."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fallback_mw import Gateway
from fallback_mw.cli import main
from fallback_mw.layers.head import identity_headers
from fallback_mw.security.fields import METHOD_OVERRIDE_FIELDS, named_methods, override_methods
from tests.helpers import client_for
from tests.test_budget_guard import gateway_config
from tests.upstreams import host_app, serve_asgi, status_handler, upstream

pytestmark = pytest.mark.anyio


def config(url: str, **route: Any) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {"primary": {"url": url}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"], **route}],
    }


@pytest.mark.parametrize(
    "value",
    [b"\xb2", b"1" * 5000, b"\xd9\xa3", b"-5", b"+5", b"5.0", b"0x10", b"", b"1_000"],
    ids=[
        "superscript-two",
        "5000-digits",
        "arabic-indic-3",
        "negative",
        "plus",
        "decimal",
        "hex",
        "empty",
        "underscore",
    ],
)
async def test_a_malformed_deadline_header_is_ignored_not_a_500(value: bytes) -> None:
    async with upstream(status_handler(200, b"ok")) as primary:
        gateway = Gateway(host_app, config=config(primary.url))
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.get("/v1/x", headers=[(b"x-gateway-deadline-ms", value)])
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    assert response.text == "ok"
    assert primary.count == 1


@pytest.mark.parametrize(
    "fields",
    [[b"50", b"5000"], [b"5000", b"50"], [b"50", b"50"], [b"50, 5000"]],
    ids=["short-first", "short-last", "same-twice", "joined"],
)
async def test_a_deadline_header_sent_twice_is_ignored_as_its_joined_value_is(
    fields: list[bytes],
) -> None:
    """Two fields of one name are one field whose value is their comma-joined list (RFC
    9110 §5.3; a proxy or server in front may join them): `50, 5000` is not 1-7 ASCII
    digits, so it is ignored and the route deadline applies (SPEC §12), however the fields
    reach the gateway. The first field alone used to win when they came apart, so the
    same request got a 50 ms deadline or the route's depending on what was in front."""
    async with upstream(status_handler(200, b"ok", delay=0.3)) as primary:
        gateway = Gateway(host_app, config=config(primary.url))
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                asked = [(b"x-gateway-deadline-ms", value) for value in fields]
                response = await client.get("/v1/x", headers=asked)
                one = await client.get("/v1/x", headers=[(b"x-gateway-deadline-ms", b"50")])
        finally:
            await gateway.aclose()
    assert (response.status_code, response.text) == (200, "ok")
    assert one.status_code == 504  # the control: one well-formed field shortens the walk


def test_requested_deadline_parsing_is_strict_and_bounded() -> None:
    from fallback_mw.layers.head import requested_deadline_ms

    assert requested_deadline_ms("250") == 250
    assert requested_deadline_ms(" 250 ") == 250
    assert requested_deadline_ms("0") is None
    assert requested_deadline_ms("²") is None
    assert requested_deadline_ms("٣") is None
    assert requested_deadline_ms("1" * 5000) is None  # longer than any deadline: no shortening
    assert requested_deadline_ms("-1") is None


_NAMES = (b"x-tenant-id", b"x-session-id", b"x-gateway-deadline-ms")
_OTHER_NAMES = (
    b"X-Tenant-ID", b"X-Gateway-Deadline-MS", b"accept", b"X-HTTP-Method-Override",
    b"x_http_method", bytearray(b"Accept"),
)  # fmt: skip


@given(
    st.lists(
        st.tuples(
            st.sampled_from([*_NAMES, *_OTHER_NAMES]),
            st.binary(max_size=12),
        ),
        max_size=8,
    ),
    st.sampled_from([_NAMES, (b"x-tenant-id", b"x-tenant-id", b"x-gateway-deadline-ms")]),
)
def test_the_resolver_reads_each_header_as_the_first_field_of_that_name(
    headers: list[tuple[bytes, bytes]], names: tuple[bytes, ...]
) -> None:
    """One pass for the tenant, the session and the deadline: each is the first field of
    its name (any case; the deadline sent in two fields is none, as its joined value is),
    read as UTF-8 when it is, stripped of SP / HTAB, None when absent or empty; one name
    asked twice (the tenant and session headers configured alike) gets the same answer
    twice. The method-override fields' values come from the same pass, read as
    `override_methods` reads them (a `bytearray` name, where ASGI sends bytes, leaves them
    to `override_methods`)."""

    identity = set(names[:2])

    def members(name: bytes, value: bytes) -> set[str | None]:
        try:  # UTF-8 as written (a tenant outside ASCII matches its route)
            text = value.decode()
        except UnicodeDecodeError:  # refused with a 400 later
            text = value.decode("latin-1")
        text = text.strip(" \t")  # SP / HTAB only (RFC 9110 §5.5)
        if name in identity and "," in text:  # fields joined by commas (RFC 9110 §5.3)
            return {m.strip(" \t") for m in text.split(",")} - {""} or {None}
        return {text or None}

    def first(name: bytes) -> str | None:
        fields = [value for key, value in headers if key.lower() == name]
        if name not in identity and len(fields) > 1:
            return None  # the deadline twice: "a, b" is not 1-7 digits (SPEC §12)
        for value in fields:
            return min(members(name, value), key=str)  # one member, or refused
        return None

    def values(name: bytes) -> set[str | None]:
        found: set[str | None] = set()
        for key, value in headers:
            if key.lower() == name:
                found |= members(name, value)
        return found

    wanted = frozenset(names) | METHOD_OVERRIDE_FIELDS
    found, twice, override_values = identity_headers(headers, names, wanted)
    if any(type(key) is bytearray for key, _ in headers):
        assert override_values is None
    else:
        assert override_values is not None
        assert named_methods(override_values, "POST") == override_methods(headers, "POST")
    if twice is None:  # a refused request's values are never used
        assert found == [first(name) for name in names]
    # The identity headers (the first two names) sent with two different values are
    # named (a 400 identity_header); the deadline's repeats are not.
    conflicting = [name for name in names[:2] if len(values(name)) > 1]
    assert (twice is None) == (not conflicting)
    assert twice is None or twice in conflicting


async def test_a_tenant_with_c1_controls_reaches_the_usage_table_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tenant is the caller's text: `fallback-mw usage` shows it printable, never as
    the terminal controls it spells (U+009B is CSI: `\\x9b2J` clears an xterm's screen)."""
    store = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with upstream(status_handler(200)) as primary:
        gateway = Gateway(host_app, config=gateway_config({"primary": primary.url}, store=store))
        try:
            async with client_for(gateway) as client:
                tenant = "evil\u009b2J\u009b31mred\u202eabc".encode()
                response = await client.get("/v1/x", headers=[(b"x-tenant-id", tenant)])
                assert response.status_code == 200
        finally:
            await gateway.aclose()
    capsys.readouterr()
    status = await anyio.to_thread.run_sync(main, ["usage", "--store", store])
    assert status == 0
    out = capsys.readouterr().out
    assert "evil" in out
    assert all(ch.isprintable() for line in out.splitlines() for ch in line)
