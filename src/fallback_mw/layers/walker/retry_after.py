"""The Retry-After of a 503 `route_exhausted`: when the caller may come back (the walk's
skips say which candidates were left out, and why)."""

from __future__ import annotations

import math

from fallback_mw.failover.attempt import AttemptLifecycle
from fallback_mw.health import HealthState
from fallback_mw.request.context import RequestContext


async def retry_after(
    context: RequestContext, health: HealthState, attempts: AttemptLifecycle
) -> list[tuple[bytes, bytes]]:
    """The Retry-After of a 503 route_exhausted: whole seconds until the first skipped
    candidate may be attempted again (its breaker half-opens, a pool credential returns,
    its declared rpm / tpm has room as the minute rolls). No header when that is not
    known: a repeat allowance frees as its window rolls, and a candidate that never
    returns by itself (retired credentials, a credential unset at run time, a model
    rewrite the body cannot take, an estimate over its whole tpm) is not waited for."""
    waits: list[float] = []
    revoked: list[str] = []
    sooner = False  # a repeat_budget skip: back sooner than anything said here
    for name, reason in dict.fromkeys((s.candidate, s.reason) for s in context.skipped):
        if reason == "capacity":
            wait = await attempts.capacity_free_in(name)
            if wait is not None:
                waits.append(wait)
            continue
        if reason not in ("breaker_open", "no_credential"):
            # Not `return`: the pools retired for good are named in the message all the same.
            sooner = sooner or reason != "model_rewrite"  # repeat_budget: back sooner
            continue
        pool = len(context.upstreams[name].credential_envs)
        if pool and not any(context.credential(name, i) is not None for i in range(pool)):
            continue  # its variable is unset: no wait brings it back
        wait = await health.usable_in(name, pool)
        if wait is not None:
            waits.append(wait)
        elif reason == "no_credential":
            revoked.append(name)  # every credential retired: the message names its variables
    context.revoked = tuple(revoked)
    if sooner or not waits:
        return []
    return [(b"retry-after", str(max(1, math.ceil(min(waits)))).encode())]
