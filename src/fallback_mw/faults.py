"""Game-day faults as the walker sees them. The store-backed source lives in store/."""

from __future__ import annotations

from typing import Literal, Protocol

UpstreamFault = Literal["fail", "hang"]


class FaultSource(Protocol):
    async def upstream_fault(self, upstream: str) -> UpstreamFault | None: ...

    async def pinned_candidate(self, route_id: str) -> str | None: ...

    async def aclose(self) -> None: ...


class NoFaults:
    async def upstream_fault(self, upstream: str) -> UpstreamFault | None:
        return None

    async def pinned_candidate(self, route_id: str) -> str | None:
        return None

    async def aclose(self) -> None:
        return None
