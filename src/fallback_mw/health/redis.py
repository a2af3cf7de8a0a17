"""Health state shared by every gateway process through Redis (`state = "redis://..."`).

Each transition is one Lua script, so it is atomic across processes: exactly one process
gets the half-open probe. Time is Redis's own clock (`TIME`), so processes with skewed
clocks agree. Every key expires. `?prefix=` in the URL namespaces the keys.

If Redis cannot be reached the gateway keeps serving on this process's in-memory state,
logs one warning per outage (its reason in Redis's words, never the URL's password) and
counts it in a metric. While the outage lasts no request waits for Redis: every
`retry_interval` seconds one try in the background (a script's write, `_usable`) tests
it again, and the first that succeeds ends the outage (logged). A Redis that hangs
(stopped, a network that drops packets) costs the calls in flight when it began one
`socket_timeout`, and nothing after.
The tries are made on a new connection pool: the connections of before may be dead (Redis
restarted, a proxy or the network dropped them) and redis-py hands an idle one out
unchecked, so each would fail once Redis is back, and each failure would start an "outage"
of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar
from urllib.parse import unquote, urlsplit

from opentelemetry import metrics
from opentelemetry.metrics import MeterProvider

from fallback_mw.extras import missing_extra, package_version
from fallback_mw.grouping import Group, Pending, fail
from fallback_mw.loops import CloseAtLoopEnd, close_on_its_loop

try:
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import NoScriptError, RedisError, ResponseError
except ImportError:
    raise missing_extra("redis", 'state = "redis://..."') from None

from fallback_mw.config import BreakerConfig
from fallback_mw.health.breaker import DEFAULT_PROBE_LEASE
from fallback_mw.health.events import Admission, TransitionListener
from fallback_mw.health.memory import MemoryHealth, breaker_credential_mark, report_transition
from fallback_mw.health.pool import AFFINITY_LIMIT, SCORE_HALF_LIFE, Selection, score_outcome
from fallback_mw.health.redis_scripts import (
    ADMIT,
    BREAKER_STATE,
    FAULT_MARKED,
    FORGET,
    GIVE_BACK,
    MARK,
    OBSERVE,
    OPEN_FAULT,
    PICK,
    POOL_FAULT,
    RECORD,
    RELEASE,
    RESET_FAULT,
    RESTORE_FAULT_MARKS,
    SKIP_FAULT,
    USABLE_IN,
)
from fallback_mw.store_url import redact_url, split_state_url

logger = logging.getLogger("fallback_mw.health")

T = TypeVar("T")

CREDENTIAL_TTL_MS = 24 * 3600 * 1000  # a retired credential stays retired this long
AFFINITY_TTL_MS = 3600 * 1000  # an idle session forgets its credential after this long
# How often a process whose gauge says a breaker is not closed reads its shared state.
REFRESH_INTERVAL = 5.0


# Connections to Redis per gateway process. Each health call holds one for a round trip
# (well under a millisecond on a LAN), so 50 serve thousands of calls a second; beyond
# that callers wait for a free one (pool_timeout) instead of failing.
DEFAULT_MAX_CONNECTIONS = 50


_STATE_AFTER = {"opened": "open", "reopened": "open"}  # other transitions name the state


def shared_probe(admission: Admission | None) -> str:
    """The admission that ended, as RECORD and RELEASE read it: '*' when nobody said (taken
    as the probe's), '-' a closed breaker's, else the probe's owner."""
    if admission is None or admission.probe is None:
        return "*"
    return admission.probe or "-"


# The try of a state in an outage (`RedisHealth._usable`): a script that writes, as every
# health call is.
_ALIVE = "redis.call('SET', KEYS[1], '1', 'PX', 10000) return 1"

# The kinds of key (`{prefix}{kind}:...`) that hold a string; every other kind a hash.
_STRING_KEYS = frozenset({"rotation", "breaker_url"})
# KEYS[1] deleted when it holds another kind of value than ARGV[1] (checked and deleted in
# one step: another process may have deleted it and written the right kind since).
_DROP_OTHER_KIND = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == ARGV[1] or kind == 'none' then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""


def _wrong_type(result: Any) -> bool:
    """Whether a script failed on a key that holds another kind of value than the one it
    keeps there (a string where a hash belongs: written by hand, or by another program
    under the same prefix). Redis answered: that is no outage."""
    return isinstance(result, ResponseError) and str(result).find("WRONGTYPE") >= 0


def _took_probe(result: Any) -> bool:
    """Whether ADMIT's answer gave its admission the half-open probe slot."""
    return (
        isinstance(result, list)
        and len(result) > 2
        and str(result[0]) == "1"
        and result[2] == "half_open"
    )


class _Unavailable:
    pass


async def _nothing() -> None:
    return None


_UNAVAILABLE = _Unavailable()


# What takes back a script call's effect when its caller gave up before the answer came:
# given the call's keys, args and result, the script call to run, (name, source, keys,
# args), or None: nothing to undo.
Undo = Callable[[list[str], list[Any], Any], tuple[str, str, list[str], list[Any]] | None]


class _ScriptCall(NamedTuple):
    """A script call waiting for its pipeline."""

    name: str
    source: str
    keys: list[str]
    args: list[Any]
    undo: Undo | None = None


class RedisHealth:
    def __init__(
        self,
        url: str,
        breaker: BreakerConfig | None = None,
        *,
        probe_lease: float = DEFAULT_PROBE_LEASE,
        retry_interval: float = 1.0,
        socket_timeout: float = 0.5,
        refresh_interval: float = REFRESH_INTERVAL,
        on_transition: TransitionListener | None = None,
        on_observed: TransitionListener | None = None,
        meter_provider: MeterProvider | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        pool_timeout: float = 2.0,
        pools: Mapping[str, Sequence[str]] | None = None,
        series_at_zero: Callable[[metrics.Counter], None] | None = None,
    ) -> None:
        self.on_transition = on_transition
        # Told of a state another process moved the shared breaker to (the gauge follows
        # it; not a transition of this process's, so not counted twice); else on_transition.
        self.on_observed = on_observed
        # Credential marks are kept per index; an index means one variable only within one
        # list of variables. A pool whose list changed (a revoked key removed, one added or
        # reordered) gets keys of its own, so no mark lands on another credential.
        self._upstreams = tuple(pools or ())  # read at startup (_read_shared_breakers)
        self._pool_ids = {
            name: hashlib.sha256("\x1f".join(envs).encode()).hexdigest()[:12]
            for name, envs in (pools or {}).items()
            if len(envs) > 1
        }
        meter = (meter_provider or metrics.get_meter_provider()).get_meter(
            "fallback_mw", package_version()
        )
        self.local_fallbacks = meter.create_counter(
            "gateway.health.local_fallbacks",
            unit="{operation}",
            description="Health operations served from local memory because Redis was unreachable",
        )
        # Exported at 0 from the start: an outage's first calls are then an increase
        # (`increase(...) > 0` cannot see a series that first appears at its count). The
        # gateway's telemetry adds it again once a host's SDK installed later collects.
        if series_at_zero is None:
            self.local_fallbacks.add(0)
        else:
            series_at_zero(self.local_fallbacks)
        self.config = breaker or BreakerConfig()
        self._url, self.prefix = split_state_url(url)
        self._label = redact_url(self._url)
        self.probe_lease_ms = max(int(probe_lease * 1000), 1)  # admit's lease may be longer
        self.retry_interval = retry_interval
        self.socket_timeout = socket_timeout
        self.max_connections = max_connections
        self.pool_timeout = pool_timeout
        self._seen: dict[str, str] = {}  # breaker state last reported, per upstream
        # While a breaker this process reported is not closed, its shared state is read
        # every refresh_interval (`_watch`): another process's probe may close it.
        self.refresh_interval = refresh_interval
        self._refresh_timer: asyncio.TimerHandle | None = None
        self._refreshing: asyncio.Task[None] | None = None
        self.local = MemoryHealth(
            self.config, probe_lease=probe_lease, on_transition=self._local_transition
        )
        self._client: aioredis.Redis | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None  # the one it runs on
        self._at_loop_end: CloseAtLoopEnd | None = None  # closes the client as its loop ends
        self._scripts: dict[str, Any] = {}
        self._retry_at = 0.0
        self._outage = False
        self.outage_reason: str | None = None  # why the current outage began (no password)
        self._pool_sizes: dict[str, int] = {}
        self._selections: dict[str, Selection] = {}
        self.local_fallback_calls = 0  # calls served on local state (tests, the soak)
        # Script calls waiting for the next pipeline (`_run`), one group per event loop.
        self._group: Group[_ScriptCall] | None = None
        self._senders: set[asyncio.Task[None]] = set()
        self._retiring: set[asyncio.Task[None]] = set()  # closing a pool an outage retired
        self._trying: asyncio.Task[None] | None = None  # the try of an outage's next try
        self._retry_timer: asyncio.TimerHandle | None = None  # when that try is due
        # Admissions are numbered (with this object's id, the owner of a probe slot they
        # take); those sent whose answer never came are given back once Redis is back.
        self._owner = os.urandom(6).hex()
        self._admissions = itertools.count()
        self._unanswered: list[tuple[str, int]] = []  # (breaker key, admission number)
        self._giving_back: set[asyncio.Task[None]] = set()
        # Upstreams whose fault ended while Redis was unreachable: the reset reached only
        # the local state, so it is made again on the shared one once Redis is back (else
        # the fault's shared breaker outlived it, skipped by every process for its cooldown).
        self._fault_resets: set[str] = set()
        # Likewise upstreams whose url changed (`forget`) while Redis was unreachable: their
        # shared breaker is still the old url's, dropped once Redis is back.
        self._forgets: dict[str, str] = {}
        self._dropping: set[str] = set()  # keys of the wrong kind being deleted (_drop_soon)
        self._max_cooldown_ms = max(self.config.max_cooldown_ms, self.config.cooldown_ms)
        self.breaker_ttl_ms = self._breaker_ttl_ms(self.probe_lease_ms)

    def _breaker_ttl_ms(self, lease_ms: int) -> int:
        """A breaker key outlives its longest open period twice over, and a probe's lease."""
        return max(2 * self._max_cooldown_ms + lease_ms, 600_000)

    # --- plumbing ----------------------------------------------------------------------

    def _connection(self) -> aioredis.Redis:
        """The client (its pool of connections): made on first use, and again on the first
        try after an outage began (`_retire`), and on another event loop than its own."""
        loop = asyncio.get_running_loop()
        self._follow_loop(loop)
        if self._client is None:
            self._client_loop = loop
            # A bounded pool that waits for a free connection (up to pool_timeout) rather
            # than failing: redis-py's default pool raises past 100 connections, which
            # under load read as "Redis unreachable" and silently un-shared the breakers.
            # `?max_connections=N` in the state URL overrides the size.
            pool = aioredis.BlockingConnectionPool.from_url(
                self._url,
                max_connections=self.max_connections,
                timeout=self.pool_timeout,
                decode_responses=True,
                socket_timeout=self.socket_timeout,
                socket_connect_timeout=self.socket_timeout,
                retry=Retry(NoBackoff(), 0),
            )
            self._client = aioredis.Redis.from_pool(pool)  # the client owns (closes) the pool
            self._closes_with(CloseAtLoopEnd(self._client.aclose))
            self._scripts.clear()
        return self._client

    def _follow_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starlette's TestClient without `with` runs each request on a new event loop and
        closes it after: a pool made on another loop cannot be used from this one. It is
        closed on its own loop while that runs (else left to the garbage collector)."""
        if self._client is not None and self._client_loop is not loop:
            stale, old, self._client = self._client, self._client_loop, None
            self._closes_with(None)
            close_on_its_loop(old, stale.aclose)

    def _closes_with(self, at_loop_end: CloseAtLoopEnd | None) -> None:
        """The client's close at its loop's end (TestClient without `with`: a loop per
        request, no lifespan); the one before it is closed another way (here, by _retire,
        or by aclose)."""
        if self._at_loop_end is not None:
            self._at_loop_end.forget()
        self._at_loop_end = at_loop_end

    def _script(self, name: str, source: str) -> Any:
        client = self._connection()
        script = self._scripts.get(name)
        if script is None:
            script = self._scripts[name] = client.register_script(source)
        return script

    async def _run(
        self, name: str, source: str, keys: list[str], args: list[Any], undo: Undo | None = None
    ) -> Any:
        """One script call. The calls of this process ready on one turn of the event loop
        go to Redis together, in one pipeline (one round trip, without MULTI: each script
        is atomic on its own, as before, and they run in the order they were made).
        `undo`: what takes its effect back if its caller gives up before the answer."""
        if (
            self._outage
        ):  # nobody waits for a Redis that failed: a try in the background tests it again
            self._try_again()
            return self._fell_back()
        loop = asyncio.get_running_loop()
        group = self._group
        if group is None or group.loop is not loop:
            group = self._group = Group(loop, self._send_group)
        call = _ScriptCall(name, source, keys, args, undo)
        future = group.join(call)
        try:
            return await future
        except asyncio.CancelledError:
            # Answered, and its caller cancelled on that same turn, before it read the
            # answer: nobody will use what the script did, as for a caller gone before.
            if future.done() and not future.cancelled() and future.exception() is None:
                self._abandoned(call, future.result())
            raise

    def _send_group(self, calls: list[Pending[_ScriptCall]]) -> None:
        task = asyncio.get_running_loop().create_task(self._send(calls))
        self._senders.add(task)
        task.add_done_callback(self._senders.discard)

    async def _send(self, calls: list[Pending[_ScriptCall]]) -> None:
        client = self._connection()
        try:
            results = await self._pipeline(client, [call.item for call in calls])
        except BaseException as exc:  # the loop stopping: nobody waits forever
            fail(calls, exc)
            raise
        for call, result in zip(calls, results, strict=True):
            # A pipeline on a pool an outage retired (sent before the outage began) neither
            # ends the outage nor starts another: it answers its own calls only.
            current = client is self._client
            if current and _wrong_type(result):
                # Not the gateway's value: dropped, so the next call starts that key
                # afresh; this call is served on local state. As an outage it would
                # un-share every breaker, warning "unreachable" / "reachable again" every
                # second, for as long as the key lived (such a key seldom expires).
                self._drop_soon(call.item.keys)
                if not call.future.done():
                    call.future.set_result(self._fell_back())
                continue
            lost = isinstance(result, RedisError | OSError)
            if lost and call.item.name == "admit" and len(self._unanswered) < 10_000:
                # Sent, no answer: Redis may still run it (a hang ends) and give this
                # admission a probe slot nobody uses. Given back once Redis is back, also
                # when its caller gave up meanwhile.
                self._unanswered.append((call.item.keys[0], call.item.args[3]))
            if call.future.done():  # its caller was cancelled; the call stands
                if lost:
                    if current:  # Redis failed all the same: the outage begins
                        self._begin_outage(result)
                    continue
                if current:
                    self._recovered()
                self._abandoned(call.item, result)
                continue
            if lost:
                call.future.set_result(self._failed(result) if current else self._fell_back())
            else:
                if current:
                    self._recovered()
                call.future.set_result(result)

    async def _pipeline(self, client: aioredis.Redis, calls: list[_ScriptCall]) -> list[Any]:
        """Each call's result, or the `RedisError` / `OSError` it met."""
        scripts = [self._script(call.name, call.source) for call in calls]  # on `client`
        try:
            pipe = client.pipeline(transaction=False)
            for call, script in zip(calls, scripts, strict=True):
                pipe.evalsha(script.sha, len(call.keys), *call.keys, *call.args)
            results: list[Any] = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError) as exc:
            return [exc] * len(calls)
        for index, result in enumerate(results):
            if isinstance(result, NoScriptError):  # first use, or Redis restarted
                call = calls[index]
                try:  # the script object loads the script, then runs it
                    results[index] = await scripts[index](
                        keys=call.keys, args=call.args, client=client
                    )
                except (RedisError, OSError) as exc:
                    results[index] = exc
        return results

    def _abandoned(self, call: _ScriptCall, result: Any) -> None:
        """Take back what `call` did for a caller that gave up (cancelled) without its
        answer `result`."""
        if isinstance(result, _Unavailable):
            return  # served on local state: the caller had done nothing there yet
        if call.name == "admit" and _took_probe(result):
            # ...and made its admission the half-open probe: nobody will end it, and
            # every request would skip the upstream for the probe's lease.
            self._give_back_soon([(call.keys[0], call.args[3])])
        elif call.undo is not None:  # e.g. a capacity count nobody will use
            undo = call.undo(call.keys, call.args, result)
            if undo is not None:
                self._undo_soon(_ScriptCall(*undo))

    def _fell_back(self) -> _Unavailable:
        self.local_fallbacks.add(1)
        self.local_fallback_calls += 1
        return _UNAVAILABLE

    def _failed(self, exc: BaseException) -> _Unavailable:
        self._begin_outage(exc)
        return self._fell_back()

    def _begin_outage(self, exc: BaseException) -> None:
        if not self._outage:
            self._outage = True
            self.outage_reason = self._reason(exc)
            self._retire()
            self._try_later()
            logger.warning(
                "health state %s unreachable (%s): serving on local in-memory state, "
                "trying it again every %gs",
                self._label,
                self.outage_reason,
                self.retry_interval,
            )

    def _reason(self, exc: BaseException) -> str:
        """The error's class and Redis's (or the socket's) words: a wrong password, a
        database number Redis does not have, a refused or timed-out connection. One line;
        the URL's password never (Redis does not echo it; removed should it appear)."""
        words = " ".join(str(exc).split())[:200]
        password = urlsplit(self._url).password
        for spelling in {password, unquote(password)} if password else ():
            words = words.replace(spelling, "***")  # as written, and as sent (decoded)
        return f"{type(exc).__name__}: {words}" if words else type(exc).__name__

    def _try_again(self) -> None:
        """A call made during an outage: the next try, if it is due (its timer is for an
        outage no call sees; this, for a loop that timer's is not)."""
        if time.monotonic() >= self._retry_at:
            self._start_try()

    def _start_try(self) -> None:
        """One try (`_usable`) in the background, never two at a time, on new connections."""
        if not self._outage:
            return
        trying = self._trying
        loop = asyncio.get_running_loop()
        if trying is not None and not trying.done() and trying.get_loop() is loop:
            return
        self._trying = loop.create_task(self._try())

    def _try_later(self) -> None:
        self._retry_at = time.monotonic() + self.retry_interval
        if self._retry_timer is not None:
            self._retry_timer.cancel()
        self._retry_timer = asyncio.get_running_loop().call_later(
            self.retry_interval, self._start_try
        )

    def start(self) -> None:
        """Lifespan startup: one try (`_usable`) in the background. Redis unreachable, or refusing
        the password or the database number: the outage begins now, its warning at startup
        (else said at the first request)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._outage or (self._trying is not None and not self._trying.done()):
            return
        self._trying = loop.create_task(self._check())

    async def _usable(self, client: aioredis.Redis) -> None:
        """Raises what keeps this state from being used, as a script call would meet it: a
        write by a script (`{prefix}alive`, 10 s). A PING is answered also by a Redis that
        refuses every script or write (maxmemory reached, a read-only replica after a
        failover, an ACL without them): each try ended the outage ("reachable again: state
        is shared") and the next call began it again, every second, for as long as it
        lasted."""
        await client.eval(_ALIVE, 1, f"{self.prefix}alive")

    async def _check(self) -> None:
        client = self._connection()
        try:
            await self._usable(client)
        except (RedisError, OSError) as exc:
            if client is self._client:
                self._failed(exc)
            return
        await self._read_shared_breakers()

    async def _read_shared_breakers(self) -> None:
        """At startup, the shared state of each configured upstream's breaker: one that
        other (or earlier) processes opened is reported now. A restarted `serve` said
        closed for it until its first admission of that upstream, so FallbackMwBreakerOpen
        resolved on a deploy while the shared breaker stayed open."""
        names = [name for name in self._upstreams if name not in self._seen]
        if self._outage or not names:
            return
        states = await asyncio.gather(
            *(
                self._run("breaker_state", BREAKER_STATE, [self._key("breaker", name)], [])
                for name in names
            )
        )
        for name, state in zip(names, states, strict=True):
            if not isinstance(state, _Unavailable):
                self._sync(name, str(state))

    async def unusable(self) -> str | None:
        """One try (`_usable`): None when this state can be used now, else why not, in the
        outage warning's words (`fallback-mw check`)."""
        client = self._connection()
        try:
            await self._usable(client)
        except (RedisError, OSError) as exc:
            return self._reason(exc)
        return None

    async def _try(self) -> None:
        client = self._connection()
        try:
            await self._usable(client)
        except (RedisError, OSError):
            self._retire()  # the next try starts from new connections too
            self._try_later()
        else:
            if client is self._client:
                self._recovered()

    def _recovered(self) -> None:
        if self._outage:
            self._outage = False
            self._retry_at = 0.0  # shared at once, even if another call of this try failed
            if self._retry_timer is not None:
                self._retry_timer.cancel()
                self._retry_timer = None
            logger.warning("health state %s reachable again: state is shared", self._label)
            if self._unanswered:
                unanswered, self._unanswered = self._unanswered, []
                self._give_back_soon(unanswered)
            if self._fault_resets or self._forgets:
                task = asyncio.get_running_loop().create_task(self._catch_up())
                self._giving_back.add(task)
                task.add_done_callback(self._giving_back.discard)

    async def _catch_up(self) -> None:
        """The resets of faults that ended, and the forgets of upstreams whose url changed,
        during the outage, on the shared state now (a Redis away again keeps them for its
        end)."""
        for upstream in sorted(self._fault_resets):
            await self.reset_fault(upstream)
        for upstream, url in sorted(self._forgets.items()):
            await self.forget(upstream, url)

    def _give_back_soon(self, admissions: list[tuple[str, Any]]) -> None:
        """Free the probe slots these admissions (breaker key, number) may hold, in the
        background: their callers never will."""
        task = asyncio.get_running_loop().create_task(self._give_back(admissions))
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    async def _give_back(self, admissions: list[tuple[str, Any]]) -> None:
        for key, number in admissions:
            await self._run("give_back", GIVE_BACK, [key], [self._owner, number])

    def _drop_soon(self, keys: list[str]) -> None:
        """Delete those of `keys` that hold a value of another kind than the gateway keeps
        there, in the background; one warning each (the key's name, never its value)."""
        keys = [key for key in keys if key not in self._dropping]
        if not keys:
            return
        self._dropping.update(keys)
        client = self._connection()

        async def drop() -> None:
            try:
                for key in keys:
                    kind = key[len(self.prefix) :].split(":", 1)[0]
                    keeps = "string" if kind in _STRING_KEYS else "hash"
                    if not await client.eval(_DROP_OTHER_KIND, 1, key, keeps):
                        continue  # already deleted and written again, as it should be
                    logger.warning(
                        "health state %s: key %s held no %s, as the gateway keeps there; "
                        "deleted (its state starts afresh)", self._label, key, keeps,
                    )  # fmt: skip
            except (RedisError, OSError):
                pass  # Redis away now: the next call meets the key again
            finally:
                self._dropping.difference_update(keys)

        task = asyncio.get_running_loop().create_task(drop())
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    def _undo_soon(self, undo: _ScriptCall) -> None:
        """Run `undo` in the background (a call whose caller gave up is taken back); a
        Redis away again by then leaves it undone (a capacity count: for its minute)."""
        task = asyncio.get_running_loop().create_task(
            self._run(undo.name, undo.source, undo.keys, undo.args)
        )
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    def _retire(self) -> None:
        """An outage began: its tries, and the calls after it, are made on a new pool. This
        one's connections may be dead, and redis-py 8 hands an idle one out unchecked (it
        skips that check while maintenance notifications are on, its default): once Redis is
        back each would fail in turn, each failure a new outage, warning and retry interval.
        The pool is closed once the pipelines already sent, or about to be, are done."""
        client, self._client = self._client, None
        if client is None:
            return
        self._closes_with(None)
        in_flight = set(self._senders)
        task = asyncio.get_running_loop().create_task(self._close_after(client, in_flight))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    @staticmethod
    async def _close_after(client: aioredis.Redis, in_flight: set[asyncio.Task[None]]) -> None:
        if in_flight:
            await asyncio.wait(in_flight)  # never cancels them
        with contextlib.suppress(RedisError, OSError):  # its connections may be dead
            await client.aclose()

    async def _with_fallback(
        self,
        name: str,
        source: str,
        keys: list[str],
        args: list[Any],
        local: Callable[[], Awaitable[T]],
        convert: Callable[[Any], T],
    ) -> T:
        result = await self._run(name, source, keys, args)
        if isinstance(result, _Unavailable):
            return await local()
        return convert(result)

    async def run_script(
        self,
        name: str,
        source: str,
        keys: list[str],
        args: list[Any],
        *,
        undo: Undo | None = None,
    ) -> Any | None:
        """Run a Lua script on this state's connections (the capacity counts share them):
        its result, or None while Redis is unreachable (the caller then serves on its
        local state; the outage is logged and counted here, once). `undo(keys, args,
        result)`: the script call that takes back what it did, run when its caller gave
        up (cancelled) before the answer came; made once, not per call."""
        result = await self._run(name, source, keys, args, undo)
        return None if isinstance(result, _Unavailable) else result

    @property
    def label(self) -> str:
        """The state URL without its password (for messages)."""
        return self._label

    @property
    def available(self) -> bool:
        """False while serving on local state (Redis unreachable)."""
        return not self._outage

    def _key(self, kind: str, upstream: str) -> str:
        return f"{self.prefix}{kind}:{upstream}"

    def _pool_key(self, kind: str, upstream: str) -> str:
        """A key holding credential indexes: named after the pool's list of variables."""
        pool = self._pool_ids.get(upstream)
        return self._key(kind, upstream) + (f":{pool}" if pool else "")

    # --- HealthState -------------------------------------------------------------------

    def _report(self, upstream: str, transition: str | None) -> None:
        """A transition this process's script made: logged and told to the listener."""
        if transition:
            self._seen[upstream] = state = _STATE_AFTER.get(transition, transition)
            report_transition(self.on_transition, upstream, transition)
            if state != "closed":
                self._watch()

    def _local_transition(self, upstream: str, state: str) -> None:
        """A transition of the local breakers served during an outage: reported like any,
        and remembered as the state last reported, so the first admission once Redis is
        back reports the shared state again (`_sync`). Else a breaker opened locally kept
        the gauge at open, FallbackMwBreakerOpen firing, while the shared one was closed."""
        self._seen[upstream] = state
        if self.on_transition is not None:
            self.on_transition(upstream, state)
        if state != "closed":
            self._watch()

    def _sync(self, upstream: str, state: str) -> None:
        """The shared breaker's state as an admission found it: told to the listener when it
        differs from what this process last reported (another process moved it), so every
        process's gauge follows the shared state (FallbackMwBreakerOpen resolves)."""
        if self._seen.get(upstream, "closed") != state:
            self._seen[upstream] = state
            listener = self.on_observed or self.on_transition
            if listener is not None:
                listener(upstream, state)
            if state != "closed":
                self._watch()

    def _watch(self) -> None:
        """Read the shared state of the breakers this process last reported not closed in
        refresh_interval: another process's probe may close one, and this process's gauge
        followed only at its next admission of that upstream, so on a quiet route
        FallbackMwBreakerOpen (max over processes) kept firing after the recovery. One
        timer at a time, none while every breaker reported is closed."""
        if self._refresh_timer is not None or self._refreshing is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._refresh_timer = loop.call_later(self.refresh_interval, self._start_refresh)

    def _start_refresh(self) -> None:
        self._refresh_timer = None
        self._refreshing = asyncio.get_running_loop().create_task(self._refresh())

    async def _refresh(self) -> None:
        try:
            # During an outage the local breakers stand; a read would only count as a
            # local fallback (that counter moves with traffic only).
            upstreams = [] if self._outage else [n for n, s in self._seen.items() if s != "closed"]
            states = await asyncio.gather(
                *(
                    self._run("breaker_state", BREAKER_STATE, [self._key("breaker", name)], [])
                    for name in upstreams
                )
            )
            for name, state in zip(upstreams, states, strict=True):
                if not isinstance(state, _Unavailable):  # an outage: its local state stands
                    self._sync(name, str(state))
        finally:
            self._refreshing = None
        if any(state != "closed" for state in self._seen.values()):
            self._watch()

    async def admit(
        self, upstream: str, *, lease: float = 0.0, admission: Admission | None = None
    ) -> bool:
        lease_ms = max(self.probe_lease_ms, math.ceil(lease * 1000))
        ttl_ms = self._breaker_ttl_ms(lease_ms)  # the key outlives the probe's lease
        number = next(self._admissions)

        def convert(result: Any) -> bool:
            admitted, transition, *rest = result
            self._report(upstream, transition or None)
            if rest and rest[0]:
                self._sync(upstream, str(rest[0]))
            if int(admitted) and admission is not None:
                # The probe's owner as ADMIT wrote it; '-' a closed breaker's admission.
                half_open = bool(rest) and rest[0] == "half_open"
                admission.probe = f"{self._owner}:{number}" if half_open else "-"
            return bool(int(admitted))

        return await self._with_fallback(
            "admit",
            ADMIT,
            [self._key("breaker", upstream)],
            [lease_ms, ttl_ms, self._owner, number],
            lambda: self.local.admit(upstream, lease=lease, admission=admission),
            convert,
        )

    async def record(
        self,
        upstream: str,
        *,
        failure: bool,
        fault: str | None = None,
        admission: Admission | None = None,
    ) -> None:
        config = self.config

        def convert(result: Any) -> None:
            self._report(upstream, result or None)

        await self._with_fallback(
            "record",
            RECORD,
            [self._key("breaker", upstream)],
            [
                "1" if failure else "0",
                config.window,
                config.min_calls,
                repr(config.failure_rate),
                config.cooldown_ms,
                max(config.max_cooldown_ms, config.cooldown_ms),
                self.breaker_ttl_ms,
                fault or "",
                shared_probe(admission),
            ],
            lambda: self.local.record(upstream, failure=failure, fault=fault, admission=admission),
            convert,
        )

    async def open_fault(self, upstream: str) -> str | None:
        return await self._with_fallback(
            "open_fault",
            OPEN_FAULT,
            [self._key("breaker", upstream)],
            [],
            lambda: self.local.open_fault(upstream),
            lambda result: str(result) or None,
        )

    async def skip_fault(self, upstream: str) -> str | None:
        return await self._with_fallback(
            "skip_fault",
            SKIP_FAULT,
            [self._key("breaker", upstream)],
            [],
            lambda: self.local.skip_fault(upstream),
            lambda result: str(result) or None,
        )

    async def reset_fault(self, upstream: str) -> None:
        reset = await self._run(
            "reset_fault", RESET_FAULT, [self._key("breaker", upstream)], [self.config.cooldown_ms]
        )
        marks = await self._run(
            "restore_fault_marks",
            RESTORE_FAULT_MARKS,
            [self._pool_key("credentials", upstream), self._pool_key("fault_marks", upstream)],
            [],
        )
        if isinstance(reset, _Unavailable) or isinstance(marks, _Unavailable):
            self._fault_resets.add(upstream)  # made again once Redis is back (_recovered)
        else:
            self._fault_resets.discard(upstream)
        if not isinstance(reset, _Unavailable):
            if reset == "=closed":
                self._sync(upstream, "closed")
            else:
                self._report(upstream, reset or None)
        # The local state served while Redis was unreachable is reset too.
        await self.local.reset_fault(upstream)

    def keep_only(self, upstreams: Collection[str]) -> None:
        """This process's own copy forgets every upstream but `upstreams` (MemoryHealth's);
        the shared keys expire by themselves."""
        self.local.keep_only(upstreams)

    async def forget(self, upstream: str, url: str) -> None:
        def convert(result: Any) -> None:
            if result == "=":
                return  # another process forgot it for this url: the breaker is the new url's
            if result == "=closed":
                self._sync(upstream, "closed")
            else:
                self._report(upstream, result or None)

        result = await self._run(
            "forget",
            FORGET,
            [self._key("breaker", upstream), self._key("breaker_url", upstream)],
            [hashlib.sha256(url.encode()).hexdigest()[:32], CREDENTIAL_TTL_MS],
        )
        if isinstance(result, _Unavailable):
            self._forgets[upstream] = url  # made once Redis is back (_recovered)
        else:
            if self._forgets.get(upstream) == url:
                del self._forgets[upstream]
            convert(result)
        await self.local.forget(upstream, url)  # the state served while Redis was unreachable

    async def fault_marked(self, upstream: str, index: int, fault: str) -> None:
        await self._with_fallback(
            "fault_marked",
            FAULT_MARKED,
            [self._pool_key("fault_marks", upstream)],
            [index, fault, CREDENTIAL_TTL_MS],
            lambda: self.local.fault_marked(upstream, index, fault),
            lambda result: None,
        )

    async def pool_fault(self, upstream: str) -> str | None:
        return await self._with_fallback(
            "pool_fault",
            POOL_FAULT,
            [self._pool_key("fault_marks", upstream)],
            [],
            lambda: self.local.pool_fault(upstream),
            lambda result: str(result) or None,
        )

    async def release(self, upstream: str, admission: Admission | None = None) -> None:
        await self._with_fallback(
            "release",
            RELEASE,
            [self._key("breaker", upstream)],
            [shared_probe(admission)],
            lambda: self.local.release(upstream, admission),
            lambda result: None,
        )

    async def usable_in(self, upstream: str, pool_size: int) -> float | None:
        def convert(result: Any) -> float | None:
            breaker, credential = (int(v) for v in result)
            return None if credential < 0 else max(breaker, credential) / 1000

        return await self._with_fallback(
            "usable_in",
            USABLE_IN,
            [self._key("breaker", upstream), self._pool_key("credentials", upstream)],
            [pool_size],
            lambda: self.local.usable_in(upstream, pool_size),
            convert,
        )

    async def pick_credential(
        self,
        upstream: str,
        pool_size: int,
        *,
        exclude: frozenset[int],
        session: str | None,
        selection: Selection = "round_robin",
    ) -> int | None:
        self._pool_sizes[upstream] = self.local.pool_sizes[upstream] = pool_size
        self._selections[upstream] = self.local.selections[upstream] = selection
        if pool_size <= 1:
            return None if 0 in exclude or pool_size < 1 else 0
        field = ""
        if session is not None:
            field = hashlib.sha256(session.encode("utf-8", "replace")).hexdigest()[:32]
        affinity = self._pool_key("affinity", upstream)
        excluded = "," + ",".join(str(i) for i in sorted(exclude)) + ","

        def convert(result: Any) -> int | None:
            index = int(result)
            return None if index < 0 else index

        return await self._with_fallback(
            "pick",
            PICK,
            [
                self._pool_key("credentials", upstream),
                self._pool_key("rotation", upstream),
                affinity,
                self._pool_key("score", upstream),
                f"{affinity}:older",
            ],
            [
                pool_size,
                excluded,
                "1" if session is not None else "0",
                AFFINITY_TTL_MS,
                CREDENTIAL_TTL_MS,
                selection,
                int(SCORE_HALF_LIFE * 1000),
                field,
                AFFINITY_LIMIT,
            ],
            lambda: self.local.pick_credential(
                upstream, pool_size, exclude=exclude, session=session, selection=selection
            ),
            convert,
        )

    async def credential_result(
        self,
        upstream: str,
        index: int,
        *,
        status: int | None,
        failure: bool,
        retry_after: float | None,
        session: str | None,
        latency: float | None = None,
        quota: float | None = None,
    ) -> None:
        if self._pool_sizes.get(upstream, 0) <= 1:
            return
        if self._selections.get(upstream) == "score":
            ok = score_outcome(status=status, failure=failure)
            await self._with_fallback(
                "observe",
                OBSERVE,
                [self._pool_key("score", upstream)],
                [index, "1" if ok else "0", f"{max(latency or 0.0, 0.0):.6f}",
                 int(SCORE_HALF_LIFE * 1000), CREDENTIAL_TTL_MS],
                lambda: self._observe_locally(upstream, index, ok=ok, latency=latency),
                lambda result: None,
            )  # fmt: skip
        mark = breaker_credential_mark(
            self.config, upstream, index, status=status, failure=failure,
            retry_after=retry_after, quota=quota,
        )  # fmt: skip
        if mark is None:
            return
        await self._with_fallback(
            "mark",
            MARK,
            [self._pool_key("credentials", upstream)],
            [index, mark.action, int(mark.seconds * 1000), CREDENTIAL_TTL_MS],
            lambda: self.local.credential_result(
                upstream,
                index,
                status=status,
                failure=failure,
                retry_after=retry_after,
                session=session,
                quota=quota,
            ),
            lambda result: None,
        )

    async def _observe_locally(
        self, upstream: str, index: int, *, ok: bool, latency: float | None
    ) -> None:
        self.local.pool(upstream).observe(index, ok=ok, latency=latency, now=self.local.clock())

    async def aclose(self) -> None:
        # Calls already made go out first (a batch waiting for its turn of the loop, then
        # the pipelines in flight), never on a client made again after this one closed.
        group = self._group
        if group is not None and group.loop is asyncio.get_running_loop():
            if group.waiting:
                await asyncio.sleep(0)
            if self._senders:
                await asyncio.gather(*self._senders, return_exceptions=True)
            trying = self._trying
            if trying is not None and trying.get_loop() is group.loop:
                await asyncio.gather(trying, return_exceptions=True)
            if self._giving_back:
                await asyncio.gather(*self._giving_back, return_exceptions=True)
            if self._retiring:  # pools retired by an outage
                await asyncio.gather(*self._retiring, return_exceptions=True)
        if self._retry_timer is not None:  # after the try in flight: it may set another
            self._retry_timer.cancel()
            self._retry_timer = None
        if self._refresh_timer is not None:
            self._refresh_timer.cancel()
            self._refresh_timer = None
        refreshing = self._refreshing
        if refreshing is not None and refreshing.get_loop() is asyncio.get_running_loop():
            refreshing.cancel()
            await asyncio.gather(refreshing, return_exceptions=True)
        self._follow_loop(asyncio.get_running_loop())  # another loop's pool: closed there
        client, self._client = self._client, None
        self._closes_with(None)
        if client is not None:
            await client.aclose()
