"""What an invalid configuration is told: pydantic's errors said in TOML's words, one line
per problem, naming the key path (never the value given)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from decimal import Decimal
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from fallback_mw.config.model import (
    BreakerConfig,
    BudgetConfig,
    GatewayConfig,
    GatewaySettings,
    RepeatAllowanceConfig,
)
from fallback_mw.config.route import RouteConfig
from fallback_mw.config.upstream import UpstreamConfig
from fallback_mw.quoting import shortened

_TABLES: tuple[tuple[str, type[BaseModel]], ...] = (
    ("[gateway]", GatewaySettings),
    ("[gateway.breaker]", BreakerConfig),
    ("[gateway.repeat_budget]", RepeatAllowanceConfig),
    ("[upstreams.NAME]", UpstreamConfig),
    ("[[routes]]", RouteConfig),
    ("[budgets.NAME]", BudgetConfig),
)


# Pydantic's "Input should be a valid integer, unable to parse string as an integer" and
# kin: said in TOML's words as "must be an integer" (`deadline_ms = "5s"`).
_WRONG_TYPE = frozenset(
    {
        "tuple_type", "list_type", "dict_type", "model_type", "string_type", "int_type",
        "int_parsing", "int_from_float", "float_type", "float_parsing", "decimal_type",
        "decimal_parsing", "bool_type", "bool_parsing",
    }
)  # fmt: skip


def _annotation_at(root: type[BaseModel], loc: Sequence[Any]) -> Any:
    """The type the configuration expects at `loc` (a pydantic error location), or None."""
    annotation: Any = root
    for part in loc:
        annotation = _without_none(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(part) if isinstance(part, str) else None
            annotation = None if field is None else field.annotation
        elif get_origin(annotation) is dict and not isinstance(part, int):
            annotation = get_args(annotation)[1]
        elif get_origin(annotation) is tuple and isinstance(part, int):
            annotation = get_args(annotation)[0]
        else:
            return None
    return _without_none(annotation)


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def _kind(annotation: Any) -> str:
    """What a TOML author writes for `annotation`, in their words (not pydantic's)."""
    if get_origin(annotation) is Annotated:  # StrictInt: int with a constraint
        annotation = get_args(annotation)[0]
    origin = get_origin(annotation)
    if origin in (Union, UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        return " or ".join(dict.fromkeys(_kind(a) for a in members))
    if origin is tuple or annotation is tuple:
        return "an array [...]"
    if origin is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return "a table"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(annotation))
    names = {str: "a string", bool: "true or false", int: "an integer"}
    return names.get(annotation, "a number" if annotation in (float, Decimal) else "a value")


def _unknown_key(root: type[BaseModel], loc: Sequence[Any], where: str) -> str:
    key = str(loc[-1])
    parent = _annotation_at(root, loc[:-1])
    if isinstance(parent, type) and issubclass(parent, BaseModel):
        close = difflib.get_close_matches(key, list(parent.model_fields), n=1)
        if close:
            return f"unknown key {where!r} (did you mean {close[0]!r}?)"
    # A key written below the wrong header: in TOML a key belongs to the last [table]
    # header above it, so `retries` after [upstreams.backup] is the upstream's.
    homes = [table for table, model in _TABLES if model is not parent and key in model.model_fields]
    if homes:
        return (
            f"unknown key {where!r} ({key} is a key of {' and '.join(homes)}: a TOML key "
            "belongs to the last [table] header above it)"
        )
    return f"unknown key {where!r}"


_OUT_OF_RANGE = {
    "greater_than_equal": "at least",
    "less_than_equal": "at most",
    "greater_than": "above",
    "less_than": "below",
}


def _key_part(part: Any) -> str:
    """One step of a key path as the message shows it: a quoted TOML key holding a line
    break, a control character or a dot (`[prices."\\n"]`, `[upstreams."a.b"]`) in its
    escaped form, so the message stays one line and says which key."""
    text = shortened(str(part))
    if isinstance(part, str) and (not text.isprintable() or "." in text or " " in text):
        return repr(text)
    return text


def _describe(
    error: ValidationError,
    data: Mapping[str, Any] | None = None,
    root: type[BaseModel] | None = None,
) -> str:
    root = root or GatewayConfig
    lines: list[str] = []
    routes = (data or {}).get("routes")
    for item in error.errors():
        raw = tuple(item["loc"])
        loc = list(raw)
        expected = _annotation_at(root, raw)
        union = False
        if expected is None:
            # Past a union pydantic names each member by its type ("auth_env.str"): the
            # key is the union's, and one line says every type it accepts.
            for end in range(len(raw) - 1, 0, -1):
                parent = _annotation_at(root, raw[:end])
                if get_origin(parent) in (Union, UnionType):
                    loc, expected, union = loc[:end], parent, True
                    break
        # "routes.0.retry" reads better as "routes['chat'].retry".
        if len(loc) >= 2 and loc[0] == "routes" and isinstance(loc[1], int):
            route = routes[loc[1]] if isinstance(routes, list | tuple) else None
            if isinstance(route, Mapping) and isinstance(route.get("id"), str):
                loc[:2] = [f"routes[{shortened(route['id'])!r}]"]
            else:
                loc[:2] = [f"routes[{loc[1]}]"]
        where = ".".join(_key_part(p) for p in loc)
        kind = item["type"]
        if kind == "extra_forbidden":  # said quoted whole: `unknown key 'gateway.\\nx'`
            line = _unknown_key(root, raw, ".".join(shortened(str(p)) for p in loc))
        elif kind == "missing":
            line = f"{where}: required key missing"
        elif kind == "too_short" and item.get("ctx", {}).get("min_length") == 1:
            line = f"{where}: must not be empty"
        elif raw == ("routes",) and kind in ("tuple_type", "list_type"):
            line = "routes: must be an array of tables: write each route as [[routes]]"
        elif union or kind in _WRONG_TYPE:
            line = f"{where}: must be {_kind(expected)}"
        elif kind in _OUT_OF_RANGE:
            # pydantic's "Input should be greater than or equal to 0": say it as the bound.
            bound = next(iter(item.get("ctx", {}).values()), "?")
            line = f"{where}: must be {_OUT_OF_RANGE[kind]} {bound}"
        else:
            # item["msg"] never contains the input value; "input" is deliberately not printed.
            line = f"{where}: {item['msg'].removeprefix('Value error, ')}"
        if line not in lines:
            lines.append(line)
    return "; ".join(lines)
