"""Credential pools (SPEC §6, §12): per-credential health, selection and session affinity,
no I/O.

`credential_mark` is the one place that says what an outcome does to a credential; the
memory state applies it here, the Redis state applies the same mark in Redis.

Selection (`selection` on the upstream): `round_robin` rotates over the usable
credentials; `score` takes the usable credential with the best score, where the score
is the recent success rate (optimistic: an untried credential scores 1, a failure-only
one falls towards 0) divided by (1 + its mean latency in seconds), all counts decayed with
a half-life of `SCORE_HALF_LIFE` seconds (a credential that failed long ago is tried
again). Ties rotate. Affinity comes first either way: a session keeps
its credential while it is usable, keyed by (route, model, session) (`affinity_key`).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Final, Literal

AFFINITY_LIMIT: Final = 10_000  # sessions remembered per upstream (least recently used dropped)
_LONGEST_AFFINITY_KEY: Final = 256  # characters kept as they are; a longer key by its digest
# not Final: tests/test_credential_pool.py shortens it, and the compiled core must see that.
SCORE_HALF_LIFE = 60.0  # seconds: an observation this old counts half
Selection = Literal["round_robin", "score"]


def affinity_key(route: str, model: str | None, session: str | None) -> str | None:
    """What session affinity is keyed by (SPEC §12): the route, the requested model and the
    session; None (no affinity) without a session."""
    if session is None:
        return None
    key = "\x1f".join((route, model or "", session))
    if len(key) > _LONGEST_AFFINITY_KEY:
        # A caller's session header may be 64 KiB: 10,000 of them kept whole per upstream
        # would be some 640 MiB. A digest stands for a long key (the Redis state keeps
        # only digests anyway).
        return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return key


@dataclass(frozen=True, slots=True)
class CredentialMark:
    action: Literal["retire", "cool_down", "quota"]
    seconds: float = 0.0  # cool_down and quota: how long the credential is unusable


def credential_mark(
    *,
    status: int | None,
    failure: bool,
    retry_after: float | None,
    default_cooldown: float,
    max_cooldown: float,
    quota: float | None = None,
) -> CredentialMark | None:
    """401 retires; a 429 whose answer says the quota is spent (`quota`: seconds until it
    resets, see health/quota.py) retires the credential until then, or until its
    `Retry-After` when that is later (the upstream's own word on when to come back); 403
    and a plain 429 cool down (for `Retry-After` when given, capped); failover-class
    failures cool down; anything else leaves the credential as it is."""
    if status == 401:
        return CredentialMark("retire")
    if status == 429 and quota is not None:
        later = 0.0 if retry_after is None else min(max(retry_after, 0.0), max_cooldown)
        return CredentialMark("quota", max(quota, later))
    if status in (403, 429):
        seconds = default_cooldown if retry_after is None else retry_after
        return CredentialMark("cool_down", min(max(seconds, 0.0), max_cooldown))
    if failure:
        return CredentialMark("cool_down", default_cooldown)
    return None


def score(successes: float, failures: float, latency_sum: float) -> float:
    """Recent success rate over (1 + mean latency in seconds). Optimistic: an untried (or
    long quiet) credential scores 1, so it is tried before one known to be slow. The mean
    is taken over at least one answer: once the successes have decayed below one, the
    latency they carried decays with them (a ratio of two decayed counts never would: a
    credential slow once kept that latency, and its traffic away, for half an hour)."""
    rate = (successes + 1.0) / (successes + failures + 1.0)
    latency = latency_sum / max(successes, 1.0)
    return rate / (1.0 + latency)


def decay_factor(elapsed: float) -> float:
    return math.pow(0.5, max(elapsed, 0.0) / SCORE_HALF_LIFE)


@dataclass(slots=True)
class CredentialStats:
    """One credential's decayed outcomes (for `selection = "score"`)."""

    successes: float = 0.0
    failures: float = 0.0
    latency_sum: float = 0.0  # seconds, over the successes
    at: float = 0.0

    def decayed(self, now: float) -> CredentialStats:
        factor = decay_factor(now - self.at)
        return CredentialStats(
            self.successes * factor, self.failures * factor, self.latency_sum * factor, now
        )

    def add(self, *, ok: bool, latency: float | None, now: float) -> CredentialStats:
        current = self.decayed(now)
        if ok:
            current.successes += 1.0
            current.latency_sum += max(latency or 0.0, 0.0)
        else:
            current.failures += 1.0
        return current

    def score(self, now: float) -> float:
        current = self.decayed(now)
        return score(current.successes, current.failures, current.latency_sum)


def score_outcome(*, status: int | None, failure: bool) -> bool:
    """What counts as a success for the score: an answer that is not a failover-class
    failure and not a credential's own refusal (401 / 403 / 429)."""
    return not failure and status not in (401, 403, 429)


@dataclass(slots=True)
class CredentialPool:
    """One upstream's pool. Indexes only: the plan never holds a secret."""

    unusable_until: dict[int, float] = field(default_factory=dict)  # inf = retired
    rotation: int = 0
    affinity: OrderedDict[str, int] = field(default_factory=OrderedDict)
    stats: dict[int, CredentialStats] = field(default_factory=dict)

    def usable(self, index: int, now: float) -> bool:
        return self.unusable_until.get(index, -math.inf) <= now

    def usable_in(self, pool_size: int, now: float) -> float | None:
        """Seconds until a credential of the pool is usable (0: one is now); None when
        every one is retired for good (a 401: it does not come back by itself)."""
        waits = [self.unusable_until.get(i, -math.inf) - now for i in range(pool_size)]
        soonest = min(waits, default=0.0)
        return None if soonest == math.inf else max(soonest, 0.0)

    def pick(
        self,
        pool_size: int,
        *,
        exclude: Set[int],
        session: str | None,
        now: float,
        selection: Selection = "round_robin",
    ) -> int | None:
        """`session` is the affinity key (`affinity_key`), None for no affinity."""
        if session is not None:
            bound = self.affinity.get(session)
            usable = bound is not None and bound < pool_size and bound not in exclude
            if bound is not None and usable and self.usable(bound, now):
                self.affinity.move_to_end(session)
                return bound
        # Round robin over the healthy credentials spreads rate limits across the pool;
        # with `score` the best one wins and the rotation only breaks ties.
        start = self.rotation
        self.rotation += 1  # not wrapped at the pool's size: the usable ones may be fewer
        best: int | None = None
        if selection != "score":
            # The turn is taken among the usable ones: a credential out of the rotation
            # does not hand its turns to the next one (2/3 of the traffic on one key).
            ok = [i for i in range(pool_size) if i not in exclude and self.usable(i, now)]
            best = ok[start % len(ok)] if ok else None
        else:
            best_score = -1.0
            for offset in range(pool_size):
                index = (start + offset) % pool_size
                if index in exclude or not self.usable(index, now):
                    continue
                value = self.stats.get(index, CredentialStats(at=now)).score(now)
                if value > best_score:
                    best, best_score = index, value
        if best is not None and session is not None:
            self._bind(session, best)
        return best

    def observe(self, index: int, *, ok: bool, latency: float | None, now: float) -> None:
        stats = self.stats.get(index, CredentialStats(at=now))
        self.stats[index] = stats.add(ok=ok, latency=latency, now=now)

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


def retry_after_seconds(headers: Sequence[tuple[bytes, bytes]]) -> float | None:
    """Retry-After as seconds from now: delta-seconds or an HTTP date (RFC 9110 §10.2.3),
    the date counted from the answer's own `Date` (`sent_at`).
    `retry-after-ms` (OpenAI's and Azure OpenAI's millisecond form, which their SDKs read
    first) wins when it is readable: a non-negative decimal number of milliseconds."""
    values: list[bytes] = []
    for key, value in headers:
        if key == b"retry-after-ms":
            millis = _milliseconds(value)
            if millis is not None:
                return millis / 1000
        elif key == b"retry-after":
            values.append(value)
    for value in values:
        seconds = _retry_after(value, headers)
        if seconds is not None:
            return seconds
    return None


def http_date(value: bytes | str) -> datetime | None:
    """An HTTP-date (any of its three forms, all GMT: RFC 9110 §5.6.7); None when it is
    not one."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    try:
        when = parsedate_to_datetime(text.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        # OverflowError: a year past any date's (`1 Jan 10000000000 ...`), which
        # raised out of the attempt (a 500 instead of the pool's next credential).
        return None
    # The asctime form (`Sun Nov  6 08:49:37 1994`) names no zone: it is GMT too. Read as
    # unreadable, the credential cooled for cooldown_ms instead of until that moment.
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def sent_at(headers: Iterable[tuple[bytes, bytes]]) -> datetime:
    """When the upstream says it sent its answer (its `Date`), else this host's now: a
    moment the answer names (a Retry-After date, a quota's reset) is counted from its
    sender's clock, so a gateway host whose clock is off (broken NTP) does not ask a key
    again at once (clock ahead: the moment read as past) or keep it out too long."""
    for key, value in headers:
        if key == b"date":
            when = http_date(value)
            if when is not None:
                return when
    return datetime.now(UTC)


def _milliseconds(value: bytes) -> float | None:
    """`1500`, `1500.5`: ASCII digits with at most one decimal point; anything else
    (a sign, an exponent, `nan`, `²`) is unreadable."""
    whole, _, fraction = value.strip().partition(b".")
    if not whole.isdigit() or (fraction and not fraction.isdigit()):
        return None
    return float(value)


def _retry_after(value: bytes, headers: Sequence[tuple[bytes, bytes]]) -> float | None:
    text = value.decode("latin-1").strip()
    if text.isascii() and text.isdigit():  # `²` is a digit to isdigit, not to float
        # Whole: the first 9 digits of `0000000000120` said 0 (no cool-down at all).
        # A huge value is a huge float (inf at worst), capped by the caller.
        return float(text)
    when = http_date(text)
    if when is None:
        return None
    return max((when - sent_at(headers)).total_seconds(), 0.0)
