"""What stops a request before any upstream is contacted: its body (over the limit, too
slow), a model rewrite the body cannot take on every candidate. Each is a local error;
nothing here is an upstream's doing. (A budget refusal never gets here: the guard answers it
itself.)"""

from __future__ import annotations

from fallback_mw.config import GatewaySettings
from fallback_mw.request.body import body_json
from fallback_mw.request.context import RequestBody, RequestContext
from fallback_mw.request.refusals import body_refusal
from fallback_mw.request.secrets import recordable
from fallback_mw.security import query_problem, request_header_problem

_BAD_NAME = "has a name that is not an HTTP token"


def refusal(
    context: RequestContext, body: RequestBody, settings: GatewaySettings
) -> tuple[str, str] | None:
    """The local error (code, message) that ends the request before the walk, or None."""
    refused = body_refusal(body, settings)
    if refused is not None:
        return refused
    problem = query_problem(context.query)
    if problem is not None:
        return "bad_request", f"{problem}: nothing was sent upstream"
    for name, value in context.forward_headers:
        problem = request_header_problem(name, value)
        if problem is not None:
            # The name, unless it is no token or carries a credential of the request.
            shown = recordable(context.secrets, name.decode("latin-1"))
            if shown is None or problem == _BAD_NAME:
                shown = "a request header"
            return "bad_request", f"{shown!r} {problem}: nothing was sent upstream"
    # Only when no candidate could take it: a candidate that rewrites the model is skipped
    # for a body it cannot rewrite (`AttemptRunner.takes_body`), the others send it as is.
    plan = [context.upstreams[n] for n in context.route.plan if n in context.upstreams]
    rewrite = bool(plan) and all(upstream.model for upstream in plan)
    if rewrite and (body.buffered is None or (body.buffered and body_json(body) is None)):
        return (
            "bad_request",
            "every candidate of this route rewrites the model: the body must be a JSON object "
            "within replay_buffer",
        )
    return None
