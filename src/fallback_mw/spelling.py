"""The path an upstream gets when the caller's percent-encoding is kept: a segment's
escaped reserved characters (`group%2Fapp`, `a%3Bb`) stay as the caller wrote them, only
unreserved ones are decoded, and a spelling a dot segment could climb with is refused (the
decoded path goes instead). The resolver asks it for a path with escapes (routing.py
normalises the path every route matches on)."""

from __future__ import annotations

import re
from typing import Final
from urllib.parse import quote, unquote

# What a forwarded path leaves unquoted: RFC 3986 `pchar` and `/`.
PATH_SAFE: Final = "/:@!$&'()*+,;=-._~"
_UNRESERVED: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_ESCAPE: Final = re.compile(r"%([0-9A-Fa-f]{2})")


def caller_spelling(raw_path: str, prefix: str) -> str | None:
    """The normalised path as the upstream gets it, keeping the caller's percent-encoding
    of reserved characters: `/v1/projects/group%2Fapp` (a GitLab project id, an object
    key) is one segment, and `a%3Bb` a file name with a `;`, not a path parameter. Decoded,
    either became a separator (`/v1/projects/group/app`, another resource) or a parameter
    a servlet container drops. Only unreserved characters are decoded (`%7E` is `~`: RFC
    3986 §6.2.2.2); dot and empty segments are resolved as `normalise_path` does.

    None (forward the decoded `normalise_path` instead, as before) when the spelling is
    not safe to keep: an encoded separator with a dot segment inside (`..%2F..`, which an
    upstream that decodes it would climb with) or after it (`a%2Fb/..`), or a spelling
    that does not itself start with the route's `prefix` (`/v1%2Fx` routed to `/v1/`).
    Decoded once, a spelling returned is the path the gateway routed on."""
    raw_path = raw_path.split("#", 1)[0]
    if "\\" in raw_path:
        return None
    segments: list[str] = []
    for raw in raw_path.split("/"):
        try:
            decoded = unquote(raw, errors="strict") if "%" in raw else raw
        except UnicodeDecodeError:
            return None
        if "\x00" in decoded:
            return None
        if "/" in decoded or "\\" in decoded:
            pieces = decoded.replace("\\", "/").split("/")
            if any(piece.split(";", 1)[0] in (".", "..") for piece in pieces):
                return None
            segments.append(_spelled(raw))
            continue
        dot = decoded.split(";", 1)[0]
        if raw == "" or dot == ".":
            continue
        if dot == "..":
            # A `..` after an encoded separator: the routed path climbed half of that
            # segment (`a%2Fb/..` is `/a`), this spelling would climb all of it.
            if not segments or "%2F" in segments[-1] or "%5C" in segments[-1]:
                return None
            segments.pop()
            continue
        segments.append(_spelled(raw))
    last = raw_path.rsplit("/", 1)[-1]
    path = "/" + "/".join(segments)
    if path != "/" and (raw_path.endswith("/") or unquote(last).split(";", 1)[0] in (".", "..")):
        path += "/"
    quoted_prefix = quote(prefix, safe=PATH_SAFE)
    if path.startswith(quoted_prefix) or (
        quoted_prefix.endswith("/") and path == quoted_prefix[:-1]
    ):
        return path
    return None


def _spelled(segment: str) -> str:
    """`segment` with its escapes of unreserved characters decoded, its other escapes in
    upper case, and what is not a `pchar` quoted (a bare `%` as `%25`)."""
    parts: list[str] = []
    start = 0
    for escape in _ESCAPE.finditer(segment):
        parts.append(quote(segment[start : escape.start()], safe=PATH_SAFE))
        char = chr(int(escape.group(1), 16))
        parts.append(char if char in _UNRESERVED else "%" + escape.group(1).upper())
        start = escape.end()
    parts.append(quote(segment[start:], safe=PATH_SAFE))
    return "".join(parts)
