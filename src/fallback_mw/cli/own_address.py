"""`serve` refuses an upstream (or an egress proxy) of the config file that is the gateway
itself: a URL that connects to serve's own listening socket. Each request the gateway
routed there came back in as a new request for the same route (before the walker's Via
check, layers/walker/via.py, it went out again: an endless chain of them, about 2,000 a
second, after the caller had its 504; now the second pass answers 508 loop_detected).

A route of the store is only warned about: a running gateway loads it without this check
(the admin command does not know where serve listens) and answers its requests 508, the
other routes served; a refused start for the same row put every route down at the next
restart or deploy."""

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


def upstream_at_own_address(
    merged: MergedRoutes, bind_host: str, bind_port: int, *, stored: bool = False
) -> str | None:
    """The refusal (of `stored` routes: the warning), when a routed upstream's URL (without
    a base path: each request would come back to the route it matched) or its egress proxy
    is serve's own address; None otherwise (and with `--port 0`, whose port no
    configuration can name)."""
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
                here = (
                    f"upstream {name!r}: its {key} {url} is the gateway's own address "
                    f"(--host {bind_host} --port {bind_port}): each request sent there "
                )
                if stored:
                    return (
                        f"{here}comes back in and is answered 508 loop_detected; point the "
                        "store's route at the upstream service (fallback-mw routes)"
                    )
                return (
                    f"{here}would come back in and be answered 508 loop_detected; point it "
                    "at the upstream service, or serve on another port"
                )
    return None
