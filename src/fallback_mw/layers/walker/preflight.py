"""What stops a request before any upstream is contacted: its body (over the limit, too
slow), a model rewrite the body cannot take on every candidate. Each is a local error;
nothing here is an upstream's doing. (A budget refusal never gets here: the guard answers it
itself; a budgeted route no guard held, layers composed without one or out of order, is
refused here, fail closed.)"""

from __future__ import annotations

from typing import Final

from fallback_mw.config.views import AnySettings
from fallback_mw.request.body_json import body_json
from fallback_mw.request.context import RequestBody, RequestContext
from fallback_mw.request.refusals import body_refusal
from fallback_mw.request.secrets import recordable
from fallback_mw.security.queries import query_override_methods
from fallback_mw.security.values import query_problem, request_header_problem

_BAD_NAME: Final = "has a name that is not an HTTP token"
_FORM: Final = b"application/x-www-form-urlencoded"
# Fields a request may carry once (RFC 9110 §5.3: not a list, so two field lines are not
# one value), as upstream servers hold them (aiohttp's parser refuses these sent twice;
# the gateway sets Host, Content-Length and Transfer-Encoding itself). Sent twice, the
# upstream refused the request with its own error page, which it writes on a HEAD too: a
# body on an answer to HEAD, failover-class (SPEC §12), a breaker mark on every candidate
# the caller's own input reached (SPEC §5: one caller never opens a breaker for everyone).
_ONCE_ONLY: Final = frozenset(
    {
        b"content-location",
        b"content-range",
        b"content-type",
        b"etag",
        b"max-forwards",
        b"server",
        b"user-agent",
    }
)
_TWICE: Final = "is sent twice, and may be sent once (RFC 9110 §5.3): send one field"


def refusal(
    context: RequestContext, body: RequestBody, settings: AnySettings
) -> tuple[str, str] | None:
    """The local error (code, message) that ends the request before the walk, or None."""
    budget = context.route.budget
    if budget is not None and not context.guarded:
        return "budget_unavailable", _unguarded(context.route.id, budget)
    refused = body_refusal(body, settings)
    if refused is not None:
        return refused
    problem = query_problem(context.query)
    if problem is not None:
        return "bad_request", f"{problem}: nothing was sent upstream"
    once: set[bytes] | None = None
    for name, value in context.forward_headers:
        problem = request_header_problem(name, value)
        if problem is None and name in _ONCE_ONLY:
            if once is None:
                once = {name}
            elif name in once:
                problem = _TWICE
            else:
                once.add(name)
        if problem is not None:
            # The name, unless it is no token or carries a credential of the request.
            shown = recordable(context.secrets, name.decode("latin-1"))
            if shown is None or problem == _BAD_NAME:
                shown = "a request header"
            return "bad_request", f"{shown!r} {problem}: nothing was sent upstream"
    if body.buffered and body.buffered[:1] != b"{" and context.method == "POST":
        refused = _form_override(context, body.buffered)  # never a JSON body's cost
        if refused is not None:
            return refused
    # Only when no candidate could take it: a candidate that rewrites the model is skipped
    # for a body it cannot rewrite (`AttemptRunner.takes_body`), the others send it as is.
    # A loop, not a list and `all()` over a generator (about 2,000 instructions): every
    # request asks. True once a candidate rewrites, False at the first that does not.
    rewrite = False
    upstreams = context.upstreams
    for candidate in context.route.plan:
        upstream = upstreams.get(candidate)
        if upstream is not None:
            if not upstream.model:
                rewrite = False
                break
            rewrite = True
    if rewrite and (body.buffered is None or (body.buffered and body_json(body) is None)):
        return (
            "bad_request",
            "every candidate of this route rewrites the model: the body must be a JSON object "
            "within replay_buffer",
        )
    return None


def _form_override(context: RequestContext, data: bytes) -> tuple[str, str] | None:
    """A urlencoded form body's `_method` field, which Rack (Rails) and Symfony (Laravel)
    read on a POST as the method, as a `_method` query parameter is read: a method
    override (`context.overrides`, for the replay rule too), refused with 405 when the
    route does not forward that method. A body too large to buffer is not read."""
    for name, value in context.forward_headers:
        if name == b"content-type":
            if value[: len(_FORM)].lower() != _FORM:
                return None
            break
    else:
        return None
    named = query_override_methods(data, "POST")
    if not named:
        return None
    context.overrides = context.overrides | named
    if not named.difference(context.route.accepted_methods):
        return None
    return (
        "method_not_allowed",
        f"the form body's _method field asks for a method route {context.route.id!r} does "
        f"not forward (it forwards {', '.join(context.route.accepted_methods)}); to forward "
        "it, add that method to the route's methods beside those: nothing was sent upstream",
    )


def _unguarded(route_id: str, budget: str) -> str:
    """Layers composed by hand without a BudgetGuard between the RouteResolver and the
    PlanWalker (Starlette runs the middleware added last first: a guard added after the
    resolver runs outside it and sees no route, one added before the walker is never
    reached): the route's spend would go unheld."""
    return (
        f"no BudgetGuard held route {route_id!r}'s budget {budget!r}: refusing (fail closed). "
        "Compose RouteResolver(BudgetGuard(PlanWalker(app, ...), ledger=...), ...) in that "
        "order (with Starlette's add_middleware: the walker first, then the guard, the "
        "resolver last), or use Gateway, which composes them"
    )
