"""MemoryHealth's calls on every attempt (`admit`, `record`, `pooled`), compiled. The class
stays interpreted (hosts and tests subclass it, and an interpreted class cannot inherit
from a compiled one): its methods call these, and the attempt lifecycle calls them
directly for a state of exactly that class (`AttemptLifecycle`, failover/attempt.py),
where each method was an interpreted call or two an attempt."""

from __future__ import annotations

import logging
from typing import Any

from fallback_mw.health.breaker import Breaker, Transition
from fallback_mw.health.events import Admission, TransitionListener

logger = logging.getLogger("fallback_mw.health")


def report_transition(
    listener: TransitionListener | None, upstream: str, transition: Transition | str | None
) -> None:
    if transition is None:
        return
    state = {"opened": "open", "reopened": "open"}.get(transition, transition)
    if listener is not None:
        listener(upstream, state)  # the gauge and transition counter (telemetry)
    logger.info("breaker upstream=%s transition=%s", upstream, transition)


def _breaker(health: Any, upstream: str) -> Breaker:
    found: Breaker | None = health._breakers.get(upstream)
    if found is None:
        found = health.breaker(upstream)  # made on first use, with the state's settings
    return found


def admit(health: Any, upstream: str, lease: float, admission: Admission | None) -> bool:
    """MemoryHealth.admit_now: whether the upstream's breaker admits an attempt now."""
    breaker = _breaker(health, upstream)
    admitted, transition = breaker.admit(health.clock(), lease)
    if transition is not None:  # asked per attempt: no call for the usual none
        report_transition(health.on_transition, upstream, transition)
    if admitted and admission is not None:
        admission.probe = breaker.admission()
        admission.breaker = breaker
    return admitted


def admitting(health: Any, upstream: str, admission: Admission | None) -> Breaker | None:
    """The breaker an admitted attempt's outcome or release goes to: the one that admitted
    it, unless the upstream's url has changed since (`forget`): the attempt went to the old
    url, and says nothing of the new one."""
    if admission is None or admission.breaker is None:
        return _breaker(health, upstream)
    known: Breaker | None = health._breakers.get(upstream)
    return admission.breaker if known is admission.breaker else None


def record(
    health: Any, upstream: str, failure: bool, fault: str | None, admission: Admission | None
) -> None:
    """MemoryHealth.record_now: an attempt's outcome to the breaker that admitted it."""
    breaker = admitting(health, upstream, admission)
    if breaker is None:
        return
    probe = None if admission is None else admission.probe  # probe_of, inline
    transition = breaker.record(failure=failure, now=health.clock(), fault=fault, probe=probe)
    if transition is not None:
        report_transition(health.on_transition, upstream, transition)


def pooled(health: Any, upstream: str) -> bool:
    """MemoryHealth.pooled: whether this upstream's credentials have a health of their own
    (a pool: more than one credential); a single credential is governed by the breaker."""
    sizes: dict[str, int] = health.pool_sizes
    return sizes.get(upstream, 0) > 1
