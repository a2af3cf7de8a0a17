"""Optional features and the pip extra that installs each.

The base install carries what the middleware needs with memory state and no store (pydantic,
aiohttp, anyio, opentelemetry-api). A feature whose extra is missing is refused when the
configuration is loaded, in one line naming the extra; the modules that import an optional
dependency raise the same error if they are reached some other way."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from functools import cache

from fallback_mw.rules import ConfigError

# extra -> the modules it provides that the code imports
EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("uvicorn",),
    "postgres": ("asyncpg",),
    "redis": ("redis",),
    "httpx": ("httpx", "httpcore"),
    "otel": ("opentelemetry.sdk",),
    "django": ("django", "asgiref"),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        # A parent package that is itself missing or blocked.
        return False


def missing_extra(extra: str, feature: str) -> ConfigError:
    """The one-line refusal for `feature` without `extra` (returned, for `raise ... from None`)."""
    return ConfigError(f"{feature} needs the {extra} extra: pip install 'fallback_mw[{extra}]'")


def require(extra: str, feature: str) -> None:
    """Raise the one-line ConfigError unless every module of `extra` can be imported."""
    if not all(_installed(module) for module in EXTRAS[extra]):
        raise missing_extra(extra, feature)


def _scheme(url: str) -> str:
    # Only the scheme: a state or store URL may carry a password.
    return url.split(":", 1)[0]


def state_feature(url: str) -> str:
    return f'state = "{_scheme(url)}://..."'


def store_feature(url: str) -> str:
    return f'store = "{_scheme(url)}://..."'


@cache
def package_version() -> str:
    """This package's installed version: every meter and tracer of the gateway reports it
    as its scope version (`otel_scope_version` on each exported series)."""
    try:
        return importlib.metadata.version("fallback_mw")
    except Exception:
        return "0"
