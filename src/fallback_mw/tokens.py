"""Token estimates made before a request is sent: ~4 bytes of JSON per input token, plus
the largest output limit the body names. The budget hold prices this estimate; declared
capacity (`tpm`) counts it until the upstream reports the real usage."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

BYTES_PER_TOKEN = 4
# Token counts are believed up to this (a 10^15-token response does not exist).
MAX_TOKENS = 10**15
OUTPUT_LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def _limit(value: Any) -> int | None:
    """An output limit as a lenient upstream reads it: an integer, an integral number
    (`1e8`, `100000000.0`) or a string of digits (`"100000000"`: pydantic's lax mode takes
    it). Negative or unreadable: None (it limits nothing, and hides no other limit)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float):
        if math.isfinite(value) and value >= 0 and value.is_integer():
            return min(int(value), MAX_TOKENS)
        return None
    if isinstance(value, str):
        text = value.strip()
        if 0 < len(text) <= 16 and text.isascii() and text.isdigit():
            return int(text)
    return None


def output_limits(parsed: Mapping[str, Any]) -> list[int]:
    """Every output limit the body names (providers differ in which key they honour), as
    non-negative integers; values that limit nothing are left out (`_limit`)."""
    limits = []
    for key in OUTPUT_LIMIT_KEYS:
        if key in parsed:
            limit = _limit(parsed[key])
            if limit is not None:
                limits.append(limit)
    return limits


def estimate_tokens(size: int, parsed: Mapping[str, Any] | None) -> int:
    """Input tokens from the body's size, plus the largest output limit when one is named."""
    estimate = -(-max(size, 0) // BYTES_PER_TOKEN)
    if parsed is not None:
        limits = output_limits(parsed)
        if limits:
            estimate += max(limits)
    return min(estimate, MAX_TOKENS)
