"""Connect-time address checks shared by the engines: resolve once, check every address,
connect only to a checked address (no second lookup). The httpx engine's network backend
is in httpx_backend.py (httpx is an extra)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from fallback_mw.security.addresses import UnsafeUpstream, check_connect_addresses, parse_ip


class UnsafeAddressError(OSError):
    """Raised from the resolver so the engines' error mapping sees it as a refusal."""


def check_literal_host(url: str, allow_hosts: Sequence[str]) -> None:
    """Hosts written as IP literals skip the resolver; check them here (with no allowlist,
    against the always-refused addresses alone: `check_connect_addresses`)."""
    host = urlsplit(url).hostname or ""
    address = parse_ip(host)
    if address is not None:
        try:
            check_connect_addresses(host, [str(address)], allow_hosts)
        except UnsafeUpstream as exc:
            raise UnsafeAddressError(str(exc)) from None


class LiteralChecks:
    """`check_literal_host` for an engine, once per key: the check is pure, so a URL's
    host (or a proxy URL, keyed whole) passed once passes again. At most 4096 keys are
    remembered; past that each is checked every time."""

    def __init__(self, allow_hosts: Sequence[str]) -> None:
        self._allow_hosts = tuple(allow_hosts)
        self._checked: set[str] = set()

    def check(self, url: str, *, whole: bool = False) -> None:
        """Raises UnsafeAddressError for a literal the allowlist (or, with none, the
        always-refused list) refuses. `whole`: keyed by the whole URL (a proxy's), else by
        its host."""
        key = url if whole else (url.split("/", 3)[2] if "://" in url else url)
        if key not in self._checked:
            check_literal_host(url, self._allow_hosts)
            if len(self._checked) < 4096:
                self._checked.add(key)


class GuardedResolver(AbstractResolver):
    """aiohttp resolver that drops every resolved address the allowlist refuses (with no
    allowlist, the always-refused ones); aiohttp then connects to one of the returned
    (checked) addresses."""

    def __init__(self, allow_hosts: Sequence[str], inner: AbstractResolver | None = None) -> None:
        self._allow_hosts = tuple(allow_hosts)
        self._inner = inner or DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        try:
            allowed = set(
                check_connect_addresses(host, [r["host"] for r in results], self._allow_hosts)
            )
        except UnsafeUpstream as exc:
            raise UnsafeAddressError(str(exc)) from None
        return [r for r in results if r["host"] in allowed]

    async def close(self) -> None:
        await self._inner.close()


async def resolve_checked_async(host: str, port: int, allow_hosts: Sequence[str]) -> list[str]:
    """Resolve once (the event loop's resolver) and keep the addresses the allowlist allows.
    Raises UnsafeAddressError when none is left."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    try:
        return check_connect_addresses(host, addresses, allow_hosts)
    except UnsafeUpstream as exc:
        raise UnsafeAddressError(str(exc)) from None
