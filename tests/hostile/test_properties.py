"""Property-based tests (hypothesis): the config loader never raises anything but
ConfigError, no raw path escapes a route prefix, and no credential or hop-by-hop header
survives header filtering, whatever the spelling."""

from __future__ import annotations

import contextlib
import socket
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import quote, unquote

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fallback_mw.config import ConfigError, load_config
from fallback_mw.routing import RouteTable, normalise_path
from fallback_mw.security.fields import (
    CREDENTIAL_HEADERS,
    GATEWAY_HEADER_PREFIX,
    HOP_BY_HOP_HEADERS,
    PATH_OVERRIDE_HEADERS,
    RECOMPUTED_HEADERS,
    _forwardable_listed,
    forwardable_request_headers,
)
from fallback_mw.spelling import PATH_SAFE, caller_spelling

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- the config loader ----------------------------------------------------------------

KEYS = [
    "gateway", "upstreams", "routes", "budgets", "prices", "url", "auth_env", "auth_header",
    "auth_scheme", "plan", "prefix", "id", "retries", "deadline_ms", "limit", "window",
    "default_hold", "allow_hosts", "state", "store", "max_header_bytes", "max_concurrency",
    "methods", "failover_status", "hedge_after_ms", "canary_percent", "breaker", "model",
    "input_per_mtok", "output_per_mtok", "tenant", "strategy", "engine", "header_timeout_ms",
]  # fmt: skip
URLS = [
    "http://127.0.0.1:9", "http://[::1]:9", "https://localhost", "http://169.254.169.254",
    "http://exa mple.com", "ftp://x", "http://user:pw@127.0.0.1", "http://h:99999", "",
    "http://127.0.0.1/?q=1", "http://0xa9fea9fe", "http://[::ffff:a9fe:a9fe]",
]  # fmt: skip
scalars = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(URLS),
    st.booleans(),
    st.sampled_from(["1e12", "inf", "nan", "-0", "10000000000", "/v1/", "GET", "primary"]),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), children,
                        max_size=5),
    ),
    max_leaves=25,
)  # fmt: skip
upstream_names = st.sampled_from(["primary", "backup", "p", "missing"])
upstream = st.fixed_dictionaries(
    {"url": st.sampled_from(URLS)},
    optional={
        "auth_env": st.one_of(
            st.sampled_from(["K1", "K2", "UNSET"]), st.lists(st.text(max_size=5))
        ),
        "auth_header": st.text(max_size=10),
        "connect_timeout_ms": st.integers(-5, 10**20),
        "model": values,
    },
)  # fmt: skip
route = st.fixed_dictionaries(
    {"id": st.text(max_size=8), "prefix": st.sampled_from(["/v1/", "v1", "/a/../b", "/%2e/", "/"]),
     "plan": st.lists(upstream_names, max_size=4)},
    optional={"retries": st.integers(-3, 10**12), "budget": st.sampled_from(["b", "nope"]),
              "hedge_after_ms": st.integers(-1, 10**6), "methods": values,
              "failover_status": st.lists(st.integers(-1, 10**6), max_size=3),
              "deadline_ms": values},
)  # fmt: skip
structured = st.fixed_dictionaries(
    {},
    optional={
        "gateway": st.dictionaries(st.sampled_from(KEYS), values, max_size=4),
        "upstreams": st.dictionaries(upstream_names, upstream, max_size=3),
        "routes": st.lists(route, max_size=3),
        "budgets": st.dictionaries(st.sampled_from(["b", "x"]), st.dictionaries(
            st.sampled_from(["limit", "window", "default_hold", "other"]), values, max_size=3),
            max_size=2),
        "prices": st.dictionaries(st.text(max_size=5), values, max_size=2),
    },
)  # fmt: skip
ENVIRON = {"K1": "key-one", "K2": "key\n"}


def _no_dns(host: Any, *args: Any, **kwargs: Any) -> Any:
    raise socket.gaierror("no DNS in property tests")


