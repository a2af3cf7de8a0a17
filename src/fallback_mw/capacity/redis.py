"""Capacity and repeat-allowance counts shared by every gateway process through Redis.

One hash per upstream, fields `r:<second>`, `t:<second>`, `f:<second>`, `p:<second>`
(requests, tokens, first attempts, repeats). Each reservation is one Lua script: read the
window, decide, count, in one atomic step, so two processes never both take the last
slot. Time is Redis's own (`TIME`). The key expires after the longest window.

A first attempt at an upstream that declares no capacity needs no answer from Redis: it is
counted locally and deposited with this process's next reservation for that upstream, or at
most `flush_interval` (1 s) later, so the common attempt costs no extra round trip (the
repeat allowance may see up to a second of another process's first attempts late, which
only makes it stricter). Each is deposited in the second it was made (its age with it), so
one made before a quiet spell longer than the allowance's window grants no repeat after it.

The scripts run on the health state's Redis connections (`RedisHealth.run_script`): if
Redis cannot be reached this process counts alone (its memory state) until it is back, and
the outage is logged and counted once, by the health state. An attempt counted there is
settled and cancelled there too (never in a Redis field it was not counted in)."""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from fallback_mw.capacity.memory import MemoryCapacity
from fallback_mw.capacity.model import (
    CAPACITY_WINDOW,
    Ask,
    Refusal,
    Reservation,
    capacity_free_in,
)
from fallback_mw.config import RepeatAllowanceConfig
from fallback_mw.health.redis import RedisHealth

# How many seconds ahead of Redis's own clock a count's second may be and still count (as
# written now): a replica whose clock ran a little ahead, promoted by a failover, wrote the
# last seconds' counts so. Further ahead it is a hand edit, dropped.
CLOCK_SKEW = 5

# A count as these scripts write it (HINCRBY's digits), or nil: a negative count, a float,
# `1e9`, `inf` (written by hand, another version) is none. `skew` is CLOCK_SKEW.
_COUNT = f"""
local skew = {CLOCK_SKEW}
local function count(text)
  if string.match(text, '^%d+$') and #text <= 18 then return tonumber(text) end
  return nil
end
"""

# First attempts counted in this process, deposited each in its own second: ARGV from
# `first` on are pairs of (age in seconds, count).
_DEPOSIT = """
local function deposit(now, first)
  for i = first, #ARGV, 2 do
    redis.call('HINCRBY', KEYS[1], 'f:' .. (now - tonumber(ARGV[i])), ARGV[i + 1])
  end
end
"""

# KEYS[1] the upstream's hash. ARGV: repeat '1'/'0', counted '1'/'0', rpm (-1: none),
# tpm (-1: none), tokens, percent, min_per_second, window s, keep s, ttl ms, then the first
# attempts this process counted since its last call (`_DEPOSIT`'s pairs, deposited before
# the check).
# Returns {'ok' | 'capacity' | 'repeat_budget', second}. The allowance arithmetic is
# capacity.repeat_allowed's; the capacity arithmetic capacity.within_capacity's.
ADMIT = (
    _COUNT
    + _DEPOSIT
    + """
local now = tonumber(redis.call('TIME')[1])
local window, keep = tonumber(ARGV[8]), tonumber(ARGV[9])
deposit(now, 11)
local fields = redis.call('HGETALL', KEYS[1])
local requests, tokens, firsts, repeats = 0, 0, 0, 0
for i = 1, #fields, 2 do
  local kind, second = string.sub(fields[i], 1, 1), count(string.sub(fields[i], 3))
  local value = count(fields[i + 1])
  -- a field that reads as no count (written by hand, another version) is dropped like an
  -- old one: a script failing on it read as "Redis unreachable" (health/redis.py). So is
  -- one of a second more than `skew` after now (every count is written at Redis's own
  -- TIME): read as recent, `r:<years ahead>` held a declared rpm full for ever, its
  -- Retry-After years. One a few seconds ahead (another clock's) counts as now.
  local age = keep
  if second and value and second <= now + skew then age = math.max(now - second, 0) end
  if age >= keep then
    redis.call('HDEL', KEYS[1], fields[i])
  else
    if age < 60 then
      if kind == 'r' then requests = requests + value elseif kind == 't' then
        tokens = tokens + value end
    end
    if age < window then
      if kind == 'f' then firsts = firsts + value elseif kind == 'p' then
        repeats = repeats + value end
    end
  end
end
if ARGV[1] == '1' then
  local allowance = firsts * tonumber(ARGV[6]) / 100 + tonumber(ARGV[7]) * window
  if repeats + 1 > allowance + 1e-9 then return {'repeat_budget', now} end
end
local ask = tonumber(ARGV[5])
if ARGV[2] == '1' then
  local rpm, tpm = tonumber(ARGV[3]), tonumber(ARGV[4])
  if rpm >= 0 and requests + 1 > rpm then return {'capacity', now} end
  if tpm >= 0 and tokens + ask > tpm then return {'capacity', now} end
  redis.call('HINCRBY', KEYS[1], 'r:' .. now, 1)
  redis.call('HINCRBY', KEYS[1], 't:' .. now, ask)
end
if ARGV[1] == '1' then
  redis.call('HINCRBY', KEYS[1], 'p:' .. now, 1)
else
  redis.call('HINCRBY', KEYS[1], 'f:' .. now, 1)
end
redis.call('PEXPIRE', KEYS[1], ARGV[10])
return {'ok', now}
"""
)

