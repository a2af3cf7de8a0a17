"""How a message quotes a name it did not write (a key, an id from a file or a store record),
and how a terminal, a page or a trace view is shown text it did not write."""

from __future__ import annotations

import re


def shortened(text: str) -> str:
    """`text`, cut when long: a key or an id of megabytes (a hand-written store record, a
    file) was quoted whole, an error line and a log line of megabytes at every reload."""
    return text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"


def printable(text: str) -> str:
    """`text` as a terminal shows it: every character that is not printable (a tab, a
    newline, an escape sequence's ESC, a BEL, a bidi control) or is drawn as nothing
    (`DRAWN_AS_NOTHING`) becomes `?`."""
    if text.isprintable() and (text.isascii() or DRAWN_AS_NOTHING.search(text) is None):
        return text
    return "".join("?" if not c.isprintable() or DRAWN_AS_NOTHING.match(c) else c for c in text)


# The printable characters Unicode says to draw as nothing (Default_Ignorable_Code_Point,
# DerivedCoreProperties.txt; its others are format characters or unassigned, which are not
# printable): a caller's tenant `acme` + U+3164 (HANGUL FILLER) was listed as tenant `acme`.
DRAWN_AS_NOTHING = re.compile(
    "[\\u034f\\u115f\\u1160\\u17b4\\u17b5\\u180b-\\u180d\\u180f\\u3164\\ufe00-\\ufe0f\\uffa0"
    "\\U000e0100-\\U000e01ef]"
)