@SETTINGS
@given(st.one_of(structured, st.dictionaries(st.sampled_from(KEYS), values, max_size=5)))
def test_the_config_loader_raises_only_config_error(data: dict[str, Any]) -> None:
    with mock.patch("socket.getaddrinfo", _no_dns):
        try:
            config = load_config(data, environ=ENVIRON)
        except ConfigError as exc:
            assert "key-one" not in str(exc)  # a credential value is never printed
            return
    # What loads can be served: every amount fits the ledgers' signed 64-bit columns.
    for budget in config.budgets.values():
        for amount in (budget.limit, budget.default_hold):
            assert amount.is_finite() and amount * 10**9 < 2**63
    for price in config.prices.values():
        assert price.input_per_mtok * 10**9 < 2**63 and price.output_per_mtok * 10**9 < 2**63


@SETTINGS
@given(st.text(max_size=300))
def test_any_toml_text_loads_or_is_a_config_error(text: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "gateway.toml"
        path.write_text(text, encoding="utf-8")
        with mock.patch("socket.getaddrinfo", _no_dns), contextlib.suppress(ConfigError):
            load_config(path, environ=ENVIRON)


# --- route matching -------------------------------------------------------------------

PATH_PIECES = [
    "/", "v1", "v2", "admin", ".", "..", "%2e", "%2E", "%2e%2e", ".%2e", "%2f", "%2F", "%5c",
    "\\", ";", ";x=1", "..;", ".;", "%3b", "%3B", "%25", "%252e", "%00", "%ff", "%", "a b",
    "v1%2f..", "//", "%c0%ae", "é", "?",
]  # fmt: skip
PREFIXES = ["/v1/", "/v1/chat/", "/api"]


def upstream_view(forwarded: str) -> str:
    """How a lenient upstream reads the forwarded path: decode once, `\\` as `/`, drop
    `;params` from dot segments, resolve dot segments."""
    text = unquote(forwarded, errors="replace").replace("\\", "/")
    segments: list[str] = []
    for segment in text.split("/"):
        dot = segment.split(";", 1)[0]
        if segment == "" or dot == ".":
            continue
        if dot == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments) + ("/" if text.endswith("/") else "")


def _within(path: str, prefix: str) -> bool:
    return (
        path.startswith(prefix)
        or (prefix.endswith("/") and path == prefix[:-1])
        or (path.rstrip("/") + "/" == prefix)
    )


segments = st.lists(st.sampled_from(PATH_PIECES), min_size=1, max_size=2).map("".join)


@SETTINGS
@given(st.lists(segments, min_size=1, max_size=8), st.booleans())
def test_no_raw_path_escapes_a_route_prefix(parts: list[str], trailing: bool) -> None:
    from fallback_mw.config import RouteConfig, UpstreamConfig

    raw = "/" + "/".join(parts) + ("/" if trailing else "")
    table = RouteTable(
        [RouteConfig(id=p, prefix=p, plan=("u",)) for p in PREFIXES],
        {"u": UpstreamConfig(url="http://127.0.0.1:9")},
    )
    path = normalise_path(raw)
    if path is None:
        return
    assert normalise_path(path.replace("%", "%25")) == path  # stable once normalised
    route = table.match("GET", path, "default")
    if route is None:
        return
    assert _within(path, route.prefix)
    # What the walker sends: the caller's spelling where it is kept, else the path quoted.
    spelled = caller_spelling(raw, route.prefix) if "%" in raw else None
    forwarded = spelled or quote(path, safe=PATH_SAFE)
    seen = upstream_view(forwarded)
    assert _within(seen, route.prefix), (raw, path, forwarded, seen)
    # Read without decoding (a strict upstream: `%2F` is part of a name), it is in the prefix
    # too, and it names the very path the gateway routed on.
    assert _within(forwarded, quote(route.prefix, safe=PATH_SAFE)), (raw, forwarded)
    assert normalise_path(forwarded) == path, (raw, path, forwarded)


# --- header filtering -----------------------------------------------------------------

