"""Query strings as the servers that read them loosely do: the credential keys stripped
(`strip_query_keys`, also from URLs a header carries), and the methods a `_method` parameter
names."""

from __future__ import annotations

from typing import Final
from urllib.parse import unquote_to_bytes

from fallback_mw.security.values import PERCENT, SEMICOLON

DEFAULT_STRIP_QUERY_KEYS: Final = (
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
        if SEMICOLON in part:
            pieces = [p for p in part.split(b";") if not _names_a_key(p, keys)]
            if pieces:
                kept.append(b";".join(pieces))
        elif not _names_a_key(part, keys):
            kept.append(part)
    return b"&".join(kept)


def _names_a_key(parameter: bytes, keys: frozenset[bytes]) -> bool:
    return canonical_query_key(parameter.split(b"=", 1)[0]) in keys


NO_METHODS: Final[frozenset[str]] = frozenset()


_METHOD_PARAMETER: Final = b"_method"


def query_override_methods(query: bytes, method: str) -> frozenset[str]:
    """The methods other than `method` that a `_method` query parameter names: Symfony
    (so Laravel, which turns it on), Express's method-override with a query getter and
    Rack read `POST /x?_method=DELETE` as a DELETE. The name is compared as PHP reads it
    (`canonical_query_key`: `%5Fmethod`, `.method`); `&` and `;` separate parameters.
    Most queries name no such parameter: any spelling of `_method` holds `ethod` or a `%`,
    so two searches answer for them (the query string of nearly every request)."""
    if not query or (query.find(b"ethod") < 0 and PERCENT not in query):
        return NO_METHODS
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
    return frozenset(named) if named else NO_METHODS


_URL_SCHEMES: Final = (b"http://", b"https://")


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
