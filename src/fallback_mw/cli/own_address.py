"""`serve` refuses an upstream (or an egress proxy) that is the gateway itself: a URL that
connects to serve's own listening socket. Each request the gateway routed there came back
in as a new request for the same route, and went out again: one caller's request became
an endless chain of them (about 2,000 a second on a laptop) that went on after the caller
had its 504, until the process was stopped."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from fallback_mw.cli.serve_options import listen_family
from fallback_mw.config.upstream import UpstreamConfig
from fallback_mw.security.addresses import IPAddress, parse_ip
from fallback_mw.store.routes import MergedRoutes


def _address(text: str) -> IPAddress | None:
    """An IP literal as the address a connection goes to: an IPv4-mapped IPv6 one is the
    IPv4 address (the kernel connects to it as such)."""
    address = parse_ip(text)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _resolved(host: str, family: int = socket.AF_UNSPEC) -> list[IPAddress]:
    """The addresses a name connects to (an IP literal: itself); none when it does not
    resolve (the connect-time guard and the engines say so on the first request)."""
    literal = _address(host)
    if literal is not None:
        return [literal]
    try:
        infos = socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    found = (_address(str(info[4][0]).split("%", 1)[0]) for info in infos)
    return [address for address in found if address is not None]


def _is_this_machine(address: IPAddress) -> bool:
    """Whether `address` is one of this machine's own (loopback, the wildcard, an interface's
    address): only those can be bound, so a bind to port 0 says it without a packet sent."""
    if address.is_loopback or address.is_unspecified:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((str(address), 0))
        return True
    return False


def reaches_listener(url: str, bind_host: str, bind_port: int) -> bool:
    """Whether a connection to `url`'s host and port lands on a socket serve bound to
    `bind_host`:`bind_port` (an IP literal, a wildcard, or a name such as `localhost`, bound
    in the family `listen_socket` binds it in: `listen_family`). A wildcard `::` takes IPv4
    connections too (dual stack, as serve binds it); `0.0.0.0` IPv4 ones only."""
    parts = urlsplit(url)
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower(), 0)
    except ValueError:
        return False
    if port != bind_port or not parts.hostname:
        return False
    six = listen_family(bind_host) == socket.AF_INET6
    bound = _resolved(bind_host, socket.AF_INET6 if six else socket.AF_INET)
    for target in _resolved(parts.hostname):
        for address in bound:
            if address.is_unspecified:
                if (six or target.version == 4) and _is_this_machine(target):
                    return True
            elif target == address:
                return True
    return False


def _used(merged: MergedRoutes) -> Iterable[tuple[str, UpstreamConfig]]:
    names = dict.fromkeys(
        name
        for route in merged.routes
        for name in (*route.plan, *((route.shadow,) if route.shadow else ()))
    )
    return ((name, merged.upstreams[name]) for name in names if name in merged.upstreams)


def upstream_at_own_address(merged: MergedRoutes, bind_host: str, bind_port: int) -> str | None:
    """The refusal, when a routed upstream's URL (without a base path: each request would
    come back to the route it matched) or its egress proxy is serve's own address; None
    otherwise (and with `--port 0`, whose port no configuration can name)."""
    if bind_port == 0:
        return None
    for name, upstream in _used(merged):
        for key, url in (("url", upstream.url), ("proxy", upstream.proxy)):
            if key == "url" and url is not None and urlsplit(url).path.strip("/"):
                # A base path (`http://localhost:8000/pool`) sends each request to another
                # route of this gateway: a chain, not a loop (a request that does come
                # back to a route it passed is the walker's 508, layers/walker/via.py).
                continue
            if url is not None and reaches_listener(url, bind_host, bind_port):
                return (
                    f"upstream {name!r}: its {key} {url} is the gateway's own address "
                    f"(--host {bind_host} --port {bind_port}): each request sent there would "
                    "come back in and be routed to it again, for ever; point it at the "
                    "upstream service, or serve on another port"
                )
    return None