SENSITIVE = sorted(n.decode() for n in CREDENTIAL_HEADERS | HOP_BY_HOP_HEADERS)
SENSITIVE += ["x-gateway-route", "x-gateway-deadline-ms", "x-primary-key", "host",
              "content-length", "x-original-url", "x-rewrite-url"]  # fmt: skip
ORDINARY = ["accept", "x-request-id", "user-agent", "x-custom", "traceparent"]


@st.composite
def spelled(draw: st.DrawFn, name: str) -> bytes:
    """`name` in a random case, with any of its dashes written as underscores."""
    chars = [(c.upper() if draw(st.booleans()) else c) if c.isalpha() else c for c in name]
    chars = ["_" if c == "-" and draw(st.booleans()) else c for c in chars]
    return "".join(chars).encode()


@st.composite
def header_lists(draw: st.DrawFn) -> tuple[list[tuple[bytes, bytes]], set[bytes]]:
    names = draw(st.lists(st.sampled_from(SENSITIVE + ORDINARY), max_size=12))
    headers = [(draw(spelled(n)), draw(st.binary(max_size=8))) for n in names]
    listed = draw(st.lists(st.sampled_from(ORDINARY + SENSITIVE), max_size=3))
    if listed:
        value = b", ".join(draw(spelled(n)) for n in listed)
        headers.insert(draw(st.integers(0, len(headers))), (draw(spelled("connection")), value))
    return headers, {n.encode() for n in listed}


_REWRITTEN = [
    (b"Accept-Encoding", b"gzip, br;q=0.5, zstd"),
    (b"accept_encoding", b"br"),
    (b"Referer", b"https://example.test/page?api_key=s3cret&x=1"),
    (b"x-original-uri", b"/v1/chat?key=k&keep=1"),
]


@SETTINGS
@given(header_lists(), st.lists(st.sampled_from(_REWRITTEN), max_size=3), st.booleans())
def test_a_head_is_filtered_in_one_pass_as_the_listing_fields_reading_filters_it(
    case: tuple[list[tuple[bytes, bytes]], set[bytes]],
    rewritten: list[tuple[bytes, bytes]],
    with_query_keys: bool,
) -> None:
    """A head without `Connection` / `Trailer` is filtered in one pass: the same fields, in
    the same order, with the same rewrites (`Accept-Encoding` narrowed, URLs losing the
    `strip_query_keys` parameters), as the reading that first collects what those fields
    name (`_forwardable_listed`, which a head with one of them gets)."""
    headers = case[0] + rewritten
    also = frozenset({b"x-primary-key", b"x_other_key"})
    query_keys = frozenset({b"api_key", b"key"}) if with_query_keys else frozenset()
    kept = forwardable_request_headers(headers, also_strip=also, query_keys=query_keys)
    canonical_also = frozenset(name.replace(b"_", b"-") for name in also)
    assert kept == _forwardable_listed(headers, canonical_also, query_keys)


@SETTINGS
@given(header_lists())
def test_no_credential_or_hop_by_hop_header_survives_filtering(
    case: tuple[list[tuple[bytes, bytes]], set[bytes]],
) -> None:
    headers, connection_named = case
    also_strip = frozenset({b"x-primary-key"})
    kept = forwardable_request_headers(headers, also_strip=also_strip)
    forbidden = CREDENTIAL_HEADERS | HOP_BY_HOP_HEADERS | RECOMPUTED_HEADERS | also_strip
    forbidden |= PATH_OVERRIDE_HEADERS
    for name, _ in kept:
        canonical = name.lower().replace(b"_", b"-")
        assert canonical not in forbidden
        assert canonical not in connection_named
        assert not canonical.startswith(GATEWAY_HEADER_PREFIX)
    # And nothing else is lost: every ordinary header survives, in order.
    expected = [
        (n.lower(), v)
        for n, v in headers
        if n.lower().replace(b"_", b"-") in {o.encode() for o in ORDINARY}
        and n.lower().replace(b"_", b"-") not in connection_named
    ]
    assert kept == expected
