"""`serve` refuses an upstream (or an egress proxy) that is the gateway itself: a URL that
connects to serve's own listening socket. Each request the gateway routed there came back
in as a new request for the same route, and went out again: one caller's request became
an endless chain of them (about 2,000 a second on a laptop) that went on after the caller
had its 504, until the process was stopped."""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from fallback_mw.cli.host_addresses import reaches, resolved
from fallback_mw.config.upstream import UpstreamConfig
from fallback_mw.store.routes import MergedRoutes


def reaches_listener(url: str, bind_host: str, bind_port: int) -> bool:
    """Whether a connection to `url`'s host and port lands on a socket serve bound to
    `bind_host`:`bind_port` (`host_addresses.reaches`)."""
    parts = urlsplit(url)
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower(), 0)
    except ValueError:
        return False
    if port != bind_port or not parts.hostname:
        return False
    return reaches(resolved(parts.hostname), bind_host)


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
