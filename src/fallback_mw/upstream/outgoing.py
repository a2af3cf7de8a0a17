"""What the walk hands an engine to send (`UpstreamRequest`) and the timers it is sent under
(`Timeouts`): upstream/base.py, the engines' interface, names them too. Made once an
attempt, so compiled (scripts/compile.py), the request's `__init__` written out."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Timeouts:
    connect: float
    first_byte: float
    idle: float


# The `__init__` written out (request/records.py says why).
@dataclass(slots=True, init=False)
class UpstreamRequest:
    method: str
    url: str  # full URL including the query string; never logged
    headers: list[tuple[str, str]]
    body: bytes | AsyncIterator[bytes]
    timeouts: Timeouts
    allow_hosts: Sequence[str]
    # The per-upstream connection cap (SPEC §12 `max_connections`; 0: none) and the key it
    # is counted under (the upstream's name).
    max_connections: int
    pool_key: str
    # The upstream's own TLS trust (`ca_file`; None: the engine's default) and egress
    # proxy (`proxy`; None: direct).
    ca_file: str | None
    proxy: str | None
    # Whether the request got past the engine's connection cap: the shipped engines set
    # False as `send` starts and True once it holds a slot (still False at the end: nothing
    # of it left the gateway, so no rpm / tpm count is kept for it). None: an engine that
    # says nothing (a host's own, written from the protocol): what it was handed is sent.
    slot_taken: bool | None
    # The walk may send this request again (failover.replay.is_replayable: its method, its body
    # buffered): then, lost on a kept-alive connection, it goes again on a new one
    # (`resend_on_new_connection`).
    replayable: bool

    def __init__(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes | AsyncIterator[bytes],
        timeouts: Timeouts,
        allow_hosts: Sequence[str] | None = None,
        max_connections: int = 0,
        pool_key: str = "",
        ca_file: str | None = None,
        proxy: str | None = None,
        slot_taken: bool | None = None,
        replayable: bool = False,
    ) -> None:
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body
        self.timeouts = timeouts
        self.allow_hosts = () if allow_hosts is None else allow_hosts
        self.max_connections = max_connections
        self.pool_key = pool_key
        self.ca_file = ca_file
        self.proxy = proxy
        self.slot_taken = slot_taken
        self.replayable = replayable
