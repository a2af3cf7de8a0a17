"""Upstream clients: the interface and the aiohttp (default) and httpx engines."""

from __future__ import annotations

import os

from fallback_mw.upstream.base import (
    FailureKind,
    Timeouts,
    UpstreamClient,
    UpstreamError,
    UpstreamRequest,
    UpstreamResponse,
)


def make_client(
    engine: str,
    *,
    allow_hosts: tuple[str, ...] = (),
    ca_file: str | os.PathLike[str] | None = None,
) -> UpstreamClient:
    """The engine's client; `ca_file` is the gateway-wide CA bundle (an upstream's own, on
    its requests, wins). Its connect-time guard checks every address against `allow_hosts`;
    with none given, it refuses the link-local / metadata addresses alone (SPEC §3: those
    whatever the allowlist)."""
    if engine == "httpx":
        from fallback_mw.upstream.httpx_engine import HttpxClient

        return HttpxClient(allow_hosts=allow_hosts, ca_file=ca_file)
    from fallback_mw.upstream.aiohttp_engine import AiohttpClient

    return AiohttpClient(allow_hosts=allow_hosts, ca_file=ca_file)


__all__ = [
    "FailureKind",
    "Timeouts",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamRequest",
    "UpstreamResponse",
    "make_client",
]
