"""Whether a header or query string can be sent as it is (RFC 9110 §5.1/§5.5, RFC 9112 §3.2):
the one rule for both engines. Says what is wrong, never what the value is (it may be a
secret)."""

from __future__ import annotations

from functools import lru_cache
from typing import Final


def header_value_problem(value: str) -> str | None:
    """Why `value` cannot be sent as an HTTP field value (RFC 9110 §5.5), or None. Says
    what is wrong, never what the value is (it may be a secret)."""
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        return "has characters outside latin-1"
    if any(c in value for c in "\r\n\x00"):
        return "contains a line break or NUL"
    if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in value):
        return "contains a control character"
    if value != value.strip(" \t"):
        return "starts or ends with whitespace"
    if len(value) > MAX_FIELD_VALUE_BYTES:  # latin-1 by now: a character a byte
        return (
            f"is {len(value)} bytes long, more than servers take in one header field "
            f"({MAX_FIELD_VALUE_BYTES}: nginx, Apache and aiohttp answer 400); is it the key alone?"
        )
    return None


# The longest configured value sent (a credential, a scheme): past it no common server
# takes the header field (nginx's and Apache's 8 KiB a line, aiohttp's 8190 bytes), and a
# variable that long holds more than a key (a secrets file, a certificate chain).
MAX_FIELD_VALUE_BYTES: Final = 8192


_TCHAR: Final = frozenset(
    b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
)


# What a field value may not hold (RFC 9110 §5.5): control characters but HTAB, and DEL.
VALUE_CTL: Final = frozenset(range(0x20)) - {0x09} | {0x7F}

# Bytes looked for by their value (`UNDERSCORE in name`): `int in bytes` is a memchr, where
# `bytes in bytes` formats and drops a TypeError first (CPython 3.11) and `find` parses its
# arguments from a tuple, some 200 ns a call.
AMPERSAND: Final = ord("&")
EQUALS: Final = ord("=")
PERCENT: Final = ord("%")
PLUS: Final = ord("+")
QUESTION: Final = ord("?")
SEMICOLON: Final = ord(";")
SP: Final = ord(" ")
UNDERSCORE: Final = ord("_")


def only(allowed: frozenset[int] | range) -> bytes:
    """A `bytes.translate` table that keeps each byte of `allowed` and changes every other:
    `data.translate(only(allowed)) == data` says, in one C loop, whether `data` holds
    nothing else. With a table and nothing to delete, `translate` neither builds a table
    of 256 entries at every call (as it does for bytes to delete: some 1,000 instructions)
    nor makes a copy when no byte changed (it hands back `data`, which `==` finds equal
    without comparing)."""
    return bytes(byte if byte in allowed else (byte + 1) % 256 for byte in range(256))


_TCHAR_ONLY: Final = only(_TCHAR)
_PRINTABLE_ASCII_ONLY: Final = only(range(0x20, 0x7F))


def is_token(name: str) -> bool:
    """An HTTP field name (RFC 9110 §5.1: a token), as a configured header name must be."""
    return bool(name) and name.isascii() and _TCHAR.issuperset(name.encode("ascii"))


# `is_token`, cached: on the attempt path (upstream.base.check_request_headers) the same
# few names come every request, and a hit costs a third of the check. A caller's names
# reach it too: one longer than MAX_CACHED is checked uncached, or 256 names of a 64 KB
# head each were kept for good (16 MB; 256 times max_header_bytes).
is_field_name: Final = lru_cache(maxsize=256)(is_token)


MAX_CACHED: Final = 256


# The bound of every cache of caller header names (`_TOKEN_NAMES` here, `name_forms`'s in
# fields.py): a name longer than NAME_CACHE_LONGEST bytes is not kept, nor any past the
# first NAME_CACHE_SIZE (a caller's made-up names then cost what they did).
NAME_CACHE_LONGEST: Final = 64
NAME_CACHE_SIZE: Final = 1024

# The caller header names `request_header_problem` found to be tokens: the same few names
# come every request, and a set look-up (the name's hash kept by the bytes) is a fraction
# of the `translate` (a method call, a copy of the name made and freed, a loop over it).
# Bounded as above; exact `bytes` only.
_TOKEN_NAMES: Final[set[bytes]] = set()


def request_header_problem(name: bytes, value: bytes) -> str | None:
    """The one rule, for both engines, for a caller header that would be forwarded (SPEC
    §12, RFC 9110 §5.1/§5.5): the name a token; the value no control character but HTAB,
    and bytes >= 0x80 (obs-text) only as UTF-8, which both engines forward byte for byte.
    Leading and trailing SP/HTAB are not part of a field value (RFC 9110 §5.5): the
    attempt trims them, as every HTTP parser does. None: forward it. Says what is wrong,
    never what the value is."""
    # A name seen before, a set look-up (`_TOKEN_NAMES`); else one C call, as for the
    # usual value (a method call costs a few hundred instructions compiled; the set checks
    # below about 2 us a header): a name is a token when a table keeping only token
    # characters (`only`) leaves it as it is; a value of printable ASCII (0x20-0x7E)
    # likewise.
    if type(name) is not bytes or name not in _TOKEN_NAMES:
        if not name or name.translate(_TCHAR_ONLY) != name:
            return "has a name that is not an HTTP token"
        if (
            type(name) is bytes
            and len(name) <= NAME_CACHE_LONGEST
            and len(_TOKEN_NAMES) < NAME_CACHE_SIZE
        ):
            _TOKEN_NAMES.add(name)
    if value.translate(_PRINTABLE_ASCII_ONLY) == value:
        return None
    if VALUE_CTL.intersection(value):
        return "contains a control character"
    if not value.isascii():
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            return "has bytes >= 0x80 that are not UTF-8"
    return None


_TARGET_FORBIDDEN: Final = frozenset(range(0x21)) | {0x7F, ord("#")}


def query_problem(query: bytes) -> str | None:
    """Why a query string cannot go out in a request target (RFC 9112 §3.2: no control
    character, space or `#`), or None. Bytes >= 0x80 go out percent-encoded."""
    if query and _TARGET_FORBIDDEN.intersection(query):
        return "the query string has a control character, a space or '#'"
    return None
