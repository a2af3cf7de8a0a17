"""Which endpoint a URL names, however it is spelled (SPEC §12's "origin"): scheme, host
(case, default port, trailing dot, and literal or loopback spellings of one address) and
path in one spelling each. Two paths behind one proxy host are two upstreams."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

_DEFAULT_PORTS = {"http": 80, "https": 443}


def origin(url: str) -> tuple[str, str, int, str]:
    """The endpoint a URL names, however spelled: scheme and host lower case, the default
    port made explicit, no trailing dot on the host, and the path in one spelling
    (`_same_path`)."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        port = _DEFAULT_PORTS.get(scheme, 0)
    host = _same_host((parts.hostname or "").lower().rstrip("."))
    return (scheme, host, port, _same_path(parts.path))


_PERCENT = re.compile(r"%([0-9A-Fa-f]{2})")
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


def _decode_unreserved(match: re.Match[str]) -> str:
    char = chr(int(match.group(1), 16))
    return char if char in _UNRESERVED else f"%{match.group(1).upper()}"


def _same_path(path: str) -> str:
    """One spelling per path, as a server reads it (RFC 3986 §6.2.2): percent-encoded
    unreserved characters decoded (`/%61pi` is `/api`, `/%2e` is `/.`), other escapes in
    upper case, dot segments removed (`/x/..` is `/`), empty segments and a trailing slash
    dropped. Letter case is kept: `/v1` and `/V1` stay two paths."""
    kept: list[str] = []
    for segment in _PERCENT.sub(_decode_unreserved, path).split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if kept:
                kept.pop()
            continue
        kept.append(segment)
    return "/" + "/".join(kept) if kept else ""


def _same_host(host: str) -> str:
    """One spelling per address (SPEC §12): an IP literal in its canonical form (an
    IPv4-mapped IPv6 address as the IPv4 one), and `localhost`, 127.0.0.1 and ::1 as the
    one loopback host they name on this machine."""
    if host == "localhost" or host.endswith(".localhost"):
        return "loopback"
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address in (ipaddress.IPv4Address("127.0.0.1"), ipaddress.IPv6Address("::1")):
        return "loopback"
    return str(address)


def same_endpoint(a: str, b: str) -> bool:
    return origin(a) == origin(b)
