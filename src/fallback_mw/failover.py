"""The failover rules of SPEC §5, each in one place. The walker, the docs and the trace
all quote these functions; nothing else decides whether another attempt may run."""

from __future__ import annotations

from dataclasses import dataclass

from fallback_mw.config import RouteConfig
from fallback_mw.upstream.base import UpstreamError

# Within a credential pool these may move to another credential of the same upstream.
CREDENTIAL_STATUSES = frozenset({401, 403, 429})


def is_failover_class(
    route: RouteConfig, *, status: int | None, error: UpstreamError | None
) -> bool:
    """A transport error before response headers (refused, reset, connect or first-byte
    timeout), or a status listed in `failover_status`."""
    if error is not None:
        return error.phase in ("connect", "first_byte") and error.kind != "unsafe_address"
    return status is not None and status in route.failover_status


@dataclass(frozen=True, slots=True)
class WalkState:
    replayable: bool  # method listed in replayable_methods and the whole body buffered
    client_connected: bool
    deadline_left: bool
    response_started: bool  # any byte, even http.response.start, sent to the client
    attempts_made: int
    attempt_ceiling: int


def further_attempt_allowed(state: WalkState, *, last_failed_failover_class: bool) -> bool:
    """SPEC §5: a further attempt happens only when all of these hold."""
    return (
        state.replayable
        and state.client_connected
        and state.deadline_left
        and not state.response_started
        and state.attempts_made < state.attempt_ceiling
        and last_failed_failover_class
    )