# KEYS[1] the upstream's hash. ARGV: ttl ms, then `_DEPOSIT`'s pairs.
DEPOSIT = (
    _DEPOSIT
    + """
local now = tonumber(redis.call('TIME')[1])
deposit(now, 2)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return now
"""
)

# KEYS[1] the upstream's hash. ARGV: pairs of (field, delta); a field no longer in the
# window is left alone.
ADJUST = """
for i = 1, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    redis.pcall('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])  -- a field no count: left as is
  end
end
return 0
"""


# KEYS[1] the upstream's hash. Returns {now, second, requests, tokens, ...} for the seconds
# of the rolling minute (capacity.capacity_free_in does the arithmetic).
WINDOW = (
    _COUNT
    + """
local now = tonumber(redis.call('TIME')[1])
local fields = redis.call('HGETALL', KEYS[1])
local seconds, out = {}, {now}
for i = 1, #fields, 2 do
  local kind, second = string.sub(fields[i], 1, 1), string.sub(fields[i], 3)
  local value = count(fields[i + 1]) or 0
  -- As ADMIT reads it: a count a few seconds ahead counts from now until its own second
  -- leaves the minute, so it stays that second (read as now, the Retry-After was up to
  -- `skew` seconds short of when ADMIT lets the request through).
  local at = count(second)
  if (kind == 'r' or kind == 't') and at and at <= now + skew and now - at < 60 then
    second = tostring(at)
    local row = seconds[second]
    if row == nil then row = {0, 0}; seconds[second] = row end
    if kind == 'r' then row[1] = row[1] + value else row[2] = row[2] + value end
  end
end
for second, row in pairs(seconds) do
  out[#out + 1] = tonumber(second); out[#out + 1] = row[1]; out[#out + 1] = row[2]
end
return out
"""
)


def _undo_admit(
    keys: list[str], args: list[Any], result: Any
) -> tuple[str, str, list[str], list[Any]] | None:
    """ADJUST taking back what an ADMIT whose caller gave up (cancelled while it waited for
    Redis) counted: nobody will make, settle or cancel that attempt. The first attempts it
    deposited stay (they were made)."""
    if str(result[0]) != "ok":
        return None
    second = int(result[1])
    deltas: list[Any] = [f"{'p' if args[0] == '1' else 'f'}:{second}", -1]
    if args[1] == "1":  # counted against declared capacity
        deltas += [f"r:{second}", -1, f"t:{second}", -int(args[4])]
    return "capacity_adjust", ADJUST, keys, deltas


