"""Upstream clients: the interface and the aiohttp (default) and httpx engines."""

from __future__ import annotations

from fallback_mw.upstream.base import (
    FailureKind,
    Timeouts,
    UpstreamClient,
    UpstreamError,
    UpstreamRequest,
    UpstreamResponse,
)


def make_client(engine: str, *, allow_hosts: tuple[str, ...] = ()) -> UpstreamClient:
    if engine == "httpx":
        from fallback_mw.upstream.httpx_engine import HttpxClient

        return HttpxClient(allow_hosts=allow_hosts)
    from fallback_mw.upstream.aiohttp_engine import AiohttpClient

    return AiohttpClient(allow_hosts=allow_hosts)


__all__ = [
    "FailureKind",
    "Timeouts",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamRequest",
    "UpstreamResponse",
    "make_client",
]
