"""fallback_mw: ASGI middleware that makes any ASGI app an API / LLM gateway with ordered
failover. Importing it imports neither Django nor Starlette."""

from __future__ import annotations

from fallback_mw.budget.guard import BudgetGuard
from fallback_mw.config import ConfigError, GatewayConfig, load_config
from fallback_mw.credentials import CredentialInjector
from fallback_mw.gateway import Gateway
from fallback_mw.resolver import RouteResolver
from fallback_mw.walker import PlanWalker

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
