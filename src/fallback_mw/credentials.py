"""CredentialInjector: strip every caller credential; give each candidate only its own."""

from __future__ import annotations

import os
from collections.abc import Mapping

from fallback_mw.config import GatewayConfig, UpstreamConfig
from fallback_mw.context import get_context
from fallback_mw.security import forwardable_request_headers
from fallback_mw.types import ASGIApp, Receive, Scope, Send


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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        context = get_context(scope)
        if context is not None:
            context.forward_headers = forwardable_request_headers(
                scope.get("headers", ()), also_strip=context.upstream_auth_headers
            )
            upstreams = context.upstreams
            environ = self.environ

            def credential_for(name: str, index: int) -> tuple[str, str] | None:
                upstream = upstreams.get(name)
                return None if upstream is None else credential_header(upstream, index, environ)

            context.credential_for = credential_for
        await self.app(scope, receive, send)
