"""How deeply this interpreter's JSON parser nests, for the messages that name it."""

from __future__ import annotations

import functools
import json

_PROBE = 100_000  # deeper than any Python up to 3.13 parses


@functools.cache
def json_depth_limit() -> int | None:
    """How deeply `json.loads` nests on this interpreter, measured once (when a body is
    first refused for it): about 1,000 on Python 3.11 (its recursion limit, less the frames
    in use), 1,500 on 3.12, 10,000 on 3.13. None: deeper than the probe (no number to say)."""
    low, high = 1, _PROBE
    while low < high:
        middle = (low + high + 1) // 2
        try:
            json.loads("[" * middle + "]" * middle)
        except RecursionError:
            high = middle - 1
        else:
            low = middle
    return None if low == _PROBE else low
