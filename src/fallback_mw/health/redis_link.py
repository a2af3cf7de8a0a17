"""The connections of one Redis state URL (`state = "redis://..."`) and what an outage does
to them.

Script calls of this process that are ready on one turn of the event loop go to Redis in
one pipeline. If Redis cannot be reached the caller serves on its in-memory state, one
warning per outage is logged (its reason in Redis's words, never the URL's password) and
counted in a metric. While the outage lasts no call waits for Redis: every
`retry_interval` seconds one try in the background (a script's write, `_usable`) tests
it again, and the first that succeeds ends the outage (logged). A Redis that hangs
(stopped, a network that drops packets) costs the calls in flight when it began one
`socket_timeout`, and nothing after. The tries are made on a new connection pool: the
connections of before may be dead (Redis restarted, a proxy or the network dropped them)
and redis-py hands an idle one out unchecked, so each would fail once Redis is back, and
each failure would start an "outage" of its own (the outage and its tries:
health/redis_outage.py; what a caller that gave up leaves behind: health/redis_leftovers.py).
RedisHealth (health/redis.py) is what runs on them."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable
from typing import Any

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

from fallback_mw.health.redis_leftovers import RedisLeftovers, ScriptCall, Undo
from fallback_mw.health.redis_outage import RedisOutage, Unavailable
from fallback_mw.store_url import redact_url, split_state_url

# Connections to Redis per gateway process. Each health call holds one for a round trip
# (well under a millisecond on a LAN), so 50 serve thousands of calls a second; beyond
# that callers wait for a free one (pool_timeout) instead of failing.
DEFAULT_MAX_CONNECTIONS = 50


def _wrong_type(result: Any) -> bool:
    """Whether a script failed on a key that holds another kind of value than the one it
    keeps there (a string where a hash belongs: written by hand, or by another program
    under the same prefix). Redis answered: that is no outage."""
    return isinstance(result, ResponseError) and "WRONGTYPE" in str(result)


class RedisLink(RedisOutage, RedisLeftovers):
    """One state URL's connections: the pool and the pipelined script calls; the outage
    and its tries (RedisOutage), and the calls whose callers gave up, taken back
    (RedisLeftovers)."""

    def __init__(
        self,
        url: str,
        *,
        retry_interval: float,
        socket_timeout: float,
        meter_provider: MeterProvider | None,
        max_connections: int,
        pool_timeout: float,
        series_at_zero: Callable[[metrics.Counter], None] | None,
    ) -> None:
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
        self._url, self.prefix = split_state_url(url)
        self._label = redact_url(self._url)
        self.retry_interval = retry_interval
        self.socket_timeout = socket_timeout
        self.max_connections = max_connections
        self.pool_timeout = pool_timeout
        self._client: aioredis.Redis | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None  # the one it runs on
        self._at_loop_end: CloseAtLoopEnd | None = None  # closes the client as its loop ends
        self._scripts: dict[str, Any] = {}
        self._retry_at = 0.0
        self._outage = False
        self.outage_reason: str | None = None  # why the current outage began (no password)
        self.local_fallback_calls = 0  # calls served on local state (tests, the soak)
        # Script calls waiting for the next pipeline (`_run`), one group per event loop.
        self._group: Group[ScriptCall] | None = None
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
        self._dropping: set[str] = set()  # keys of the wrong kind being deleted (_drop_soon)

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
        call = ScriptCall(name, source, keys, args, undo)
        future = group.join(call)
        try:
            return await future
        except asyncio.CancelledError:
            # Answered, and its caller cancelled on that same turn, before it read the
            # answer: nobody will use what the script did, as for a caller gone before.
            if future.done() and not future.cancelled() and future.exception() is None:
                self._abandoned(call, future.result())
            raise

    def _send_group(self, calls: list[Pending[ScriptCall]]) -> None:
        task = asyncio.get_running_loop().create_task(self._send(calls))
        self._senders.add(task)
        task.add_done_callback(self._senders.discard)

    async def _send(self, calls: list[Pending[ScriptCall]]) -> None:
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

    async def _pipeline(self, client: aioredis.Redis, calls: list[ScriptCall]) -> list[Any]:
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
        return None if isinstance(result, Unavailable) else result

    @property
    def label(self) -> str:
        """The state URL without its password (for messages)."""
        return self._label

    def _key(self, kind: str, upstream: str) -> str:
        return f"{self.prefix}{kind}:{upstream}"
