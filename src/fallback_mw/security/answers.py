"""An upstream's response head as relayed to the caller: what the server in front owns, what
names the software and proxies behind, orders to a front proxy, the account a key was billed
to, cross-origin grants and origin state given on the operator's key: never relayed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from fallback_mw.security.fields import HOP_BY_HOP_HEADERS, Headers, kept_fields, name_forms

# The server in front of the client adds its own `date` and `server`; the upstream's copies
# would be duplicates, and its `server` names the provider's software to every caller.
SERVER_OWNED_RESPONSE_HEADERS: Final = frozenset({b"date", b"server"})


# What an upstream says about the software and the proxies behind it, to every caller:
# the frameworks' banners (OWASP's list of fields to remove) and `via`, whose entries name
# the proxies it passed through and their hosts and ports (RFC 9110 §7.6.3: an intermediary
# at a network's edge should not forward the names of the hosts behind it; a gateway may
# leave `via` off the responses it forwards).
DEPLOYMENT_RESPONSE_HEADERS: Final = frozenset(
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
FRONT_PROXY_RESPONSE_HEADERS: Final = frozenset(
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
ACCOUNT_RESPONSE_HEADERS: Final = frozenset(
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
CROSS_ORIGIN_RESPONSE_HEADERS: Final = frozenset(
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
ORIGIN_STATE_RESPONSE_HEADERS: Final = frozenset(
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
    lowered = [(name_forms(name)[0], value) for name, value in headers]
    # No length beside a transfer coding (the engine de-chunks: the length would be stale),
    # and none on a status that has no body.
    no_length = status in _NO_BODY_STATUSES
    if not no_length:
        for name, _ in lowered:
            if name == b"transfer-encoding":
                no_length = True
                break
    return kept_fields(
        lowered,
        _NEVER_RELAYED[injected, no_length],
        frozenset(),
        kept_if_listed=_DESCRIBES_THE_BODY,
    )


# What a Connection or Trailer field naming it does not remove from a relayed head: the
# coding of the bytes the relay sends as they came (RFC 9110 §7.6.1: a field meant for
# every recipient is never a connection option). Dropped, a gzip body went to the caller
# unlabelled (binary where it expected JSON) while the meter read it decoded.
_DESCRIBES_THE_BODY: Final = frozenset({b"content-encoding"})


_NO_BODY_STATUSES: Final = frozenset({204, 304})


# By (injected, no_length): one precomputed set each, so choosing costs one lookup.
_NEVER_RELAYED: Final = {
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
