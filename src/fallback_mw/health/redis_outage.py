"""What an outage of a Redis state does (RedisLink, health/redis_link.py, mixes this in):
when it begins (once, on a call Redis failed; one warning in Redis's words, never the URL's
password), the calls served on local state while it lasts (counted), the tries that test
Redis again in the background every `retry_interval` seconds, each on a new connection
pool (`_retire`), and when it ends (the first try that succeeds, logged)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from opentelemetry import metrics
from redis.exceptions import RedisError

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from fallback_mw.loops import CloseAtLoopEnd

logger = logging.getLogger("fallback_mw.health")

# The try of a state in an outage (`RedisOutage._usable`): a script that writes, as every
# health call is.
_ALIVE = "redis.call('SET', KEYS[1], '1', 'PX', 10000) return 1"


class Unavailable:
    pass


_UNAVAILABLE = Unavailable()


class RedisOutage:
    """A state's outage and its tries; the connections are RedisLink's."""

    prefix: str
    _url: str
    _label: str
    retry_interval: float
    local_fallbacks: metrics.Counter
    local_fallback_calls: int
    outage_reason: str | None
    _outage: bool
    _retry_at: float
    _client: aioredis.Redis | None
    _senders: set[asyncio.Task[None]]
    _retiring: set[asyncio.Task[None]]
    _trying: asyncio.Task[None] | None
    _retry_timer: asyncio.TimerHandle | None
    _unanswered: list[tuple[str, int]]

    if TYPE_CHECKING:

        def _connection(self) -> aioredis.Redis: ...
        def _closes_with(self, at_loop_end: CloseAtLoopEnd | None) -> None: ...
        def _give_back_soon(self, admissions: list[tuple[str, Any]]) -> None: ...

    def _fell_back(self) -> Unavailable:
        self.local_fallbacks.add(1)
        self.local_fallback_calls += 1
        return _UNAVAILABLE

    def _failed(self, exc: BaseException) -> Unavailable:
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

    async def _check(self) -> None:
        client = self._connection()
        try:
            await self._usable(client)
        except (RedisError, OSError) as exc:
            if client is self._client:
                self._failed(exc)
            return
        await self._started()

    async def _started(self) -> None:
        """Redis was usable at startup (RedisHealth: the shared breakers are read)."""

    async def _usable(self, client: aioredis.Redis) -> None:
        """Raises what keeps this state from being used, as a script call would meet it: a
        write by a script (`{prefix}alive`, 10 s). A PING is answered also by a Redis that
        refuses every script or write (maxmemory reached, a read-only replica after a
        failover, an ACL without them): each try ended the outage ("reachable again: state
        is shared") and the next call began it again, every second, for as long as it
        lasted."""
        await client.eval(_ALIVE, 1, f"{self.prefix}alive")

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
            self._after_recovery()

    def _after_recovery(self) -> None:
        """What the user of these connections makes again on the shared state once Redis is
        back (RedisHealth: the fault resets and forgets made during the outage)."""

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

    @property
    def available(self) -> bool:
        """False while serving on local state (Redis unreachable)."""
        return not self._outage
