"""The caller's request head as forwarded upstream (SPEC §4): credentials, hop-by-hop fields,
those named in `Connection`, incoming `x-gateway-*`, forwarding identity and path overrides
stripped; names compared as WSGI-style upstreams read them (`canonical_name`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Final

from fallback_mw.security.queries import NO_METHODS, strip_url_query_keys
from fallback_mw.security.values import (
    MAX_CACHED,
    NAME_CACHE_LONGEST,
    NAME_CACHE_SIZE,
    QUESTION,
    UNDERSCORE,
)

Headers = list[tuple[bytes, bytes]]


# Caller credentials: never forwarded to any upstream (SPEC §4).
CREDENTIAL_HEADERS: Final = frozenset(
    {
        b"authorization",
        b"proxy-authorization",
        b"x-api-key",
        b"api-key",
        b"x-goog-api-key",
        b"cookie",
    }
)


# What a proxy says about the client: an upstream that trusts the gateway as its proxy
# (nginx `real_ip`, uvicorn `--forwarded-allow-ips`, a framework's trusted proxies) reads
# them as the caller's address, host and scheme, so a caller forged the address an
# upstream's rate limits and allowlists saw. Trusted only from configured peers, as
# uvicorn's ProxyHeadersMiddleware does; the gateway has none: stripped by default.
FORWARDING_HEADERS: Final = (
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-forwarded-port",
    "x-forwarded-prefix",
    "x-real-ip",
    "x-client-ip",
    "true-client-ip",
    "cf-connecting-ip",
    # What the proxies platform teams put in front add beyond that family: ingress-nginx's
    # scheme fields and its copy of the caller's own X-Forwarded-For, Traefik's and
    # Apache's proxy host name, Envoy's trusted client address, Fastly's, the scheme flags
    # Rack and Rails read, and the `Client-IP` Rails' RemoteIp and Rack read as the address.
    "x-scheme",
    "x-forwarded-scheme",
    "x-original-forwarded-for",
    "x-forwarded-server",
    "x-envoy-external-address",
    "fastly-client-ip",
    "x-cluster-client-ip",
    "client-ip",
    "x-forwarded-ssl",
    "front-end-https",
)


# Further credential-looking headers and query keys stripped by default (SPEC §12
# `[gateway] strip_headers` / `strip_query_keys`; setting a list replaces these).
DEFAULT_STRIP_HEADERS: Final = (
    "x-auth-token",
    "anthropic-api-key",
    "ocp-apim-subscription-key",
    "x-amz-security-token",
    "x-goog-iam-authorization-token",
    "x-functions-key",
    "private-token",
    "apikey",  # Kong's key-auth and Supabase read the key from this header (and `?apikey=`)
    # The end user's own tokens, which an authenticating proxy in front of the gateway adds
    # to every request it lets through: oauth2-proxy (`--pass-access-token`), Google's API
    # Gateway / ESPv2 (the original `Authorization` it replaced), AWS ALB's OIDC action,
    # Azure App Service authentication, Cloudflare Access (its JWT, a service token's
    # secret), Google IAP, Pomerium, Kong's OIDC plugin. Forwarded, a user's identity
    # provider token (a refresh token, with Azure) reached the LLM provider. The names a
    # proxy gives the user's identity (`x-amzn-oidc-identity`, `x-forwarded-email`...) are
    # no credentials and stay: a tenant_header may read them.
    "x-forwarded-access-token",
    "x-auth-request-access-token",
    "x-forwarded-authorization",
    "x-amzn-oidc-accesstoken",
    "x-amzn-oidc-data",
    "x-ms-token-aad-access-token",
    "x-ms-token-aad-id-token",
    "x-ms-token-aad-refresh-token",
    "cf-access-jwt-assertion",
    "cf-access-client-secret",
    "x-goog-iap-jwt-assertion",
    "x-pomerium-jwt-assertion",
    "x-access-token",
    "x-id-token",
    # A browser page's anti-CSRF token, sent beside the session cookie the gateway strips
    # (Django's `X-CSRFToken`, Rails' and Laravel's `X-CSRF-Token`, the `X-XSRF-TOKEN`
    # Angular and axios send by themselves on a same-origin call): whoever holds it can
    # forge requests the host app accepts from that user's browser.
    "x-csrftoken",
    "x-csrf-token",
    "x-xsrf-token",
    # Not secrets, but they choose whose account the gateway's own credential acts for:
    # OpenAI bills a request to the organization / project these name (a key in several),
    # Google to the `x-goog-user-project`. A caller must not pick who pays.
    "openai-organization",
    "openai-project",
    "x-goog-user-project",
    # Not secrets either, but what a proxy says about the client (FORWARDING_HEADERS).
    *FORWARDING_HEADERS,
)


# RFC 9110 §7.6.1 connection-specific fields, plus the usual legacy ones.
HOP_BY_HOP_HEADERS: Final = frozenset(
    {
        b"connection",
        b"proxy-connection",
        b"keep-alive",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"proxy-authenticate",
    }
)


GATEWAY_HEADER_PREFIX: Final = b"x-gateway-"


# Fields asking the upstream to read a request as another method: Google's APIs, Rails,
# Express, Laravel and ASP.NET Core honour one on a POST. The gateway routes and replays
# on what the upstream will do, so these methods count as the request's (`override_methods`).
METHOD_OVERRIDE_FIELDS: Final = frozenset(
    {b"x-http-method-override", b"x-http-method", b"x-method-override"}
)


_OVERRIDE_LENGTHS: Final = frozenset(len(name) for name in METHOD_OVERRIDE_FIELDS)


# Recomputed by the upstream client for whatever body it actually sends.
RECOMPUTED_HEADERS: Final = frozenset({b"host", b"content-length", b"expect"})


# Fields that replace the request's path where the upstream reads them: Yii 2 takes the
# path from `X-Rewrite-Url`, Zend Framework 1 (Magento 1, OpenMage) from `X-Original-URL`
# or `X-Rewrite-URL` (IIS's rewrite module sets them). The path an upstream serves is the
# route's, so a caller's copy never goes on (`POST /v1/chat` + `X-Original-URL: /admin`).
PATH_OVERRIDE_HEADERS: Final = frozenset({b"x-original-url", b"x-rewrite-url"})


def override_methods(headers: Iterable[tuple[bytes, bytes]], method: str) -> frozenset[str]:
    """The methods other than `method` that the caller's method-override fields name, as
    the servers that honour them read them: any spelling of the name (`_` read as `-`),
    every comma-separated value of every such field, upper-cased."""
    named: set[str] | None = None
    for name, value in headers:
        # The length first: a name of another length is no override field.
        if len(name) in _OVERRIDE_LENGTHS and canonical_name(name) in METHOD_OVERRIDE_FIELDS:
            if named is None:
                named = set()
            _add_methods(named, value)
    if named is None:
        return NO_METHODS
    named.discard(method)
    return frozenset(named)


def named_methods(values: Sequence[bytes], method: str) -> frozenset[str]:
    """`override_methods` from the method-override fields' values, in order, already
    found (the resolver finds them in its one pass over the request's headers)."""
    if not values:
        return NO_METHODS
    named: set[str] = set()
    for value in values:
        _add_methods(named, value)
    named.discard(method)
    return frozenset(named)


def _add_methods(named: set[str], value: bytes) -> None:
    """Every comma-separated method a method-override field's value names, upper-cased."""
    for item in value.decode("latin-1").split(","):
        item = item.strip().upper()
        if item:
            named.add(item)


# Each header name's lowercased and canonical forms, by the name as it came
# (`name_forms`): the same few names come every request, and a dict look-up is a fraction
# of `lower` and `replace` (method calls of a few hundred instructions each, compiled),
# done in several passes over every head. Bounded as every cache of caller names is
# (`NAME_CACHE_LONGEST`, `NAME_CACHE_SIZE`: 64 bytes, 1,024 names).
# Final: compiled, a static, not a look-up in the module's dict at every call.
_NAME_FORMS: Final[dict[bytes, tuple[bytes, bytes]]] = {}


def name_forms(name: bytes) -> tuple[bytes, bytes]:
    """`(name.lower(), canonical_name(name))`, remembered for the usual names (of type
    bytes: a host's bytearray name, unhashable, is read as it was)."""
    found = _NAME_FORMS.get(name) if type(name) is bytes else None
    if found is None:
        found = (name.lower(), canonical_name(name))
        if (
            len(name) <= NAME_CACHE_LONGEST
            and len(_NAME_FORMS) < NAME_CACHE_SIZE
            and type(name) is bytes
        ):
            _NAME_FORMS[name] = found
    return found


# `canonical_name`'s table: ASCII upper case to lower case (what `bytes.lower` does) and
# `_` to `-`, in one `translate` (one method call, where `lower().replace()` made two).
CANONICAL: Final = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ_", b"abcdefghijklmnopqrstuvwxyz-")


def canonical_name(name: bytes) -> bytes:
    """The name as WSGI-style upstreams read it: `x_api_key` and `X-Api-Key` are one field
    (both become HTTP_X_API_KEY), so every stripping rule compares this form."""
    return name.translate(CANONICAL)


# Fields whose value lists other fields that must not be forwarded: `Connection` names
# hop-by-hop fields; `Trailer` names fields meant to come after a chunked body (a server
# that parses trailers into the request's header list, as uvicorn's httptools parser
# does, would otherwise hand them on as headers).
_LISTING_FIELDS: Final = (b"connection", b"trailer")


def _connection_named(lowered: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    """The canonical names listed in `Connection` / `Trailer` fields (`lowered`: names
    already lowercased; neither listing field has a `_` to fold)."""
    named: set[bytes] = set()
    for name, value in lowered:
        if name in _LISTING_FIELDS:
            usual = _USUAL_LISTS.get(value) if type(value) is bytes else None
            if usual is not None:
                named.update(usual)
                continue
            named.update(
                canonical_name(token.strip()) for token in value.split(b",") if token.strip()
            )
    return named


# The usual listing values, read without splitting them (`Connection: keep-alive` comes on
# nearly every HTTP/1.1 answer): the canonical names each lists.
_USUAL_LISTS: Final[dict[bytes, frozenset[bytes]]] = {
    value: frozenset({canonical_name(value)})
    for value in (b"keep-alive", b"Keep-Alive", b"close", b"Close")
}


def forwardable_request_headers(
    headers: Sequence[tuple[bytes, bytes]],
    *,
    also_strip: frozenset[bytes] = frozenset(),
    query_keys: frozenset[bytes] = frozenset(),
) -> Headers:
    """The caller's headers minus credentials (the standard ones and `also_strip`, the
    upstreams' own auth headers), hop-by-hop fields, those named in `Connection`, incoming
    `x-gateway-*`, the fields the client recomputes and those that replace the path
    (PATH_OVERRIDE_HEADERS). Repeated headers survive in order.

    Names are compared with `_` read as `-` (canonical_name): `x_api_key` is stripped like
    `x-api-key`, because WSGI-style upstreams (Django, Flask, PHP...) cannot tell them
    apart. Other underscore names (`x_request_trace`) are forwarded unchanged.

    `Accept-Encoding` is narrowed to the codings the usage meter reads
    (`readable_accept_encoding`). A URL a field carries (`Referer`, a proxy's copy of the
    request target such as `X-Original-URI` or Envoy's `x-envoy-original-path`) loses the
    `query_keys` parameters (canonical, `strip_query_keys`), as the request's own query
    does (`strip_url_query_keys`)."""
    also = _canonical_names(also_strip)
    # One pass (`kept_fields` and the rewrites below it, written out) for a head without
    # a listing field, the usual one; a `Connection` / `Trailer` field starts again.
    kept: Headers = []
    for raw, value in headers:
        name, canonical = name_forms(raw)
        if (
            canonical in _NEVER_FORWARDED
            or canonical in also
            or canonical.startswith(GATEWAY_HEADER_PREFIX)  # a caller's x-gateway-*
        ):
            if name in _LISTING_FIELDS:  # hop-by-hop, so never forwarded itself
                return _forwardable_listed(headers, also, query_keys)
            continue
        if name == b"accept-encoding" or (query_keys and QUESTION in value):
            value = _forwarded_value(name, value, query_keys)  # the rare rewrite only
        kept.append((name, value))
    return kept


def _forwardable_listed(
    headers: Sequence[tuple[bytes, bytes]], also: frozenset[bytes], query_keys: frozenset[bytes]
) -> Headers:
    """`forwardable_request_headers` of a head with a `Connection` or `Trailer` field (`also`:
    canonical): the fields they name are dropped too, wherever they stand."""
    kept = kept_fields([(name.lower(), value) for name, value in headers], _NEVER_FORWARDED, also)
    return [(name, _forwarded_value(name, value, query_keys)) for name, value in kept]


def _forwarded_value(name: bytes, value: bytes, query_keys: frozenset[bytes]) -> bytes:
    """A kept field's value as it is forwarded (`name` lowercased): `Accept-Encoding` less
    the codings the usage meter cannot read, a URL less the `query_keys` parameters."""
    if name == b"accept-encoding":
        # A caller's value of any length is not kept in the cache (`is_field_name`).
        if len(value) <= MAX_CACHED:
            return readable_accept_encoding(value)
        return readable_codings(value)
    if query_keys and QUESTION in value:
        return strip_url_query_keys(value, query_keys)
    return value


# The content codings the usage meter (request/usage.py) decodes, besides `identity`.
READABLE_CODINGS: Final = frozenset({b"gzip", b"x-gzip", b"deflate"})


def readable_codings(value: bytes) -> bytes:
    """The caller's `Accept-Encoding` less the codings the usage meter cannot read (`br`,
    `zstd`, `*`...): an answer in one of those would hide its usage from the budget and
    be settled at the hold. `identity` when nothing readable is left."""
    kept = [
        item.strip()
        for item in value.split(b",")
        if item.split(b";", 1)[0].strip().lower() in READABLE_CODINGS
    ]
    return b", ".join(kept) or b"identity"


readable_accept_encoding: Final = lru_cache(maxsize=64)(readable_codings)


@lru_cache(maxsize=64)
def _canonical_names(names: frozenset[bytes]) -> frozenset[bytes]:
    """`names` in canonical form, once per set (a route table's is made once). Not
    `b"_" in name` per request: on CPython 3.11 `bytes in bytes` first tries the needle
    as an integer and formats (then drops) a TypeError, some 2,000 instructions each."""
    if all(UNDERSCORE not in name for name in names):
        return names
    return frozenset(canonical_name(name) for name in names)


_NEVER_FORWARDED: Final = (
    CREDENTIAL_HEADERS | HOP_BY_HOP_HEADERS | RECOMPUTED_HEADERS | PATH_OVERRIDE_HEADERS
)


def kept_fields(
    lowered: Headers,
    dropped: frozenset[bytes],
    also: frozenset[bytes],
    *,
    kept_if_listed: frozenset[bytes] | None = None,
) -> Headers:
    """The fields (`lowered`: names already lowercased) whose canonical name is in neither
    `dropped` nor `also`, not named in `Connection` and not `x-gateway-*`; repeats kept in
    order. The listing fields are read first only when there is one (they are hop-by-hop
    themselves, so rarely sent). `kept_if_listed`: names a listing does not remove."""
    named: set[bytes] | frozenset[bytes] = _NONE_NAMED
    for name, _ in lowered:
        if name in _LISTING_FIELDS:
            named = _connection_named(lowered)
            if kept_if_listed is not None:
                named -= kept_if_listed
            break
    kept: Headers = []
    for name, value in lowered:
        canonical = name_forms(name)[1]
        if (
            canonical in dropped
            or canonical in also
            or canonical in named
            or canonical.startswith(GATEWAY_HEADER_PREFIX)
        ):
            continue
        kept.append((name, value))
    return kept


_NONE_NAMED: Final[frozenset[bytes]] = frozenset()
