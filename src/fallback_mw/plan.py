"""The order in which one request walks a route's candidates: canary, pin, strategy."""

from __future__ import annotations

import hashlib
import random

from fallback_mw.config.views import AnyRoute


def canary_bucket(session: str, salt: str) -> int:
    """SPEC §8: 0..9999, deterministic per session."""
    return int(hashlib.sha256(f"{session}:{salt}".encode()).hexdigest()[:8], 16) % 10000


def is_canary(route: AnyRoute, session: str | None, salt: str) -> bool:
    if not route.canary_eligible or session is None or len(route.plan) < 2:
        return False
    return canary_bucket(session, salt) < route.canary_percent * 100


def candidate_order(
    route: AnyRoute,
    *,
    canary: bool = False,
    pinned: str | None = None,
    rng: random.Random | None = None,
) -> list[str]:
    order = list(route.plan)
    if route.strategy == "random":
        # RAND: the plan's first candidate first, then the fallbacks in random order
        # (SPEC §12). Each candidate once per pass; no memory of which failed before.
        fallbacks = order[1:]
        (rng or random).shuffle(fallbacks)
        order[1:] = fallbacks
    if canary:
        # The canary is the route's second candidate, whatever the strategy did.
        order.remove(route.plan[1])
        order.insert(0, route.plan[1])
    if pinned is not None and pinned in order:
        order.remove(pinned)
        order.insert(0, pinned)
    return order
