"""Limits that protect the process, checked once a request is routed (SPEC §11):
request header bytes and count (431 `headers_too_large`) and requests in flight
(503 `overloaded`, at once rather than a queue).

These run inside the ASGI app, after the server has already parsed and buffered the
request head. `fallback-mw serve` also refuses oversized or slow heads in the server
itself (fallback_mw.cli.server_limits); a host app on its own server must configure that
server (docs/security.md)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

# Per field, as on the wire: "name: value\r\n".
_FIELD_OVERHEAD: Final = 4


def header_refusal(
    headers: Iterable[Any], *, max_bytes: int, max_count: int
) -> tuple[str, str] | None:
    """Why these request headers are refused and the setting that refused them (the error's
    `rule`), or None. Names the limit, never a value. Raises TypeError when a field is not
    a tuple of two `bytes` (`byte_fields` makes it one), a refused head's fields past the
    limit too (the resolver reads them all)."""
    size = 0
    if type(headers) is list and len(headers) <= max_count:
        # No more fields than max_count (the usual request): only the size can refuse, so
        # the fields are not counted one by one (the same answer as the loop below).
        for field in headers:
            # `_pair`, written out: this loop is every routed request's. `type()`, not
            # `__class__`: compiled, `type()` reads the object's type in C, where
            # `.__class__` of an untyped value is a generic attribute look-up (some 170
            # instructions, three a field).
            if type(field) is not tuple or len(field) != 2:
                raise TypeError(_NOT_BYTES)
            pair: tuple[Any, Any] = field  # a tuple of two: compiled, read without an iterator
            name, value = pair
            if type(name) is not bytes or type(value) is not bytes:
                raise TypeError(_NOT_BYTES)
            size += len(name) + len(value) + _FIELD_OVERHEAD
            if size > max_bytes:
                return _all_bytes(headers, _too_large(max_bytes))
        return None
    for count, field in enumerate(headers, start=1):
        name, value = _pair(field)
        size += len(name) + len(value) + _FIELD_OVERHEAD
        if count > max_count:
            message = f"more than {max_count} request header fields (max_header_count)"
            return _all_bytes(headers, (message, "max_header_count"))
        if size > max_bytes:
            return _all_bytes(headers, _too_large(max_bytes))
    return None


def _all_bytes(headers: Iterable[Any], refusal: tuple[str, str]) -> tuple[str, str]:
    """`refusal`, once every field of the head is a tuple of two `bytes`: a field past where
    the limit was met is read too (the identity pass, the secrets), so it raises as any
    other would."""
    for field in headers:
        _pair(field)
    return refusal


def _pair(field: Any) -> tuple[bytes, bytes]:
    """`field`'s name and value; TypeError when it is not a tuple of two `bytes`."""
    if type(field) is not tuple or len(field) != 2:
        raise TypeError(_NOT_BYTES)
    pair: tuple[Any, Any] = field  # a tuple of two: compiled, read without an iterator
    name, value = pair
    if type(name) is not bytes or type(value) is not bytes:
        raise TypeError(_NOT_BYTES)
    return name, value


_NOT_BYTES: Final = "a request header field is not a tuple of two bytes"


def byte_fields(headers: Iterable[Any]) -> list[tuple[bytes, bytes]]:
    """The header fields as tuples of two `bytes`, the one shape every layer behind the
    resolver reads (compiled, each is checked against it: `tuple[bytes, bytes] object
    expected; got list`). ASGI writes a field as `[name, value]`, and a server may hand a
    list, or a bytes subclass; an app or a test client driving the gateway in-process may
    pass text, read as the bytes it spells (UTF-8, as the gateway reads and forwards a
    value). A lone surrogate keeps its code (not UTF-8: the forwarded-field check refuses
    it with a 400). Anything else is no header (a TypeError saying so)."""
    return [(_bytes(name), _bytes(value)) for name, value in headers]


def _bytes(text: object) -> bytes:
    if text.__class__ is bytes:
        return text
    if isinstance(text, str):
        return text.encode("utf-8", "surrogatepass")
    if isinstance(text, bytes | bytearray | memoryview):
        return bytes(text)
    raise TypeError(
        "an ASGI request header name or value must be bytes (scope['headers']), not "
        f"{type(text).__name__}"
    )


def _too_large(max_bytes: int) -> tuple[str, str]:
    return f"request headers larger than {max_bytes} bytes (max_header_bytes)", "max_header_bytes"


class InFlight:
    """Routed requests in flight in this process, against `max_concurrency` (0: no limit).
    Process-wide state, like a connection pool, never per-request data."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0

    def try_enter(self) -> bool:
        # No await between the check and the increment: atomic on the event loop.
        if self.limit and self.count >= self.limit:
            return False
        self.count += 1
        return True

    def leave(self) -> None:
        self.count -= 1
