"""The capacity state's interface and its arithmetic (the backends import this, never the
package, so the package may import them without a cycle)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Final, Literal, NamedTuple, Protocol

if TYPE_CHECKING:
    from fallback_mw.config import RepeatAllowanceConfig

CAPACITY_WINDOW: Final = 60  # seconds: rpm and tpm are per rolling minute

Refusal = Literal["capacity", "repeat_budget"]


class Ask(NamedTuple):  # a tuple: made for every attempt, cheaply
    """What one attempt would add to its upstream's counts."""

    rpm: int | None  # the upstream's declared limits (None: not declared)
    tpm: int | None
    tokens: int  # the estimate counted against `tpm` until the real usage is known
    repeat: bool  # back to an upstream already tried in this request, or a hedge

    @property
    def capacity_declared(self) -> bool:
        return self.rpm is not None or self.tpm is not None


class Reservation(NamedTuple):
    """An attempt as counted: enough to correct its tokens or take it back."""

    upstream: str
    second: int  # the one-second bucket it was counted in (the store's clock)
    tokens: int
    repeat: bool
    counted: bool  # counted against declared capacity
    local: bool = False  # counted in this process alone (Redis was unreachable)


def within_capacity(requests: int, tokens: int, ask: Ask) -> bool:
    """One more request of `ask.tokens` stays within the declared limits of the minute."""
    if ask.rpm is not None and requests + 1 > ask.rpm:
        return False
    return ask.tpm is None or tokens + ask.tokens <= ask.tpm


def capacity_free_in(buckets: Iterable[tuple[int, int, int]], now: int, ask: Ask) -> float | None:
    """Seconds until one more request of `ask.tokens` fits, from the window's one-second
    buckets (second, requests, tokens), oldest first: the time the oldest buckets whose
    leaving makes room leave the rolling minute. None when it never fits."""
    if ask.tpm is not None and ask.tokens > ask.tpm:
        return None
    rows = [(second, r, t) for second, r, t in buckets if now - second < CAPACITY_WINDOW]
    requests = sum(r for _, r, _ in rows)
    tokens = sum(t for _, _, t in rows)
    if within_capacity(requests, tokens, ask):
        return 0.0
    for second, r, t in sorted(rows):
        requests, tokens = requests - r, tokens - t
        if within_capacity(requests, tokens, ask):
            return float(second + CAPACITY_WINDOW - now)
    return 0.0


def repeat_allowed(firsts: int, repeats: int, config: RepeatAllowanceConfig) -> bool:
    """Finagle's RetryBudget: one more repeat stays within `percent` of the first attempts
    in the window plus a floor of `min_per_second` over the window. (The Redis script
    repeats this arithmetic inside its atomic step.) The window is counted in whole
    seconds, as both keep it: `window_ms = 1500` is a 1 s window."""
    window = max(config.window_ms // 1000, 1)
    allowance = firsts * config.percent / 100 + config.min_per_second * window
    return repeats + 1 <= allowance + 1e-9


class CapacityState(Protocol):
    async def reserve(self, upstream: str, ask: Ask) -> Reservation | Refusal: ...

    async def settle(self, reservation: Reservation, tokens: int) -> None:
        """The upstream reported `tokens` for this attempt: it replaces the estimate."""
        ...

    async def cancel(self, reservation: Reservation) -> None:
        """The admitted attempt was not made after all (e.g. the deadline passed during
        the backoff): take it back."""
        ...

    async def release_capacity(self, reservation: Reservation) -> None:
        """The attempt was made but reached no upstream (a game-day fault answered it:
        `fail`, `hang`, `revoke`, `blackhole`): take back its declared-capacity count,
        keep its repeat-allowance count (the walk did repeat)."""
        ...

    async def free_in(self, upstream: str, ask: Ask) -> float | None:
        """Seconds until `ask` fits within the upstream's declared limits as the minute
        rolls (0: now; None: never, an estimate over the whole `tpm`). Asked only when a
        walk found no candidate to attempt (the Retry-After of 503 route_exhausted)."""
        ...

    async def aclose(self) -> None: ...


class ImmediateCapacity(Protocol):
    """What the request path asks of a capacity state that never waits (the memory
    state), answered at the call: its `CapacityState` coroutines' answers, which are these
    calls (one copy of the logic). Asked through `immediate_capacity`."""

    def reserve_now(self, upstream: str, ask: Ask) -> Reservation | Refusal: ...

    def settle_now(self, reservation: Reservation, tokens: int) -> None: ...


# The classes whose instances are their own `ImmediateCapacity`, by exact type (a
# subclass may override the coroutines, and is then asked through them).
IMMEDIATE_CAPACITY: Final[set[type]] = set()


def immediate_capacity(capacity: CapacityState) -> ImmediateCapacity | None:
    """`capacity` answering at the call, when it is a state that never waits; else None."""
    return capacity if type(capacity) in IMMEDIATE_CAPACITY else None  # type: ignore[return-value]
