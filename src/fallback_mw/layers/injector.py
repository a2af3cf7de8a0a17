"""CredentialInjector: strip every caller credential; give each candidate only its own."""

from __future__ import annotations

from collections.abc import Mapping

from fallback_mw.config import ConfigSource, as_config
from fallback_mw.credentials import CredentialCache, apply_hygiene
from fallback_mw.request.context import get_context
from fallback_mw.request.types import ASGIApp, Receive, Scope, Send


class CredentialInjector:
    def __init__(
        self,
        app: ASGIApp,
        /,
        *,
        config: ConfigSource,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.app = app
        as_config(config, environ=environ)  # checked as Gateway checks it
        self.cache = CredentialCache(environ)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        context = get_context(scope)
        if context is not None:
            apply_hygiene(
                context, scope.get("headers", ()), self.cache.credentials(context.upstreams)
            )
        await self.app(scope, receive, send)
