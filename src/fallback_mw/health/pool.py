"""Credential pools (SPEC §6): per-credential health and session affinity, no I/O.

`credential_mark` is the one place that says what an outcome does to a credential; the
memory state applies it here, the Redis state applies the same mark in Redis.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Set
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Literal

AFFINITY_LIMIT = 10_000  # sessions remembered per upstream (least recently used dropped)


@dataclass(frozen=True, slots=True)
class CredentialMark:
    action: Literal["retire", "cool_down"]
    seconds: float = 0.0  # cool_down only


def credential_mark(
    *,
    status: int | None,
    failure: bool,
    retry_after: float | None,
    default_cooldown: float,
    max_cooldown: float,
) -> CredentialMark | None:
    """401 retires; 403 and 429 cool down (for `Retry-After` when given, capped);
    failover-class failures cool down; anything else leaves the credential as it is."""
    if status == 401:
        return CredentialMark("retire")
    if status in (403, 429):
        seconds = default_cooldown if retry_after is None else retry_after
        return CredentialMark("cool_down", min(max(seconds, 0.0), max_cooldown))
    if failure:
        return CredentialMark("cool_down", default_cooldown)
    return None


@dataclass(slots=True)
class CredentialPool:
    """One upstream's pool. Indexes only: the plan never holds a secret."""

    unusable_until: dict[int, float] = field(default_factory=dict)  # inf = retired
    rotation: int = 0
    affinity: OrderedDict[str, int] = field(default_factory=OrderedDict)

    def usable(self, index: int, now: float) -> bool:
        return self.unusable_until.get(index, -math.inf) <= now

    def pick(
        self, pool_size: int, *, exclude: Set[int], session: str | None, now: float
    ) -> int | None:
        if session is not None:
            bound = self.affinity.get(session)
            usable = bound is not None and bound < pool_size and bound not in exclude
            if bound is not None and usable and self.usable(bound, now):
                self.affinity.move_to_end(session)
                return bound
        # Round robin over the healthy credentials spreads rate limits across the pool.
        start = self.rotation
        self.rotation = (self.rotation + 1) % max(pool_size, 1)
        for offset in range(pool_size):
            index = (start + offset) % pool_size
            if index not in exclude and self.usable(index, now):
                if session is not None:
                    self._bind(session, index)
                return index
        return None

    def apply(self, index: int, mark: CredentialMark | None, now: float) -> None:
        if mark is None:
            return
        if mark.action == "retire":
            self.unusable_until[index] = math.inf
        else:
            until = now + mark.seconds
            self.unusable_until[index] = max(self.unusable_until.get(index, until), until)

    def _bind(self, session: str, index: int) -> None:
        self.affinity[session] = index
        self.affinity.move_to_end(session)
        while len(self.affinity) > AFFINITY_LIMIT:
            self.affinity.popitem(last=False)


def retry_after_seconds(headers: Iterable[tuple[bytes, bytes]]) -> float | None:
    """Retry-After as seconds from now: delta-seconds or an HTTP date (RFC 9110 §10.2.3)."""
    for key, value in headers:
        if key == b"retry-after":
            text = value.decode("latin-1").strip()
            if text.isdigit():
                return float(text[:9])
            try:
                when = parsedate_to_datetime(text)
            except (TypeError, ValueError, IndexError):
                return None
            if when.tzinfo is None:
                return None
            return max((when - datetime.now(UTC)).total_seconds(), 0.0)
    return None
