"""The plan walker, in parts: `decide` (every SPEC §5 rule, pure), `cursor` (plan order,
passes, skips), `attempt` (one upstream request and its outcome), `hedge` (driven through
the attempt runner), `stream` (commit point and relay), `body` (reading and replay) and
`walker` (the ASGI class that puts them together)."""

from fallback_mw.layers.walker.walker import PlanWalker

__all__ = ["PlanWalker"]
