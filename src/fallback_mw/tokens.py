"""Token estimates made before a request is sent: ~4 bytes of JSON per input token, plus
the largest output limit the body names. The budget hold prices this estimate; declared
capacity (`tpm`) counts it until the upstream reports the real usage."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

BYTES_PER_TOKEN = 4
# Token counts are believed up to this (a 10^15-token response does not exist).
MAX_TOKENS = 10**15
OUTPUT_LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def output_limits(parsed: Mapping[str, Any]) -> list[int]:
    """Every output limit the body names (providers differ in which key they honour)."""
    return [
        parsed[key]
        for key in OUTPUT_LIMIT_KEYS
        if isinstance(parsed.get(key), int) and not isinstance(parsed.get(key), bool)
    ]


def estimate_tokens(size: int, parsed: Mapping[str, Any] | None) -> int:
    """Input tokens from the body's size, plus the largest output limit when one is named."""
    estimate = -(-max(size, 0) // BYTES_PER_TOKEN)
    if parsed is not None:
        limits = [limit for limit in output_limits(parsed) if limit >= 0]
        if limits:
            estimate += max(limits)
    return min(estimate, MAX_TOKENS)
