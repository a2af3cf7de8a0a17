"""Header hygiene and the upstream address checks (allowlist, link-local / metadata refusal)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from functools import lru_cache
from urllib.parse import unquote_to_bytes

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Headers = list[tuple[bytes, bytes]]

# Caller credentials: never forwarded to any upstream (SPEC §4).
CREDENTIAL_HEADERS = frozenset(
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
FORWARDING_HEADERS = (
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
DEFAULT_STRIP_HEADERS = (
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
DEFAULT_STRIP_QUERY_KEYS = (
    "api_key",
    "key",
    "api-key",
    "apikey",
    "access_token",
    "private_token",
    # The query spellings of headers stripped above: Azure API Management reads its
    # subscription key from `?subscription-key=` as from `Ocp-Apim-Subscription-Key`, and
    # a presigned AWS request carries its session token as `?X-Amz-Security-Token=`.
    "subscription-key",
    "x-amz-security-token",
)
# RFC 9110 §7.6.1 connection-specific fields, plus the usual legacy ones.
HOP_BY_HOP_HEADERS = frozenset(
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
GATEWAY_HEADER_PREFIX = b"x-gateway-"
# Fields asking the upstream to read a request as another method: Google's APIs, Rails,
# Express, Laravel and ASP.NET Core honour one on a POST. The gateway routes and replays
# on what the upstream will do, so these methods count as the request's (`override_methods`).
METHOD_OVERRIDE_FIELDS = frozenset(
    {b"x-http-method-override", b"x-http-method", b"x-method-override"}
)
_OVERRIDE_LENGTHS = frozenset(len(name) for name in METHOD_OVERRIDE_FIELDS)
# Recomputed by the upstream client for whatever body it actually sends.
RECOMPUTED_HEADERS = frozenset({b"host", b"content-length", b"expect"})
# Fields that replace the request's path where the upstream reads them: Yii 2 takes the
# path from `X-Rewrite-Url`, Zend Framework 1 (Magento 1, OpenMage) from `X-Original-URL`
# or `X-Rewrite-URL` (IIS's rewrite module sets them). The path an upstream serves is the
# route's, so a caller's copy never goes on (`POST /v1/chat` + `X-Original-URL: /admin`).
PATH_OVERRIDE_HEADERS = frozenset({b"x-original-url", b"x-rewrite-url"})


def header_value_problem(value: str) -> str | None:
    """Why `value` cannot be sent as an HTTP field value (RFC 9110 §5.5), or None. Says
    what is wrong, never what the value is (it may be a secret)."""
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        return "has characters outside latin-1"
    if any(c in value for c in "\r\n\x00"):
        return "contains a line break or NUL"
    if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in value):
        return "contains a control character"
    if value != value.strip(" \t"):
        return "starts or ends with whitespace"
    return None


_TCHAR = frozenset(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_VALUE_CTL = frozenset(range(0x20)) - {0x09} | {0x7F}


def is_token(name: str) -> bool:
    """An HTTP field name (RFC 9110 §5.1: a token), as a configured header name must be."""
    return bool(name) and name.isascii() and _TCHAR.issuperset(name.encode("ascii"))


# `is_token`, cached: on the attempt path (upstream.base.check_request_headers) the same
# few names come every request, and a hit costs a third of the check. A caller's names
# reach it too: one longer than MAX_CACHED is checked uncached, or 256 names of a 64 KB
# head each were kept for good (16 MB; 256 times max_header_bytes).
is_field_name = lru_cache(maxsize=256)(is_token)
MAX_CACHED = 256


def request_header_problem(name: bytes, value: bytes) -> str | None:
    """The one rule, for both engines, for a caller header that would be forwarded (SPEC
    §12, RFC 9110 §5.1/§5.5): the name a token; the value no control character but HTAB,
    and bytes >= 0x80 (obs-text) only as UTF-8, which both engines forward byte for byte.
    Leading and trailing SP/HTAB are not part of a field value (RFC 9110 §5.5): the
    attempt trims them, as every HTTP parser does. None: forward it. Says what is wrong,
    never what the value is."""
    # The usual field first, in a few C calls (the set checks below cost about 2 us a
    # header): a name of letters, digits and `-`; a value of printable ASCII (0x20-0x7E).
    if not (name.replace(b"-", b"").isalnum() or (name and _TCHAR.issuperset(name))):
        return "has a name that is not an HTTP token"
    if value.isascii() and value.decode("ascii").isprintable():
        return None
    if _VALUE_CTL.intersection(value):
        return "contains a control character"
    if not value.isascii():
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            return "has bytes >= 0x80 that are not UTF-8"
    return None


_TARGET_FORBIDDEN = frozenset(range(0x21)) | {0x7F, ord("#")}


def query_problem(query: bytes) -> str | None:
    """Why a query string cannot go out in a request target (RFC 9112 §3.2: no control
    character, space or `#`), or None. Bytes >= 0x80 go out percent-encoded."""
    if query and _TARGET_FORBIDDEN.intersection(query):
        return "the query string has a control character, a space or '#'"
    return None


def canonical_query_key(name: bytes) -> bytes:
    """A query parameter's name as the servers that read it loosely do: percent-decoded,
    `+` as a space, case-folded; an array suffix dropped (`api_key[]`, `api_key[0]`: PHP
    and Rails read `api_key`); `.` and spaces as `_` (PHP reads `api.key` and `api key`
    as `api_key`). PHP also reads a name up to a NUL, skips leading spaces and reads an
    unclosed `[` as `_` (`%20api_key`, `api_key%00x` and `api[key` are all `api_key`).
    Every `strip_query_keys` comparison uses this form on both sides."""
    key = unquote_to_bytes(name.replace(b"+", b" ")).lower()
    nul = key.find(b"\x00")
    if nul >= 0:
        key = key[:nul]
    key = key.lstrip(b" ")
    bracket = key.find(b"[")
    if bracket > 0:
        if key.find(b"]", bracket) > 0:
            key = key[:bracket]
        else:
            key = key[:bracket] + b"_" + key[bracket + 1 :]
    return key.replace(b".", b"_").replace(b" ", b"_")


def strip_query_keys(query: bytes, keys: frozenset[bytes]) -> bytes:
    """The query string without the parameters whose name is one of `keys` (both compared
    as `canonical_query_key`); every other parameter is kept byte for byte, in order.
    `;` separates parameters too (older servers split on it): `a=1;key=s` loses `;key=s`."""
    if not keys or not query:
        return query
    kept = []
    for part in query.split(b"&"):
        if b";" in part:
            pieces = [p for p in part.split(b";") if not _names_a_key(p, keys)]
            if pieces:
                kept.append(b";".join(pieces))
        elif not _names_a_key(part, keys):
            kept.append(part)
    return b"&".join(kept)


def _names_a_key(parameter: bytes, keys: frozenset[bytes]) -> bool:
    return canonical_query_key(parameter.split(b"=", 1)[0]) in keys


def is_legacy_ipv4(host: str) -> bool:
    """An IPv4 address in a spelling other than four dotted decimals (octal `0177.0.0.1`,
    hex `0x7f.1`, integer `2130706433`, short `127.1`): resolvers read them as addresses,
    readers as names, so a configuration may not use them."""
    written = host.strip().lower()
    text = written.rstrip(".")
    if parse_ip(text) is None:
        return False
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return ":" not in text  # an IPv6 literal is fine
    # Four decimals and a trailing dot (`127.0.0.1.`): the address to URL parsers (WHATWG,
    # curl), a name to getaddrinfo, and aiohttp refuses the URL.
    return written != text


def override_methods(headers: Iterable[tuple[bytes, bytes]], method: str) -> frozenset[str]:
    """The methods other than `method` that the caller's method-override fields name, as
    the servers that honour them read them: any spelling of the name (`_` read as `-`),
    every comma-separated value of every such field, upper-cased."""
    named: set[str] | None = None
    for name, value in headers:
        # The length first: every routed request asks (the resolver, once).
        if len(name) in _OVERRIDE_LENGTHS and canonical_name(name) in METHOD_OVERRIDE_FIELDS:
            if named is None:
                named = set()
            for item in value.decode("latin-1").split(","):
                item = item.strip().upper()
                if item:
                    named.add(item)
    if named is None:
        return _NO_METHODS
    named.discard(method)
    return frozenset(named)


_NO_METHODS: frozenset[str] = frozenset()
_METHOD_PARAMETER = b"_method"


def query_override_methods(query: bytes, method: str) -> frozenset[str]:
    """The methods other than `method` that a `_method` query parameter names: Symfony
    (so Laravel, which turns it on), Express's method-override with a query getter and
    Rack read `POST /x?_method=DELETE` as a DELETE. The name is compared as PHP reads it
    (`canonical_query_key`: `%5Fmethod`, `.method`); `&` and `;` separate parameters.
    Most queries name no such parameter: any spelling of `_method` holds `ethod` or a `%`,
    so two searches answer for them (the query string of nearly every request)."""
    if not query or (query.find(b"ethod") < 0 and query.find(b"%") < 0):
        return _NO_METHODS
    named: set[str] = set()
    for part in query.replace(b";", b"&").split(b"&"):
        name, _, value = part.partition(b"=")
        if canonical_query_key(name) == _METHOD_PARAMETER:
            text = unquote_to_bytes(value.replace(b"+", b" ")).decode("latin-1")
            for item in text.split(","):
                item = item.strip().upper()
                if item:
                    named.add(item)
    named.discard(method)
    return frozenset(named) if named else _NO_METHODS


def canonical_name(name: bytes) -> bytes:
    """The name as WSGI-style upstreams read it: `x_api_key` and `X-Api-Key` are one field
    (both become HTTP_X_API_KEY), so every stripping rule compares this form."""
    lower = name.lower()
    return lower.replace(b"_", b"-") if b"_" in lower else lower


# Fields whose value lists other fields that must not be forwarded: `Connection` names
# hop-by-hop fields; `Trailer` names fields meant to come after a chunked body (a server
# that parses trailers into the request's header list, as uvicorn's httptools parser
# does, would otherwise hand them on as headers).
_LISTING_FIELDS = (b"connection", b"trailer")


def _connection_named(lowered: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    """The canonical names listed in `Connection` / `Trailer` fields (`lowered`: names
    already lowercased; neither listing field has a `_` to fold)."""
    named: set[bytes] = set()
    for name, value in lowered:
        if name in _LISTING_FIELDS:
            named.update(
                canonical_name(token.strip()) for token in value.split(b",") if token.strip()
            )
    return named


def forwardable_request_headers(
    headers: Iterable[tuple[bytes, bytes]],
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
    kept = _kept(
        [(name.lower(), value) for name, value in headers],
        _NEVER_FORWARDED,
        _canonical_names(also_strip),
    )
    for index, (name, value) in enumerate(kept):
        if name == b"accept-encoding":
            # A caller's value of any length is not kept in the cache (`is_field_name`).
            if len(value) <= MAX_CACHED:
                kept[index] = (name, readable_accept_encoding(value))
            else:
                kept[index] = (name, readable_codings(value))
        elif query_keys and value.find(b"?") >= 0:
            kept[index] = (name, strip_url_query_keys(value, query_keys))
    return kept


_URL_SCHEMES = (b"http://", b"https://")


def strip_url_query_keys(value: bytes, keys: frozenset[bytes]) -> bytes:
    """A field value that is a URL (http(s)://..., or a path from `/`) without the query
    parameters named by `keys` (`strip_query_keys`); any other value as it is. A proxy in
    front copies the request target into a field (`X-Original-URI`, Envoy's
    `x-envoy-original-path` after a rewrite) and a browser sends the page's URL as
    `Referer`: the `?api_key=` stripped from the query went on in the copy."""
    mark = value.find(b"?")
    head = value[:mark]
    if mark < 0 or not (head.startswith(b"/") or head[:8].lower().startswith(_URL_SCHEMES)):
        return value
    query, hash_mark, fragment = value[mark + 1 :].partition(b"#")
    kept = strip_query_keys(query, keys)
    if kept == query:
        return value
    return head + (b"?" + kept if kept else b"") + hash_mark + fragment


# The content codings the usage meter (request/usage.py) decodes, besides `identity`.
READABLE_CODINGS = frozenset({b"gzip", b"x-gzip", b"deflate"})


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


readable_accept_encoding = lru_cache(maxsize=64)(readable_codings)


@lru_cache(maxsize=64)
def _canonical_names(names: frozenset[bytes]) -> frozenset[bytes]:
    """`names` in canonical form, once per set (a route table's is made once). Not
    `b"_" in name` per request: on CPython 3.11 `bytes in bytes` first tries the needle
    as an integer and formats (then drops) a TypeError, some 2,000 instructions each."""
    if all(name.find(b"_") < 0 for name in names):
        return names
    return frozenset(canonical_name(name) for name in names)


# The server in front of the client adds its own `date` and `server`; the upstream's copies
# would be duplicates, and its `server` names the provider's software to every caller.
SERVER_OWNED_RESPONSE_HEADERS = frozenset({b"date", b"server"})
# What an upstream says about the software and the proxies behind it, to every caller:
# the frameworks' banners (OWASP's list of fields to remove) and `via`, whose entries name
# the proxies it passed through and their hosts and ports (RFC 9110 §7.6.3: an intermediary
# at a network's edge should not forward the names of the hosts behind it; a gateway may
# leave `via` off the responses it forwards).
DEPLOYMENT_RESPONSE_HEADERS = frozenset(
    {b"x-powered-by", b"x-aspnet-version", b"x-aspnetmvc-version", b"via"}
)

# Orders to the proxy in front of the gateway, which it obeys in the answers it gets from
# the gateway and not its client: nginx's `X-Accel-*` (`X-Accel-Redirect` serves an
# `internal` location or a file under it; the others set its buffering, rate, caching
# and charset), Apache's (mod_xsendfile) and lighttpd's `X-Sendfile` family (a file from
# the proxy's disk), Envoy's upstream-host signals (`x-envoy-immediate-health-check-fail`
# takes the gateway out of the load balancer). Relayed, an upstream (an LLM provider,
# whatever answers at its address) read the front proxy's internal locations and files
# through the gateway. Never relayed; the gateway sets `X-Accel-Buffering` itself on an
# answer streamed as SSE, NDJSON or a Bedrock event stream (layers/walker/stream.py).
FRONT_PROXY_RESPONSE_HEADERS = frozenset(
    {
        b"x-accel-redirect",
        b"x-accel-buffering",
        b"x-accel-limit-rate",
        b"x-accel-expires",
        b"x-accel-charset",
        b"x-sendfile",
        b"x-sendfile2",
        b"x-lighttpd-send-file",
        b"x-envoy-immediate-health-check-fail",
        b"x-envoy-degraded",
        b"x-envoy-ratelimited",
        b"x-envoy-overloaded",
        b"x-envoy-upstream-canary",
    }
)


# What a provider answers about the account a request was billed to: the organization and
# project behind the key. When that key is the gateway's (injected), they are the
# operator's ids, not the caller's to see (the caller's own copies are stripped on the way
# in: `openai-organization` / `openai-project` in DEFAULT_STRIP_HEADERS). The rate-limit
# fields (`x-ratelimit-*`) are kept: SDKs and callers pace themselves by them.
ACCOUNT_RESPONSE_HEADERS = frozenset(
    {b"openai-organization", b"openai-project", b"anthropic-organization-id"}
)
# An upstream's cross-origin answer: providers answer browsers with
# `Access-Control-Allow-Origin: *` (OpenAI's, OpenRouter's, Groq's APIs), since there a
# page can only spend a key it holds itself. Through the gateway the key is the
# operator's: relayed, any web page its callers' browsers open (a page on the internet
# reaching a gateway on localhost or the office network) could call it, the preflight
# answered by the upstream too, and read the answers, spending the operator's key. Not
# relayed when the gateway injected its credential; a host that serves browsers sets its
# own policy in front (Starlette's CORSMiddleware, README).
CROSS_ORIGIN_RESPONSE_HEADERS = frozenset(
    {
        b"access-control-allow-origin",
        b"access-control-allow-credentials",
        b"access-control-allow-headers",
        b"access-control-allow-methods",
        b"access-control-allow-private-network",
        b"access-control-expose-headers",
        b"access-control-max-age",
    }
)


# What an upstream says about its own origin rather than about the answer: cookies, the
# order to clear site data, HSTS, alternative services, network-error reporting. A browser
# applies them to the origin it reached, the gateway's (which a host app shares): the
# caller's `cookie` never reaches an upstream, so a cookie set here can only overwrite the
# host's own (a session fixed); `clear-site-data` logs the host's users out; HSTS with
# includeSubDomains pins the gateway's host and its subdomains to https; `alt-svc` sends
# browsers elsewhere for the gateway's origin; NEL reports the origin's failed requests,
# URLs included, to the upstream's collector. Providers answer these about their own origin
# (OpenAI: Cloudflare's `set-cookie`, `strict-transport-security: ...; includeSubDomains;
# preload`, `alt-svc: h3=":443"`). Not relayed when the gateway injected its credential.
ORIGIN_STATE_RESPONSE_HEADERS = frozenset(
    {
        b"set-cookie",
        b"set-cookie2",
        b"clear-site-data",
        b"strict-transport-security",
        b"alt-svc",
        b"nel",
        b"report-to",
        b"reporting-endpoints",
    }
)


def forwardable_response_headers(
    headers: Iterable[tuple[bytes, bytes]], *, status: int = 200, injected: bool = False
) -> Headers:
    """Upstream response headers the client may see: no hop-by-hop fields, no `x-gateway-*`
    (an upstream must not be able to forge the gateway's own headers), not the
    upstream's `date` / `server` (the ASGI server sends its own), nor what names the
    software and proxies behind it (DEPLOYMENT_RESPONSE_HEADERS), nor orders to the proxy
    in front of the gateway (FRONT_PROXY_RESPONSE_HEADERS). `injected` (the gateway
    sent its own credential on this attempt): not the account ids it answers about that
    credential either (ACCOUNT_RESPONSE_HEADERS), nor its cross-origin permissions
    (CROSS_ORIGIN_RESPONSE_HEADERS), nor what it says about its own origin
    (ORIGIN_STATE_RESPONSE_HEADERS), filtered in the same pass, at no cost.

    The framing is the gateway's own: `transfer-encoding` never passes (the engines
    de-chunk), a `content-length` only where it is exact, i.e. a body-carrying status and
    a head without `transfer-encoding` (the engines refuse contradictory heads before
    this, `upstream.base.check_response_head`, and end a body that falls short of it as
    aborted). A 204 or 304 goes out with no length at all."""
    lowered = [(name.lower(), value) for name, value in headers]
    # No length beside a transfer coding (the engine de-chunks: the length would be stale),
    # and none on a status that has no body.
    no_length = status in _NO_BODY_STATUSES
    if not no_length:
        for name, _ in lowered:
            if name == b"transfer-encoding":
                no_length = True
                break
    return _kept(
        lowered,
        _NEVER_RELAYED[injected, no_length],
        frozenset(),
        kept_if_listed=_DESCRIBES_THE_BODY,
    )


# What a Connection or Trailer field naming it does not remove from a relayed head: the
# coding of the bytes the relay sends as they came (RFC 9110 §7.6.1: a field meant for
# every recipient is never a connection option). Dropped, a gzip body went to the caller
# unlabelled (binary where it expected JSON) while the meter read it decoded.
_DESCRIBES_THE_BODY = frozenset({b"content-encoding"})


_NO_BODY_STATUSES = frozenset({204, 304})


_NEVER_FORWARDED = (
    CREDENTIAL_HEADERS | HOP_BY_HOP_HEADERS | RECOMPUTED_HEADERS | PATH_OVERRIDE_HEADERS
)
# By (injected, no_length): one precomputed set each, so choosing costs one lookup.
_NEVER_RELAYED = {
    (injected, no_length): HOP_BY_HOP_HEADERS
    | SERVER_OWNED_RESPONSE_HEADERS
    | DEPLOYMENT_RESPONSE_HEADERS
    | FRONT_PROXY_RESPONSE_HEADERS
    | (
        ACCOUNT_RESPONSE_HEADERS | CROSS_ORIGIN_RESPONSE_HEADERS | ORIGIN_STATE_RESPONSE_HEADERS
        if injected
        else frozenset()
    )
    | ({b"content-length"} if no_length else frozenset())
    for injected in (False, True)
    for no_length in (False, True)
}


def _kept(
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
        canonical = name.replace(b"_", b"-")
        if (
            canonical in dropped
            or canonical in also
            or canonical in named
            or canonical.startswith(GATEWAY_HEADER_PREFIX)
        ):
            continue
        kept.append((name, value))
    return kept


_NONE_NAMED: frozenset[bytes] = frozenset()


# --- upstream addresses -------------------------------------------------------------------

# The one list of addresses refused whatever the allowlist (load, store, proxies, and the
# engines' connect-time guard all come through `is_always_refused`). Cloud metadata and
# credential endpoints, as each vendor documents them:
_ALWAYS_REFUSED = (
    # IPv4 link-local: the metadata service of AWS, Azure (IMDS), GCP, Oracle, DigitalOcean,
    # OpenStack, Hetzner, Akamai/Linode at 169.254.169.254, Tencent's 169.254.0.23, ECS task
    # credentials 169.254.170.2, EKS Pod Identity 169.254.170.23, Scaleway's 169.254.42.42.
    ipaddress.ip_network("169.254.0.0/16"),
    # IPv6 link-local: OpenStack's metadata over IPv6 is fe80::a9fe:a9fe.
    ipaddress.ip_network("fe80::/10"),
    # AWS IMDS over IPv6:
    # docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-retrieval.html
    ipaddress.ip_network("fd00:ec2::254/128"),
    # AWS EKS Pod Identity Agent over IPv6 (hands out IAM credentials):
    # docs.aws.amazon.com/eks/latest/userguide/pod-id-agent-setup.html
    ipaddress.ip_network("fd00:ec2::23/128"),
    # GCP metadata server on IPv6-only VMs:
    # cloud.google.com/compute/docs/metadata/querying-metadata
    ipaddress.ip_network("fd20:ce::254/128"),
    # Azure WireServer (VM agent, extension settings and certificates; a public address
    # Microsoft owns): learn.microsoft.com/azure/virtual-network/what-is-ip-address-168-63-129-16
    ipaddress.ip_network("168.63.129.16/32"),
    # Alibaba Cloud metadata: alibabacloud.com/help/en/ecs/user-guide/view-instance-metadata;
    # over IPv6 fd00:100::100:200 (cloud-init's AliYun datasource, canonical/cloud-init#6893).
    ipaddress.ip_network("100.100.100.200/32"),
    ipaddress.ip_network("fd00:100::100:200/128"),
    # Oracle Cloud: IMDS over IPv6 (IPv4: docs.oracle.com/iaas/Content/Compute/Tasks/
    # gettingmetadata.htm; IPv6: the OCI SDK's DEFAULT_METADATA_URL_BASE_IPV6, github.com/
    # oracle/oci-python-sdk, src/oci/auth/signers/instance_principals_security_token_signer.py),
    # and the metadata address of Oracle Cloud Classic / Cloud@Customer (docs.oracle.com/en/
    # cloud/cloud-at-customer/occ-get-started/retrieve-predefined-instance-metadata.html):
    ipaddress.ip_network("fd00:c1::a9fe:a9fe/128"),
    ipaddress.ip_network("192.0.0.192/32"),
    # Scaleway metadata over IPv6: docs.cloud-init.io/en/latest/reference/datasources/scaleway.html
    ipaddress.ip_network("fd00:42::42/128"),
    # Akamai / Linode metadata over IPv6 (IPv4 169.254.169.254):
    # docs.cloud-init.io/en/latest/reference/datasources/akamai.html
    ipaddress.ip_network("fd00:a9fe:a9fe::1/128"),
    ipaddress.ip_network("0.0.0.0/8"),  # "this network": connects to local services
    ipaddress.ip_network("::/128"),
    # Translation ranges whose IPv4 destination cannot be read off the address: local-use
    # NAT64 (RFC 8215, the prefix and its embedding are the operator's) and Teredo (the
    # client address is obfuscated). The well-known NAT64 prefix 64:ff9b::/96, 6to4 and
    # IPv4-mapped addresses are judged by the IPv4 address they carry (`_embedded_ipv4`).
    ipaddress.ip_network("64:ff9b:1::/48"),
    ipaddress.ip_network("2001::/32"),
)


class UnsafeUpstream(ValueError):
    """An upstream host or address the gateway refuses to contact."""


def parse_ip(host: str) -> IPAddress | None:
    """Parse an IP literal, including the legacy IPv4 forms a resolver accepts
    (decimal `2852039166`, hex `0xa9fea9fe`, octal and short dotted forms) and an IPv4
    literal with a trailing dot (`169.254.169.254.`, the address to URL parsers)."""
    text = host.strip().strip("[]")
    if text.endswith(".") and ":" not in text:
        text = text[:-1]
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        pass
    lowered = text.lower()
    if lowered and all(c in "0123456789abcdefx." for c in lowered) and lowered[0].isdigit():
        try:
            return ipaddress.IPv4Address(socket.inet_aton(lowered))
        except OSError:
            return None
    return None


_EMBEDDING_PREFIXES = frozenset(
    bytes.fromhex(prefix)
    for prefix in (
        "000000000000000000000000",  # ::a.b.c.d (IPv4-compatible)
        "0000000000000000ffff0000",  # ::ffff:0:a.b.c.d (IPv4-translated)
        "0064ff9b0000000000000000",  # 64:ff9b::a.b.c.d (NAT64)
        "0064ff9b0001000000000000",  # 64:ff9b:1::a.b.c.d (local-use NAT64)
    )
)


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.sixtofour is not None:
            return address.sixtofour
        # IPv4-compatible (::a.b.c.d), IPv4-translated (::ffff:0:a.b.c.d, RFC 2765) and
        # NAT64 (64:ff9b::/96, and 64:ff9b:1::/96 of the local-use 64:ff9b:1::/48, RFC
        # 8215) embed the address in the low bits. `::1` (loopback) and `::` are not
        # IPv4-compatible addresses (RFC 4291 §2.5.5.1): read as 0.0.0.1 / 0.0.0.0 they
        # would be refused as "this network".
        if address.is_loopback or address.is_unspecified:
            return None
        packed = address.packed
        if packed[:12] in _EMBEDDING_PREFIXES:
            return ipaddress.IPv4Address(packed[12:])
    return None


def carried_ipv4_network(
    network: ipaddress.IPv4Network | ipaddress.IPv6Network,
) -> ipaddress.IPv4Network | None:
    """The IPv4 network an IPv6 `allow_hosts` entry spells, when every address in it
    carries an IPv4 one (IPv4-mapped `::ffff:127.0.0.1`, NAT64 `64:ff9b::/96`, 6to4
    `2002:a00::/24`...): the allowlist judges such an address by the IPv4 address alone
    (`Allowlist.allows_address`), so the entry as written matches nothing. None for any
    other entry."""
    first = network.network_address
    carried = _embedded_ipv4(first)
    if not isinstance(first, ipaddress.IPv6Address) or carried is None:
        return None
    embedding = 16 if first.sixtofour is not None else 96
    if network.prefixlen < embedding:
        return None
    length = min(32, network.prefixlen - embedding)
    return ipaddress.IPv4Network((carried, length), strict=False)


def is_always_refused(address: IPAddress) -> bool:
    """Link-local and metadata addresses, in every spelling, whatever the allowlist says."""
    candidates: list[IPAddress] = [address]
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        candidates.append(embedded)
    for candidate in candidates:
        for network in _ALWAYS_REFUSED:
            if candidate.version == network.version and candidate in network:
                return True
        if candidate.is_link_local:
            return True
    return False


class Allowlist:
    """`allow_hosts`: exact host names and IP addresses / CIDR networks."""

    def __init__(self, entries: Sequence[str]) -> None:
        names: set[str] = set()
        networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in entries:
            text = entry.strip().lower()
            try:
                networks.append(ipaddress.ip_network(text.strip("[]"), strict=False))
            except ValueError:
                names.add(text.rstrip("."))
        self.names = frozenset(names)
        self.networks = tuple(networks)

    def allows_name(self, host: str) -> bool:
        return host.lower().rstrip(".") in self.names

    def allows_address(self, address: IPAddress, *, via_name: str | None = None) -> bool:
        """An address is allowed when an IP/CIDR entry covers it, or when it was reached
        through an allowlisted name and is a public address (a listed public name must
        not be turned into a door to loopback or private services by its DNS);
        `localhost` may reach loopback."""
        if is_always_refused(address):
            return False
        # An address that carries an IPv4 one (IPv4-mapped, NAT64 64:ff9b::/96, 6to4) is
        # judged by that IPv4 address alone: `::/0` must not open 127.0.0.1 or 10.0.0.0/8
        # through ::ffff:127.0.0.1 or 64:ff9b::a00:5.
        target: IPAddress = _embedded_ipv4(address) or address
        for network in self.networks:
            if target.version == network.version and target in network:
                return True
        if via_name is not None and self.allows_name(via_name):
            if via_name.lower().rstrip(".") == "localhost":
                return target.is_loopback
            return target.is_global
        return False


@lru_cache(maxsize=64)
def _allowlist(entries: tuple[str, ...]) -> Allowlist:
    return Allowlist(entries)


def _not_listed(host: str) -> UnsafeUpstream:
    return UnsafeUpstream(f"host {host!r} is not in allow_hosts: add it to [gateway] allow_hosts")


def check_upstream_host(host: str, allow_hosts: Sequence[str], *, resolve: bool = True) -> None:
    """Load-time / store-write check of an upstream host. Raises UnsafeUpstream."""
    allow = _allowlist(tuple(allow_hosts))
    literal = parse_ip(host)
    if literal is not None:
        if is_always_refused(literal):
            raise UnsafeUpstream(f"host {host!r} is a link-local / metadata address")
        if not allow.allows_address(literal) and not allow.allows_name(host):
            raise _not_listed(host)
        return
    if not allow.allows_name(host) and not allow.networks:
        raise _not_listed(host)
    if not resolve:
        if not allow.allows_name(host):
            raise _not_listed(host)
        return
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        if allow.allows_name(host):
            return  # unresolvable now; the connect-time check still applies
        raise _not_listed(host) from None
    addresses = {ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos}
    for address in addresses:
        if is_always_refused(address):
            raise UnsafeUpstream(f"host {host!r} resolves to a link-local / metadata address")
    if not any(allow.allows_address(a, via_name=host) for a in addresses):
        if allow.allows_name(host):
            # Listed, but a listed name admits public addresses only: say so, and what
            # to add, rather than "not in allow_hosts" about a host that is. The addresses
            # are not named: a refusal also answers callers (503 config_error).
            raise UnsafeUpstream(
                f"host {host!r} is in allow_hosts, but resolves only to non-public "
                "(loopback, private or reserved) addresses, which a listed name does not "
                "admit; add the address or its network (CIDR) to allow_hosts"
            )
        raise _not_listed(host)


def check_connect_addresses(
    host: str, addresses: Sequence[str], allow_hosts: Sequence[str]
) -> list[str]:
    """Connect-time check: of the resolved addresses keep the allowed ones, in order.
    Raises UnsafeUpstream when none is left. With no allowlist at all (a client the Python
    API made without one, `make_client(engine)`; the config loader refuses an empty
    `allow_hosts`) every address is kept but the always-refused ones: the metadata guard
    holds whatever the allowlist, none included."""
    if not allow_hosts:
        kept = [
            text
            for text in addresses
            if not is_always_refused(ipaddress.ip_address(text.split("%", 1)[0]))
        ]
        if not kept:
            raise UnsafeUpstream(f"host {host!r} resolved only to link-local / metadata addresses")
        return kept
    allow = _allowlist(tuple(allow_hosts))
    kept = []
    for text in addresses:
        address = ipaddress.ip_address(text.split("%", 1)[0])
        if allow.allows_address(address, via_name=host) or (
            parse_ip(host) == address and allow.allows_name(host) and not is_always_refused(address)
        ):
            kept.append(text)
    if not kept:
        raise UnsafeUpstream(f"host {host!r} resolved only to addresses outside allow_hosts")
    return kept
