"""Money and prices: exact Decimal arithmetic, stored as integer nano-units.

A hold is estimated from the request (model, size, `max_tokens`) and `[prices]`; a
settlement is costed from the usage the upstream reported."""

from __future__ import annotations

from collections.abc import Mapping
from decimal import ROUND_CEILING, Decimal
from typing import Any, Final

from fallback_mw.config import MAX_MONEY, PriceConfig
from fallback_mw.tokens import (
    BYTES_PER_TOKEN,
    GENERATION_LIMIT_KEYS,
    MAX_TOKENS,
    OUTPUT_LIMIT_KEYS,
    output_estimate,
    read_json,
)

UNITS_PER_CURRENCY: Final = 10**9  # stores keep integer nano-units: exact, no binary floats
# Every amount the ledgers store fits a signed 64-bit column (SQLite INTEGER, PostgreSQL
# BIGINT, max ~9.2e18): a single amount saturates at MAX_UNITS (MAX_MONEY currency units,
# the largest limit the config accepts), a window's spend saturates at SPENT_CAP_UNITS, so
# spent + held + a new hold (<= 4e18 + 1e18 + 1e18) can never overflow.
MAX_UNITS: Final = int(MAX_MONEY) * UNITS_PER_CURRENCY
SPENT_CAP_UNITS: Final = 4 * MAX_UNITS
_MTOK: Final = Decimal(1_000_000)
# A rough, generous token estimate for the request side (tokens.py); token counts are
# believed up to MAX_TOKENS, so usage fits a BIGINT column and costs stay finite.
_UNPARSED: Final[Any] = object()  # estimate_hold's `parsed` when the caller did not parse
_OUTPUT_LIMIT_KEYS: Final = (*OUTPUT_LIMIT_KEYS, *GENERATION_LIMIT_KEYS)


def to_units(amount: Decimal) -> int:
    """Currency -> integer nano-units, rounded up so a charge is never under-counted, and
    saturated at MAX_UNITS (an absurd cost is charged as the most any budget can hold,
    never an overflow that loses the settlement)."""
    if not amount.is_finite():
        return 0 if amount.is_nan() or amount < 0 else MAX_UNITS
    if amount >= MAX_MONEY:
        return MAX_UNITS
    return max(int((amount * UNITS_PER_CURRENCY).to_integral_value(rounding=ROUND_CEILING)), 0)


def from_units(units: int) -> Decimal:
    return Decimal(units).scaleb(-9)


def format_money(amount: Decimal) -> str:
    """At least two decimals, more when the amount has them: 2.00, 3.30, 0.125 (`budgets
    show` printed a limit of 3.3 beside one of 2.00)."""
    text = f"{amount.normalize():f}"
    whole, _, cents = text.partition(".")
    return f"{whole}.{cents.ljust(2, '0')}"


class PriceBook:
    def __init__(self, prices: Mapping[str, PriceConfig]) -> None:
        self.prices = dict(prices)
        # A name in another case is the same model to an upstream that looks models up
        # case-insensitively (Ollama runs and echoes "Llama3.1:8B" as "llama3.1:8b"):
        # unpriced, its caller was held and charged default_hold. Names the file spells
        # alike but for case: the dearest output price.
        folded: dict[str, PriceConfig] = {}
        for name, price in sorted(self.prices.items(), key=lambda item: item[1].output_per_mtok):
            folded[name.casefold()] = price
        self._folded = folded
        # The lengths of the names, longest first, so "gpt-4o-mini" wins over "gpt-4o" for
        # "gpt-4o-mini-2024-07-18": a model is cut at each and looked up, never compared
        # with every name (a caller's unpriced model was, twice a request, at 2,000 prices).
        self._lengths = sorted({len(name) for name in folded}, reverse=True)

    def price_for(self, model: str | None) -> PriceConfig | None:
        if not model:
            return None
        price = self.prices.get(model)
        if price is not None:
            return price
        model = model.casefold()
        price = self._folded.get(model)
        if price is not None:
            return price
        # Upstreams often report a dated version of the requested model name.
        for length in self._lengths:
            if length < len(model) and model[length] in "-@:.":
                price = self._folded.get(model[:length])
                if price is not None:
                    return price
        return None

    def cost(
        self, model: str | None, input_tokens: int | None, output_tokens: int | None
    ) -> Decimal | None:
        """The exact cost of reported usage, or None when the model has no price or no
        usage was reported."""
        price = self.price_for(model)
        if price is None or (input_tokens is None and output_tokens is None):
            return None
        cost = (
            Decimal(min(input_tokens or 0, MAX_TOKENS)) * price.input_per_mtok
            + Decimal(min(output_tokens or 0, MAX_TOKENS)) * price.output_per_mtok
        ) / _MTOK
        return min(cost, MAX_MONEY)

    def estimate_hold(
        self,
        body: bytes | None,
        model: str | None,
        default_hold: Decimal,
        *,
        parsed: Any = _UNPARSED,
    ) -> Decimal:
        """The hold for a request: priced model + output limit -> an estimate of the most
        the request can cost; anything else -> `default_hold`. `parsed` is the body as
        already parsed by the caller (None: not JSON), to parse it only once."""
        if body is None or not body:
            return default_hold
        price = self.price_for(model)
        if price is None:
            return default_hold
        if parsed is _UNPARSED:
            # A cheap look before parsing; a key may be spelled with escapes
            # (`"max\u005ftokens"`), which every JSON reader, the upstream's too, decodes.
            # Or in another case (`Max_Tokens`), which case-insensitive readers take.
            lowered = body.lower()
            if (
                body.find(b"\\u") < 0  # `find`: `bytes in bytes` raises and drops a TypeError
                and body.isascii()
                and not any(lowered.find(key.encode()) >= 0 for key in _OUTPUT_LIMIT_KEYS)
            ):
                return default_hold
            try:
                parsed = read_json(body)
            except (ValueError, UnicodeDecodeError, RecursionError):
                # RecursionError: a body nested ~1,000 levels deep. Not an estimate.
                return default_hold
        if not isinstance(parsed, dict):
            return default_hold
        # Every output limit the body names, and the largest of them: one tiny value must
        # not hide a huge one (providers differ in which key they honour), and neither
        # may a negative or unreadable one (it limits nothing: left out).
        # ... times the completions the body asks for (`n`, `best_of`, a batched `prompt`).
        output_limit = output_estimate(parsed)
        if output_limit is None:
            return default_hold
        input_estimate = -(-len(body) // BYTES_PER_TOKEN)
        estimate = (
            Decimal(input_estimate) * price.input_per_mtok
            + Decimal(output_limit) * price.output_per_mtok
        ) / _MTOK
        return min(estimate, MAX_MONEY)
