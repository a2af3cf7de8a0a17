"""What every configuration model shares: unknown keys refused, values checked as written (a
TOML integer where a float is meant stays as written), the bounds several sections use,
and the names they may hold (hosts, header names, budget ids)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
from decimal import Decimal
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from fallback_mw.rules import ConfigError as ConfigError  # re-exported: its public home
from fallback_mw.security.values import is_field_name

MAX_PLAN_LENGTH = 8


# The largest amount of money (currency units) a budget limit, hold or price may name: the
# ledgers keep integer nano-units in signed 64-bit columns (see budget/cost.py).
MAX_MONEY = Decimal(1_000_000_000)


MONEY_DECIMALS = 9  # the ledgers' integer nano-units


NANO = Decimal(1).scaleb(-MONEY_DECIMALS)


# The longest walk deadline (route or gateway `deadline_ms`): it also bounds every attempt.
MAX_DEADLINE_MS = 600_000


# The plain scalar types a field takes, for `Strict`'s refusal of type juggling.
_SCALARS = {int: "int", float: "float", bool: "bool", str: "str"}


def _scalar_kinds(annotation: Any) -> frozenset[str]:
    """The plain scalar types a field takes ("int", "float", "bool", "str"), with None
    allowed beside them; empty when it takes anything else too (a tuple, a Decimal, a
    Literal, a model), whose own validation decides."""
    members = (
        get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    )
    kinds = set()
    for member in members:
        if member is type(None):
            continue
        kind = _SCALARS.get(member)
        if kind is None:
            return frozenset()
        kinds.add(kind)
    return frozenset(kinds)


class WrittenFloat(float):
    """A TOML float that keeps the digits the file wrote (`read_config_file`'s
    `parse_float`): money is Decimal, and `limit = 12345678.123456789` read through a binary
    float was kept as 12345678.12345679, `99999999.9999999999` (ten decimals, refused) as
    100000000, a price's 20th decimal dropped. Every other float field takes it as a float."""

    written: str

    def __new__(cls, written: str) -> WrittenFloat:
        number = super().__new__(cls, written)
        number.written = written
        return number


def as_written(value: Any) -> Any:
    """A money field's TOML float as the Decimal of its written digits."""
    return Decimal(value.written) if isinstance(value, WrittenFloat) else value


# The keys that name a file: a str, or any os.PathLike of one (pathlib.Path).
FILE_PATH_FIELDS = frozenset({"ca_file"})


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _utf8_text(cls, value: Any, info: ValidationInfo) -> Any:
        # A lone surrogate (a dict built from `os.environ` holding bytes that are not UTF-8,
        # a store record's JSON `\ud800`) loaded, then failed where the text is encoded: a
        # `canary_salt` on every request with a session (UnicodeEncodeError, a bare 500), a
        # stored route's prefix in `routes list`. TOML text cannot hold one. A `ca_file` is
        # a file's path, which may hold any bytes (Python spells them so, and opens them).
        if info.field_name in FILE_PATH_FIELDS:
            # A `pathlib.Path` (what a Python user passes) is taken as its text, the form
            # a TOML file and a stored route hold.
            return os.fspath(value) if isinstance(value, os.PathLike) else value
        if isinstance(value, dict):
            texts: Any = value.keys()
        elif isinstance(value, list | tuple):
            texts = value
        else:
            texts = (value,)
        for text in texts:
            if isinstance(text, str) and not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise PydanticCustomError(
                        "not_utf8", "must be UTF-8 text (it holds a lone surrogate)"
                    ) from None
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _no_type_juggling(cls, value: Any, info: ValidationInfo) -> Any:
        # TOML has numbers and booleans of its own: `retries = "1"`, `deadline_ms = true`
        # (a 1 ms deadline) and `canary_eligible = 1` are slips, which pydantic's lax mode
        # took as 1, 1 and true. Refused as the wrong type, like `deadline_ms = "5s"`.
        if info.field_name is None:
            return value
        kinds = _scalar_kinds(cls.model_fields[info.field_name].annotation)
        if not kinds or "str" in kinds:
            return value
        numeric = kinds & {"int", "float"}
        if isinstance(value, bool):
            wrong = "bool" not in kinds
        elif isinstance(value, str):
            wrong = True
        else:
            wrong = isinstance(value, int | float) and not numeric
        if not wrong:
            return value
        kind = "int_type" if "int" in kinds else "float_type" if numeric else "bool_type"
        raise PydanticCustomError(kind, "wrong type")


