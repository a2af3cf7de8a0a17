"""An upstream's URLs of its own in an answer's head, as the caller reaches them: a
`Location` (a redirect's, a 201's, a 202's job to poll), a 201's / 202's
`Content-Location` and a `Link` field's targets that name the upstream (built from the
`Host` the gateway sent) are rewritten to the gateway's URL below its mount, as nginx's
`proxy_redirect default` does; anything else is relayed as it came. The relay
(layers/walker/stream.py) applies it to each answer it commits."""

from __future__ import annotations

import contextlib
import re
from functools import lru_cache
from typing import Final
from urllib.parse import SplitResult, urlsplit

from fallback_mw.endpoints import origin


def located_here(
    headers: list[tuple[bytes, bytes]], upstream_url: str, mount: str
) -> list[tuple[bytes, bytes]]:
    """A `Location` (a redirect's, a 201's, a 202's job to poll) or a 201's / 202's
    `Content-Location` naming the upstream's own URL, as the caller reaches that resource
    (`_here`). The redirect is still never followed; any other `Location` is relayed as it
    came."""
    for index, (field, value) in enumerate(headers):
        if field != b"location" and field != b"content-location":
            continue
        here = _here(value.decode("latin-1").strip(), upstream_url, mount)
        if here is not None:
            headers = headers.copy()
            headers[index] = (field, here.encode("latin-1"))
    return headers


# A `Link` field's targets (RFC 8288: `<URI-Reference>; params`, comma-separated).
_LINK_TARGET: Final = re.compile(r"<([^<>]*)>")


def linked_here(
    headers: list[tuple[bytes, bytes]], upstream_url: str, mount: str
) -> list[tuple[bytes, bytes]]:
    """The targets of a `Link` field (a paginated API's `rel="next"`, built from the Host
    the gateway sent, as a `Location` is) naming the upstream's own URL, as the caller
    reaches them (`_here`); every other target and parameter as it came."""
    for index, (field, value) in enumerate(headers):
        if field != b"link":
            continue
        text = value.decode("latin-1")

        def target(found: re.Match[str]) -> str:
            here = _here(found.group(1).strip(), upstream_url, mount)
            return found.group(0) if here is None else f"<{here}>"

        linked = _LINK_TARGET.sub(target, text)
        if linked != text:
            headers = headers.copy()
            headers[index] = (field, linked.encode("latin-1"))
    return headers


def _here(text: str, upstream_url: str, mount: str) -> str | None:
    """A URL naming the upstream's own (`text`, from a response field), as the caller
    reaches that resource: through the gateway (`/v1/items/`, below its `mount`), as
    nginx's `proxy_redirect default` rewrites it. The upstream builds such a URL from the
    `Host` the gateway sent (its own: Starlette's trailing-slash redirects, a 201's new
    resource, a paginated list's next page), and a caller following it went around the
    gateway, to an internal host it may not reach, without the credential the gateway
    injects. A path alone (Django's `APPEND_SLASH` redirect) is the upstream's path too:
    below the upstream URL's own path, it is moved below the mount. Its dot segments are
    resolved first (`/api/../admin` is not below `/api`). None: it names anything else,
    and is relayed as it came."""
    try:
        parts = urlsplit(text)
    except ValueError:  # `http://[x`: no URL, for the caller's client either
        return None  # as it came
    upstream, base_path = _upstream_parts(upstream_url)
    path = _resolved(parts.path)
    if parts.scheme or parts.netloc:
        if "@" in parts.netloc or not _same_origin(text, parts, upstream):
            return None
    elif text[:1] != "/" or text[1:2] in ("/", "\\") or not (base_path or mount):
        # A path relative to the request's, or one the caller resolves as the
        # upstream meant it (no path of the upstream's, no mount): as it came.
        return None
    if base_path:
        if path != base_path and not path.startswith(base_path + "/"):
            return None
        path = path[len(base_path) :]
    here = (mount + path) if path else (mount or "/")
    if here[:1] != "/" or here[1:2] in ("/", "\\"):
        return None  # `//host/x` (or `/\host/x`) would name another host
    return (
        here
        + ("?" + parts.query if parts.query else "")
        + ("#" + parts.fragment if parts.fragment else "")
    )


@lru_cache(maxsize=64)
def _upstream_parts(upstream_url: str) -> tuple[tuple[str, str, int], str]:
    """An upstream URL's origin (scheme, host, port) and its own path: once per URL, not
    once per target of a `Link` field."""
    return origin(upstream_url)[:3], urlsplit(upstream_url).path.rstrip("/")


def _same_origin(text: str, parts: SplitResult, upstream: tuple[str, str, int]) -> bool:
    """Whether URL `text` (split: `parts`) names the upstream's origin. The scheme and an
    explicit port are compared first: a hostile upstream's `Link` of thousands of targets
    (`<//a>, <//b>, ...`, 100 KiB of head) cost an IP-literal parse each, a third of a
    second of the event loop per answer, every other request waiting."""
    if parts.scheme.lower() != upstream[0]:
        return False
    with contextlib.suppress(ValueError):  # an unreadable port: `origin` reads it
        if parts.port is not None and parts.port != upstream[2]:
            return False
    return origin(text)[:3] == upstream


# A path's segment separators and its dot segments as a browser's URL parser (WHATWG)
# reads them: a backslash is a `/`, `%2e` a `.` (RFC 3986 §2.3: the same segment).
_SEPARATOR: Final = re.compile(r"[/\\]")
_DOT: Final = frozenset({".", "%2e"})
_DOT_DOT: Final = frozenset({"..", ".%2e", "%2e.", "%2e%2e"})


def _resolved(path: str) -> str:
    """`path` with its dot segments resolved (RFC 3986 §5.2.4), as the caller's client
    would resolve the rewritten URL; as it is when it has none (the common case)."""
    if "." not in path and "%" not in path:
        return path
    segments = _SEPARATOR.split(path)
    if not any(segment.lower() in _DOT or segment.lower() in _DOT_DOT for segment in segments):
        return path
    kept: list[str] = []
    for segment in segments[1:]:  # a path from `/`: the first is empty
        lowered = segment.lower()
        if lowered in _DOT_DOT:
            if kept:
                kept.pop()
        elif lowered not in _DOT:
            kept.append(segment)
    if segments[-1].lower() in _DOT or segments[-1].lower() in _DOT_DOT:
        kept.append("")  # `/a/b/..` is `/a/`
    return "/" + "/".join(kept)
