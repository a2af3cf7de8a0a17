"""Game-day faults as the walker sees them. The store-backed source lives in store/."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from fallback_mw.upstream.blackhole import Blackhole

# fail: a synthetic 503, no packet leaves; hang: the attempt waits out its first-byte
# timeout in the gateway; blackhole: the attempt really connects, to a local listener that
# accepts and never answers (the engine's own timeouts fire); revoke: a synthetic 401, as a
# vendor-disabled credential answers (the credential is retired, the pool moves on).
UpstreamFault = Literal["fail", "hang", "blackhole", "revoke"]
UPSTREAM_FAULTS: tuple[UpstreamFault, ...] = ("fail", "hang", "blackhole", "revoke")


class FaultSource(Protocol):
    async def upstream_fault(self, upstream: str) -> UpstreamFault | None: ...

    async def pinned_candidate(self, route_id: str) -> str | None: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class BlackholeSource(Protocol):
    """A fault source that can apply `blackhole`: it owns the process's listener."""

    def blackhole(self) -> Blackhole: ...


class NoFaults:
    async def upstream_fault(self, upstream: str) -> UpstreamFault | None:
        return None

    async def pinned_candidate(self, route_id: str) -> str | None:
        return None

    async def aclose(self) -> None:
        return None
