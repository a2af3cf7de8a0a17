"""Configuration: pydantic models (`model`), what an invalid one is told (`describe`) and
TOML loading with the load-time checks (`load`). The load-time refusals of SPEC §3 are in
rules.py, shared with the route store (ConfigError lives there; its public home is here).
Everything a host or another module imports is named here."""

from fallback_mw.config.describe import _describe
from fallback_mw.config.load import (
    ConfigSource,
    as_config,
    check_ca_file,
    check_config_extras,
    check_environment,
    load_config,
    parse_config,
    read_config_file,
    validate,
)
from fallback_mw.config.model import (
    BreakerConfig,
    BudgetConfig,
    GatewayConfig,
    GatewaySettings,
    PriceConfig,
    RepeatAllowanceConfig,
)
from fallback_mw.config.route import DEFAULT_METHODS, HTTP_METHODS, RouteConfig
from fallback_mw.config.strict import (
    MAX_BUDGET_ID,
    MAX_COOLDOWN_MS,
    MAX_DEADLINE_MS,
    MAX_MONEY,
    MAX_PLAN_LENGTH,
    MONEY_DECIMALS,
    budget_id,
    budget_section,
    command_option,
)
from fallback_mw.config.upstream import UpstreamConfig
from fallback_mw.rules import ConfigError

__all__ = [
    "DEFAULT_METHODS",
    "HTTP_METHODS",
    "MAX_BUDGET_ID",
    "MAX_COOLDOWN_MS",
    "MAX_DEADLINE_MS",
    "MAX_MONEY",
    "MAX_PLAN_LENGTH",
    "MONEY_DECIMALS",
    "BreakerConfig",
    "BudgetConfig",
    "ConfigError",
    "ConfigSource",
    "GatewayConfig",
    "GatewaySettings",
    "PriceConfig",
    "RepeatAllowanceConfig",
    "RouteConfig",
    "UpstreamConfig",
    "_describe",
    "as_config",
    "budget_id",
    "budget_section",
    "check_ca_file",
    "check_config_extras",
    "check_environment",
    "command_option",
    "load_config",
    "parse_config",
    "read_config_file",
    "validate",
]
