"""The plan walker, in parts: `cursor` (plan order, passes, skips), `hedge` (driven
through the attempt runner), `stream` (commit point and relay), `preflight`,
`max_forwards` and `disconnect`, `retry_after` (when a caller of an exhausted route may
come back), `walk` (one request's walk, which puts them together) and `walker` (the ASGI
class). The SPEC §5 rules they follow are `failover.outcome`, `failover.replay` and
`failover.decide` (pure); one attempt is `failover.attempt`."""

from fallback_mw.layers.walker.walker import PlanWalker

__all__ = ["PlanWalker"]
