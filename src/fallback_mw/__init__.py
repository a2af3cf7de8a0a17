"""fallback_mw: ASGI middleware that makes any ASGI app an API / LLM gateway with ordered
failover. Importing it imports neither Django nor Starlette.

The public names are imported on first use (PEP 562), so `import fallback_mw` and imports of
its submodules (`fallback_mw.django`, the CLI's admin verbs) pay only for what they use."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fallback_mw.config import ConfigError, GatewayConfig, load_config
    from fallback_mw.gateway import Gateway
    from fallback_mw.layers.guard import BudgetGuard
    from fallback_mw.layers.injector import CredentialInjector
    from fallback_mw.layers.resolver import RouteResolver
    from fallback_mw.layers.walker import PlanWalker

# public name -> the module that defines it
_EXPORTS = {
    "BudgetGuard": "fallback_mw.layers.guard",
    "ConfigError": "fallback_mw.config",
    "CredentialInjector": "fallback_mw.layers.injector",
    "Gateway": "fallback_mw.gateway",
    "GatewayConfig": "fallback_mw.config",
    "PlanWalker": "fallback_mw.layers.walker",
    "RouteResolver": "fallback_mw.layers.resolver",
    "load_config": "fallback_mw.config",
}


# Hidden from type checkers, which read the names above: a module `__getattr__` returning
# Any made every name importable to them (`from fallback_mw import Gatway` passed mypy
# --strict, and failed at run time).
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'fallback_mw' has no attribute {name!r}")
        value = getattr(import_module(module), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *_EXPORTS})


__all__ = [
    "BudgetGuard",
    "ConfigError",
    "CredentialInjector",
    "Gateway",
    "GatewayConfig",
    "PlanWalker",
    "RouteResolver",
    "load_config",
]
__version__ = "0.1.0"
