"""CredentialInjector: strip every caller credential; give each candidate only its own."""

from __future__ import annotations

import os
from collections.abc import Mapping

from fallback_mw.config import GatewayConfig, UpstreamConfig
from fallback_mw.context import get_context
from fallback_mw.security import forwardable_request_headers
from fallback_mw.types import ASGIApp, Receive, Scope, Send

Credentials = Mapping[str, tuple[tuple[str, str] | None, ...]]


def credential_header(
    upstream: UpstreamConfig, index: int, environ: Mapping[str, str]
) -> tuple[str, str] | None:
    """The (header, value) one candidate sends, from its own environment variable only."""
    envs = upstream.credential_envs
    if not 0 <= index < len(envs):
        return None
    secret = environ.get(envs[index])
    if not secret:
        return None
    value = f"{upstream.auth_scheme} {secret}" if upstream.auth_scheme else secret
    return upstream.auth_header, value


def credential_table(
    upstreams: Mapping[str, UpstreamConfig], environ: Mapping[str, str]
) -> Credentials:
    """Every upstream's (header, value) per pool index, None where the variable is unset."""
    return {
        name: tuple(
            credential_header(upstream, index, environ)
            for index in range(len(upstream.credential_envs))
        )
        for name, upstream in upstreams.items()
    }


class CredentialInjector:
    def __init__(
        self,
        app: ASGIApp,
        /,
        *,
        config: GatewayConfig,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.app = app
        self.environ = os.environ if environ is None else environ
        # Computed once per route table (a store reload swaps the table, and its upstreams).
        self._table: tuple[Mapping[str, UpstreamConfig], Credentials] | None = None

    def _credentials(self, upstreams: Mapping[str, UpstreamConfig]) -> Credentials:
        cached = self._table
        if cached is not None and cached[0] is upstreams:
            return cached[1]
        table = credential_table(upstreams, self.environ)
        self._table = (upstreams, table)
        return table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        context = get_context(scope)
        if context is not None:
            context.forward_headers = forwardable_request_headers(
                scope.get("headers", ()), also_strip=context.upstream_auth_headers
            )
            context.credentials = self._credentials(context.upstreams)
        await self.app(scope, receive, send)
