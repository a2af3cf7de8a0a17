"""CredentialInjector: strip every caller credential; give each candidate only its own."""

from __future__ import annotations

from collections.abc import Mapping

from fallback_mw.config import ConfigError, ConfigSource, as_config
from fallback_mw.credentials import CredentialCache, apply_hygiene
from fallback_mw.injected import require_app, require_environ
from fallback_mw.request.config_refusal import ConfigRefusal
from fallback_mw.request.context import SCOPE_KEY, RequestContext
from fallback_mw.request.types import ASGIApp, Receive, Scope, Send


class CredentialInjector:
    _refusal: ConfigRefusal | None = None  # a configuration that did not load

    def __init__(
        self,
        app: ASGIApp,
        /,
        *,
        config: ConfigSource,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        require_app(app, owner="CredentialInjector")
        require_environ(environ, owner="CredentialInjector")
        self.app = app
        self.cache = CredentialCache(environ)
        try:
            as_config(config, environ=environ)  # checked as Gateway checks it
        except ConfigError as exc:
            self._refusal = ConfigRefusal(exc)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._refusal is not None:
            await self._refusal(scope, receive, send)
            return
        context = scope.get(SCOPE_KEY)  # `get_context`, written out: one call fewer
        if isinstance(context, RequestContext):
            apply_hygiene(
                context, scope.get("headers", ()), self.cache.credentials(context.upstreams)
            )
        await self.app(scope, receive, send)
