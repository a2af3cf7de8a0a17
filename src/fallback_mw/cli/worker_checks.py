"""What `serve --workers N` checks before it starts a worker: N > 1 on state kept in each
process's memory is refused (`check_shared`); N past the CPUs is warned about
(`more_than_cpus`)."""

from __future__ import annotations

import os

from fallback_mw.cli.app import Refused
from fallback_mw.config import GatewayConfig


def check_shared(config: GatewayConfig, workers: int) -> None:
    """Refuse N > 1 workers when breakers, capacity or budgets would be per process."""
    if workers <= 1:
        return
    settings = config.gateway
    if settings.state in ("memory://", "memory", ""):
        raise Refused(
            f'--workers {workers} needs a shared state: gateway.state is "memory://", so each '
            'worker would keep its own breakers and capacity counts; set state = "redis://..."'
        )
    if settings.store is None and any(route.budget for route in config.routes):
        raise Refused(
            f"--workers {workers} needs a shared store: budgets on the in-memory ledger "
            'would be per worker; set gateway.store = "sqlite:///..." or "postgresql://..."'
        )


def more_than_cpus(workers: int, cpus: int | None = None) -> str | None:
    """A warning when N workers exceed the CPUs this process may run on: each worker is
    one event loop on one core at a time, so the ones past a worker per CPU add memory
    (their own connection pools, caches and OTel SDK) and context switches, no
    throughput."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0))
    if workers <= max(cpus, 1):
        return None
    return (
        f"--workers {workers} on {cpus} CPU{'s' if cpus != 1 else ''} (those this process "
        "may run on): a worker past one per CPU adds memory and context switches, not "
        f"throughput; --workers {cpus} serves as much"
    )
