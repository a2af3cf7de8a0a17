"""How a message quotes a name it did not write (a key, an id from a file or a store record)."""

from __future__ import annotations


def shortened(text: str) -> str:
    """`text`, cut when long: a key or an id of megabytes (a hand-written store record, a
    file) was quoted whole, an error line and a log line of megabytes at every reload."""
    return text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"
