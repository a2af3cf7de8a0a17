"""Limits that protect the process, checked once a request is routed (SPEC §11):
request header bytes and count (431 `headers_too_large`) and requests in flight
(503 `overloaded`, at once rather than a queue).

These run inside the ASGI app, after the server has already parsed and buffered the
request head. `fallback-mw serve` also refuses oversized or slow heads in the server
itself (fallback_mw.cli.server_limits); a host app on its own server must configure that
server (docs/security.md)."""

from __future__ import annotations

from collections.abc import Iterable

# Per field, as on the wire: "name: value\r\n".
_FIELD_OVERHEAD = 4


def header_refusal(
    headers: Iterable[tuple[bytes | str, bytes | str]], *, max_bytes: int, max_count: int
) -> tuple[str, str] | None:
    """Why these request headers are refused and the setting that refused them (the error's
    `rule`), or None. Names the limit, never a value. Raises TypeError when a name or value
    is text, not bytes (an app driving the gateway in-process: `byte_fields`), a refused
    head's fields past the limit too (the resolver reads them all)."""
    size = 0
    if type(headers) is list and len(headers) <= max_count:
        # No more fields than max_count (the usual request): only the size can refuse, so
        # the fields are not counted one by one (the same answer as the loop below).
        for name, value in headers:
            if name.__class__ is str or value.__class__ is str:
                raise TypeError(_TEXT)
            size += len(name) + len(value) + _FIELD_OVERHEAD
            if size > max_bytes:
                return _all_bytes(headers, _too_large(max_bytes))
        return None
    for count, (name, value) in enumerate(headers, start=1):
        if name.__class__ is str or value.__class__ is str:
            raise TypeError(_TEXT)
        size += len(name) + len(value) + _FIELD_OVERHEAD
        if count > max_count:
            message = f"more than {max_count} request header fields (max_header_count)"
            return _all_bytes(headers, (message, "max_header_count"))
        if size > max_bytes:
            return _all_bytes(headers, _too_large(max_bytes))
    return None


def _all_bytes(
    headers: Iterable[tuple[bytes | str, bytes | str]], refusal: tuple[str, str]
) -> tuple[str, str]:
    """`refusal`, once no field of the head is text: a field past where the limit was met
    is read too (the identity pass, the secrets), so it raises as any other would."""
    for name, value in headers:
        if name.__class__ is str or value.__class__ is str:
            raise TypeError(_TEXT)
    return refusal


_TEXT = "a request header name or value is text, not bytes"


def byte_fields(headers: Iterable[tuple[bytes | str, bytes | str]]) -> list[tuple[bytes, bytes]]:
    """The header fields with each text name or value as the bytes it spells (UTF-8, as the
    gateway reads and forwards a value): ASGI servers send bytes, an app or a test client
    driving the gateway in-process may pass text. A lone surrogate keeps its code (not
    UTF-8: the forwarded-field check refuses it with a 400)."""
    return [(_bytes(name), _bytes(value)) for name, value in headers]


def _bytes(text: bytes | str) -> bytes:
    return text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text


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
