"""The four layers, in the order a request meets them: `resolver` (which route?),
`guard` (one hold before, one settlement after), `injector` (caller credentials out, each
candidate's own in) and `walker` (the plan walked under the failover rules). Each imports
only what lies below all four (`fallback_mw.request`, the services) and never a later
layer; pyproject.toml's import-linter contract holds that."""

from fallback_mw.layers.guard import BudgetGuard
from fallback_mw.layers.injector import CredentialInjector
from fallback_mw.layers.resolver import RouteResolver
from fallback_mw.layers.walker import PlanWalker

__all__ = ["BudgetGuard", "CredentialInjector", "PlanWalker", "RouteResolver"]
