"""What a caller that gave up leaves behind on a Redis state, taken back in the background
(RedisLink, health/redis_link.py, mixes this in): the half-open probe slot an admission
took, or may have taken while its answer was lost (given back once Redis is back), a
script's effect its `undo` names (a capacity count nobody will use), and a key of another
kind than the gateway keeps there (deleted, one warning naming the key, never its value)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from redis.exceptions import RedisError

from fallback_mw.health.redis_outage import Unavailable
from fallback_mw.health.redis_scripts import GIVE_BACK

if TYPE_CHECKING:
    import redis.asyncio as aioredis

logger = logging.getLogger("fallback_mw.health")

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


def _took_probe(result: Any) -> bool:
    """Whether ADMIT's answer gave its admission the half-open probe slot."""
    return (
        isinstance(result, list)
        and len(result) > 2
        and str(result[0]) == "1"
        and result[2] == "half_open"
    )


# What takes back a script call's effect when its caller gave up before the answer came:
# given the call's keys, args and result, the script call to run, (name, source, keys,
# args), or None: nothing to undo.
Undo = Callable[[list[str], list[Any], Any], tuple[str, str, list[str], list[Any]] | None]


class ScriptCall(NamedTuple):
    """A script call waiting for its pipeline."""

    name: str
    source: str
    keys: list[str]
    args: list[Any]
    undo: Undo | None = None


class RedisLeftovers:
    """Taking back what callers that gave up left; the connections are RedisLink's."""

    prefix: str
    _label: str
    _owner: str
    _giving_back: set[asyncio.Task[None]]
    _dropping: set[str]

    if TYPE_CHECKING:

        def _connection(self) -> aioredis.Redis: ...
        async def _run(
            self,
            name: str,
            source: str,
            keys: list[str],
            args: list[Any],
            undo: Undo | None = None,
        ) -> Any: ...

    def _abandoned(self, call: ScriptCall, result: Any) -> None:
        """Take back what `call` did for a caller that gave up (cancelled) without its
        answer `result`."""
        if isinstance(result, Unavailable):
            return  # served on local state: the caller had done nothing there yet
        if call.name == "admit" and _took_probe(result):
            # ...and made its admission the half-open probe: nobody will end it, and
            # every request would skip the upstream for the probe's lease.
            self._give_back_soon([(call.keys[0], call.args[3])])
        elif call.undo is not None:  # e.g. a capacity count nobody will use
            undo = call.undo(call.keys, call.args, result)
            if undo is not None:
                self._undo_soon(ScriptCall(*undo))

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

    def _undo_soon(self, undo: ScriptCall) -> None:
        """Run `undo` in the background (a call whose caller gave up is taken back); a
        Redis away again by then leaves it undone (a capacity count: for its minute)."""
        task = asyncio.get_running_loop().create_task(
            self._run(undo.name, undo.source, undo.keys, undo.args)
        )
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)
