"""The upstream client seam: one method to send a request and get a response head, a
response object that yields the body chunk by chunk, and one place per engine that turns
low-level errors into failure kinds."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

FailureKind = Literal["transport", "timeout", "refused", "unsafe_address", "protocol"]
Phase = Literal["connect", "first_byte", "body"]


class UpstreamError(Exception):
    """An attempt failed below HTTP. `kind` is what the walker and telemetry see; the
    message never contains a URL query, header value or body."""

    def __init__(self, kind: FailureKind, phase: Phase, message: str = "") -> None:
        super().__init__(message or f"{kind} during {phase}")
        self.kind: FailureKind = kind
        self.phase: Phase = phase

    @property
    def telemetry_kind(self) -> str:
        # SPEC §9 vocabulary: timeouts are "timeout", everything else below HTTP "transport".
        return "timeout" if self.kind == "timeout" else "transport"


_FORBIDDEN_IN_VALUES = frozenset("\r\n\x00")


def check_request_headers(headers: Sequence[tuple[str, str]]) -> None:
    """Refuse, before a connection is used, a header no engine may put on the wire (a
    credential variable changed under a running gateway to `key\\n`...). Raises
    UpstreamError, never the engine's ValueError (which would be a bare 500)."""
    for name, value in headers:
        if _FORBIDDEN_IN_VALUES.intersection(value) or _FORBIDDEN_IN_VALUES.intersection(name):
            raise UpstreamError("protocol", "connect", "invalid request header value")
        try:
            value.encode("latin-1")
        except UnicodeEncodeError:
            raise UpstreamError("protocol", "connect", "invalid request header value") from None


@dataclass(slots=True)
class Timeouts:
    connect: float
    first_byte: float
    idle: float


@dataclass(slots=True)
class UpstreamRequest:
    method: str
    url: str  # full URL including the query string; never logged
    headers: list[tuple[str, str]]
    body: bytes | AsyncIterator[bytes]
    timeouts: Timeouts
    allow_hosts: Sequence[str] = field(default_factory=tuple)


class UpstreamResponse(Protocol):
    status: int
    headers: list[tuple[bytes, bytes]]

    def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive; raises UpstreamError (idle timeout, reset)."""
        ...

    async def aclose(self) -> None:
        """Release the connection. Safe to call twice; completes even when the calling
        task is being cancelled (a shielded close)."""
        ...


class UpstreamClient(Protocol):
    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        """Send the request; return once the response head has arrived. Never follows
        redirects, never decompresses. Raises UpstreamError."""
        ...

    async def aclose(self) -> None: ...
