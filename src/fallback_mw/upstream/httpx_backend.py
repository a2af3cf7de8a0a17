"""The httpx engine's connect-time guard: an httpcore network backend that connects only to
addresses the allowlist allows (httpcore comes with the httpx extra)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import httpcore

from fallback_mw.upstream.guard import UnsafeAddressError, resolve_checked_async


class GuardedNetworkBackend(httpcore.AsyncNetworkBackend):
    """httpcore network backend for the httpx engine: resolves the host once, checks every
    address, and connects to a checked address (an IP, so nothing below looks the name up
    again). TLS still verifies and sends SNI for the original host: httpcore passes the
    origin's host name to start_tls separately."""

    def __init__(
        self, allow_hosts: Sequence[str], inner: httpcore.AsyncNetworkBackend | None = None
    ) -> None:
        self._allow_hosts = tuple(allow_hosts)
        self._inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = await resolve_checked_async(host, port, self._allow_hosts)
        options = list(socket_options) if socket_options is not None else None
        last_error: Exception | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address,
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=options,
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout, OSError) as exc:
                last_error = exc
        assert last_error is not None
        raise last_error

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise UnsafeAddressError("unix sockets are not upstreams")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)