class RedisCapacity:
    """The counts in Redis, on the health state's connections (one bounded pool per
    process, one outage warning): `redis` is the gateway's `RedisHealth`."""

    def __init__(
        self, redis: RedisHealth, allowance: RepeatAllowanceConfig, *, owned: bool = False
    ) -> None:
        self.redis = redis
        self.owned = owned  # made for this object alone: closed with it
        self.allowance = allowance
        self.prefix = redis.prefix
        self.local = MemoryCapacity(allowance)
        self.window = self.local.window
        self.keep = self.local.keep
        self.ttl_ms = (self.keep + 5) * 1000
        self.flush_interval = 1.0
        # First attempts not yet deposited, per upstream: their count per second (this
        # process's monotonic clock, whole seconds).
        self._pending: dict[str, dict[int, int]] = {}
        self._pending_since: dict[str, float] = {}

    def _key(self, upstream: str) -> str:
        return f"{self.prefix}capacity:{upstream}"

    async def _deposit(self, upstream: str) -> None:
        pending = self._take_pending(upstream)
        ages = self._ages(pending)
        if ages:
            result = await self.redis.run_script(
                "capacity_deposit", DEPOSIT, [self._key(upstream)], [self.ttl_ms, *ages]
            )
            if result is None:  # not delivered: keep it for the next call
                self._keep_pending(upstream, pending)

    def _count_first(self, upstream: str) -> None:
        second = int(time.monotonic())
        counts = self._pending.setdefault(upstream, {})
        counts[second] = counts.get(second, 0) + 1

    def _take_pending(self, upstream: str) -> dict[int, int]:
        self._pending_since.pop(upstream, None)
        return self._pending.pop(upstream, {})

    def _keep_pending(self, upstream: str, pending: dict[int, int]) -> None:
        """`pending`, taken but not delivered, kept for the next call."""
        if pending:
            counts = self._pending.setdefault(upstream, {})
            for second, count in pending.items():
                counts[second] = counts.get(second, 0) + count
            self._pending_since.setdefault(upstream, time.monotonic())

    def _ages(self, pending: dict[int, int]) -> list[int]:
        """`pending` as (age in seconds, count) pairs, flat; those too old to count in any
        window left out."""
        now = int(time.monotonic())
        pairs: list[int] = []
        for second, count in pending.items():
            age = max(now - second, 0)
            if age < self.keep and count > 0:
                pairs += [age, count]
        return pairs

    async def reserve(self, upstream: str, ask: Ask) -> Reservation | Refusal:
        if not ask.repeat and not ask.capacity_declared:
            # Nothing to check: counted here (and in local memory, for an outage).
            await self.local.reserve(upstream, ask)
            self._count_first(upstream)
            since = self._pending_since.setdefault(upstream, time.monotonic())
            if time.monotonic() - since >= self.flush_interval:
                await self._deposit(upstream)
            return Reservation(upstream, -1, 0, False, False)  # -1: not yet in Redis
        allowance = self.allowance
        pending = self._take_pending(upstream)
        result = await self.redis.run_script(
            "capacity_admit",
            ADMIT,
            [self._key(upstream)],
            [
                "1" if ask.repeat else "0",
                "1" if ask.capacity_declared else "0",
                -1 if ask.rpm is None else ask.rpm,
                -1 if ask.tpm is None else ask.tpm,
                ask.tokens,
                repr(float(allowance.percent)),
                repr(float(allowance.min_per_second)),
                self.window,
                max(self.keep, CAPACITY_WINDOW),
                self.ttl_ms,
                *self._ages(pending),
            ],
            undo=_undo_admit,  # made once, not per reservation
        )
        if result is None:  # Redis unreachable: this process counts alone for now
            self._keep_pending(upstream, pending)
            counted = await self.local.reserve(upstream, ask)
            if isinstance(counted, Reservation):  # corrected there too, never in Redis
                return counted._replace(local=True)
            return counted
        verdict, second = str(result[0]), int(result[1])
        if verdict == "capacity":
            return "capacity"
        if verdict == "repeat_budget":
            return "repeat_budget"
        return Reservation(upstream, second, ask.tokens, ask.repeat, ask.capacity_declared)

    async def _adjust(self, reservation: Reservation, deltas: list[tuple[str, int]]) -> None:
        args: list[Any] = []
        for kind, delta in deltas:
            if delta:
                args += [f"{kind}:{reservation.second}", delta]
        if args:
            await self.redis.run_script(
                "capacity_adjust", ADJUST, [self._key(reservation.upstream)], args
            )

    async def settle(self, reservation: Reservation, tokens: int) -> None:
        if reservation.local:
            await self.local.settle(reservation, tokens)
        elif reservation.counted:
            await self._adjust(reservation, [("t", tokens - reservation.tokens)])

    async def cancel(self, reservation: Reservation) -> None:
        if reservation.local:
            await self.local.cancel(reservation)
            return
        if reservation.second < 0:  # a first attempt still counted locally
            counts = self._pending.get(reservation.upstream)
            if counts:  # taken from the latest second (which one it was is not kept)
                latest = max(counts)
                counts[latest] -= 1
                if not counts[latest]:
                    del counts[latest]
            return
        deltas = [("p" if reservation.repeat else "f", -1)]
        if reservation.counted:
            deltas += [("r", -1), ("t", -reservation.tokens)]
        await self._adjust(reservation, deltas)

    async def release_capacity(self, reservation: Reservation) -> None:
        if reservation.local:
            await self.local.release_capacity(reservation)
        elif reservation.counted:
            await self._adjust(reservation, [("r", -1), ("t", -reservation.tokens)])

    async def free_in(self, upstream: str, ask: Ask) -> float | None:
        result = await self.redis.run_script("capacity_window", WINDOW, [self._key(upstream)], [])
        if result is None:  # Redis unreachable: what this process counted alone
            return await self.local.free_in(upstream, ask)
        values = [int(v) for v in result]
        rows = zip(values[1::3], values[2::3], values[3::3], strict=True)
        return capacity_free_in(rows, values[0], ask)

    def keep_only(self, upstreams: Collection[str]) -> None:
        """This process's own windows forget every upstream but `upstreams`
        (MemoryCapacity's); the shared keys expire by themselves."""
        self.local.keep_only(upstreams)

    async def aclose(self) -> None:
        if self.owned:
            await self.redis.aclose()