# A breaker's open period at most: 31 days, as `quota_retire_ms`. A Redis `state` keeps
# each breaker for twice its longest cooldown, which must be a valid PEXPIRE: a cooldown of
# 1e20 ms was taken, and every breaker update failed as "Redis unreachable".
MAX_COOLDOWN_MS = 31 * 86_400_000


# The longest timeout or delay an upstream or route may name (connect, first byte, idle,
# hedge): 31 days, as above. 1e400 ms loaded, and every request then ended in a bare 500
# (its conversion to seconds, an OverflowError, on the request path).
MAX_TIMER_MS = 31 * 86_400_000


_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*\.?")


def header_name(value: str) -> str:
    """A configured header name, lower-cased; ValueError unless it is an HTTP field name."""
    name = value.strip().lower()
    if not is_field_name(name):
        raise ValueError(
            "must be an HTTP header name (letters, digits and !#$%&'*+-.^_`|~, no spaces "
            "or ':'), e.g. authorization or x-api-key"
        )
    return name


XN_HINT = "write an international host name in its xn-- form"


def xn_form(host: str) -> str:
    """The hint for a host written in Unicode (`bücher.example`), with its xn-- spelling
    where it has one: such a name matched no upstream (every upstream URL is ASCII) and
    was refused as "not a host name", which it is, in another spelling."""
    try:
        import idna  # yarl's IDNA 2008 (UTS 46) codec, so aiohttp's: always installed

        spelled = idna.encode(host.rstrip("."), uts46=True).decode("ascii")
    except Exception:  # not a name IDNA can spell (a symbol, a space): the hint alone
        return XN_HINT
    return f"{XN_HINT}, {spelled}"


def valid_host(host: str) -> bool:
    """A DNS name (letters, digits, `-`, `_`; labels of at most 63) or an IP literal."""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            return False
        return True
    return len(host) <= 253 and _HOST_NAME.fullmatch(host) is not None


MAX_BUDGET_ID = 200


def budget_id(value: str) -> str:
    """A budget id, as `budgets set --budget` takes one: 1..200 printable characters. It
    reaches log lines, error bodies and `check` / `budgets show` output, so a line break or
    an escape sequence in it (a hand-written store record's route) must never get that far."""
    if not value or len(value) > MAX_BUDGET_ID or not value.isprintable():
        raise ValueError(
            f"budget id {value[:80]!r} is not allowed: 1..{MAX_BUDGET_ID} printable "
            "characters (no line break, tab or other control character)"
        )
    return value


def budget_section(value: str) -> str:
    """The TOML table a budget id is configured under, as it must be written: a bare key
    (`[budgets.acme]`), else quoted (`[budgets."予算 2026"]`, which unquoted is no TOML)."""
    if _BARE_KEY.fullmatch(value):
        return f"[budgets.{value}]"
    return f"[budgets.{json.dumps(value, ensure_ascii=False)}]"


def command_option(flag: str, value: str) -> str:
    """An option of a command the operator is told to run, pasted as it was printed: the
    value quoted (`--budget '予算 2026'`: a space split it into two arguments), and joined by
    `=` when it starts with `-` (ids may: `--id -x` is the option `-x` to argparse, which
    answered "expected one argument")."""
    quoted = shlex.quote(value)
    return f"{flag}={quoted}" if value.startswith("-") else f"{flag} {quoted}"


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
