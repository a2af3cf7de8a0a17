"""The per-request context: everything one routed request knows, kept in the ASGI scope.

Middleware instances are shared by every request; nothing request-specific ever lives
on them (the OpenTelemetry ASGI bug STYLE.md warns about)."""

from __future__ import annotations

import asyncio
import operator
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Final

from fallback_mw.config.views import RouteView, UpstreamView
from fallback_mw.request.records import AttemptRecord as AttemptRecord  # re-exported
from fallback_mw.request.records import SkipRecord as SkipRecord  # re-exported
from fallback_mw.request.secrets import RequestSecrets
from fallback_mw.timers import monotonic

SCOPE_KEY: Final = "fallback_mw.request.context"
# The most of a caller's or an upstream's name (a model, a tenant) a request keeps beyond
# its routing: usage records (kept for every request), affinity keys, the meter's model.
MAX_NAME: Final = 200

Headers = list[tuple[bytes, bytes]]


def new_request_id() -> str:
    """32 random hex digits, as `uuid4().hex` was, at a sixth of its cost: `random`'s
    generator (seeded from the OS, and again in a forked child) rather than a
    `getrandom` system call per request, which also releases the GIL and, with a
    background thread busy (the OTel SDK's exporter), can wait a whole switch interval
    to get it back. Ids are for correlation, not secrets; nothing reads them as UUIDs.
    The digits of its 16 bytes, as `f"{n:032x}"` writes them, for a third fewer
    instructions (the format spec's parse and a 128-bit integer's conversion)."""
    return random.getrandbits(128).to_bytes(16, "big").hex()


# Why the walk passes over a candidate without an attempt (its skip reason). Each has a
# remedy in failover.decide's route_exhausted message; telemetry exports each candidate's
# skip series at 0 from the start.
SKIP_REASONS: Final = (
    "breaker_open",
    "no_credential",
    "capacity",
    "model_rewrite",
    "repeat_budget",
)


# The `__init__` written out (request/records.py says why).
@dataclass(slots=True, repr=False, init=False)
class RequestBody:
    """The request body as read from the client, once (walk/body.py reads it)."""

    buffered: bytes | None  # the whole body when it fit in replay_buffer
    stream: AsyncIterator[bytes] | None  # otherwise: the rest, read on demand
    # The streamed body's length when known (the caller's Content-Length, or a chunked body
    # read whole): sent upstream as Content-Length, so upstreams that demand one get it.
    length: int | None
    declared: int | None  # the caller's Content-Length, if any (body.content_length)
    too_large: bool  # over max_request_body (before or while streaming)
    timed_out: bool  # the body did not arrive before the deadline
    client_gone: bool  # the caller hung up while sending it
    misframed: bool  # shorter or longer than the Content-Length it streams with
    # What the host's `receive` raised while the body streamed to an attempt (a middleware
    # in front refusing it: a size limit, a signature check): raised to the host again.
    host_refusal: Exception | None
    finished: bool  # every message received (`finish`)
    # Made only for a reader that waits for the end (`wait_finished`): an asyncio.Event per
    # request, made and set, was some 4k instructions for a wait almost never needed.
    waiter: asyncio.Event | None
    # The buffered body as a JSON object (None: not one), parsed at most once per request
    # by whichever layer asks first (walk/body.py `body_json`).
    json: dict[str, Any] | None
    json_inspected: bool

    def __init__(
        self,
        buffered: bytes | None = None,
        stream: AsyncIterator[bytes] | None = None,
        length: int | None = None,
        declared: int | None = None,
        too_large: bool = False,
        timed_out: bool = False,
        client_gone: bool = False,
        misframed: bool = False,
        host_refusal: Exception | None = None,
        finished: bool = False,
        waiter: asyncio.Event | None = None,
        json: dict[str, Any] | None = None,
        json_inspected: bool = False,
    ) -> None:
        self.buffered = buffered
        self.stream = stream
        self.length = length
        self.declared = declared
        self.too_large = too_large
        self.timed_out = timed_out
        self.client_gone = client_gone
        self.misframed = misframed
        self.host_refusal = host_refusal
        self.finished = finished
        self.waiter = waiter
        self.json = json
        self.json_inspected = json_inspected

    @property
    def ok(self) -> bool:
        return not (self.too_large or self.timed_out or self.client_gone or self.misframed)

    def finish(self) -> None:
        """Every message of the body has been received."""
        self.finished = True
        if self.waiter is not None:
            self.waiter.set()

    async def wait_finished(self) -> None:
        if not self.finished:
            if self.waiter is None:
                self.waiter = asyncio.Event()
            await self.waiter.wait()

    def __repr__(self) -> str:
        # What an error reporter shows of a frame's locals: its size, never its bytes.
        size = len(self.buffered) if self.buffered is not None else self.length
        return f"<RequestBody {size if size is not None else '?'} bytes>"


# The `__init__` written out (request/records.py says why).
@dataclass(slots=True, init=False)
class Usage:
    input_tokens: int | None
    output_tokens: int | None
    model: str | None  # the model the upstream says answered
    # An SSE stream's `data: [DONE]` was relayed: all that the SDKs read of it (they stop
    # there) reached the client, its usage included.
    done: bool

    def __init__(
        self,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        model: str | None = None,
        done: bool = False,
    ) -> None:
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.model = model
        self.done = done

    @property
    def reported(self) -> bool:
        """The upstream reported a token count (the response path's meter found one)."""
        return self.input_tokens is not None or self.output_tokens is not None


@dataclass(slots=True, repr=False)
class RequestContext:
    # The route and the table's upstreams as the request path reads them: plain views of
    # the configuration models (config/views.py; each keeps its model as `config`).
    route: RouteView
    upstreams: Mapping[str, UpstreamView]
    tenant: str
    session: str | None
    method: str
    path: str  # normalised path, the one matched (and forwarded, unless spelled_path)
    query: bytes  # forwarded upstream, never recorded
    deadline: float  # time.monotonic() by which the walk must have a response head
    # The configured deadline (the route's deadline_ms, else [gateway]'s), and the caller's
    # x-gateway-deadline-ms when it shortened it: a 504 names the one that applied.
    configured_deadline_ms: int | None = None
    caller_deadline_ms: int | None = None
    # Where the caller reaches the gateway: the mount's `root_path` ("" at the root).
    mount: str = ""
    # The request fields the answer was chosen by (the tenant header, a canary's session
    # header), added to the relayed answer's `Vary` (RFC 9110 §12.5.5); (): none of ours.
    vary: tuple[bytes, ...] = ()
    # The path forwarded when the caller's percent-encoding is kept (spelling.caller_spelling:
    # `%2F` inside a segment); None: `path`, quoted.
    spelled_path: str | None = None
    # The candidate whose repeat the walk was waiting out backoff_ms for when the deadline
    # ran out (the 504 names the backoff, not only the deadline).
    backoff_cut: str | None = None
    # The methods the caller's method-override fields and `_method` query parameter name
    # (`security.override_methods`, `query_override_methods`),
    # read once by the resolver from the request as it came: its 405 and the replay rule.
    overrides: frozenset[str] = frozenset()
    request_id: str = field(default_factory=new_request_id)
    started: float = field(default_factory=time.monotonic)
    candidates: list[str] = field(default_factory=list)  # this request's order
    # Canary traffic (SPEC §8): set when an attempt goes to `canary_candidate`, the
    # candidate a canary session is sent to first (None: not in the slice). One the walk
    # skipped (breaker open) leaves the request unnamed: it never went to the canary.
    canary: bool = False
    canary_candidate: str | None = None
    pinned: str | None = None
    # The route table's upstream auth headers: stripped from the caller like the rest.
    upstream_auth_headers: frozenset[bytes] = frozenset()
    forward_headers: Headers = field(default_factory=list)  # caller headers, cleaned
    # Set by CredentialInjector: upstream name -> (header, value) per pool index (None:
    # unset). None here means no injector ran: the walker applies the same hygiene.
    credentials: Mapping[str, tuple[tuple[str, str] | None, ...]] | None = None
    body: RequestBody | None = None
    attempts: list[AttemptRecord] = field(default_factory=list)
    skipped: list[SkipRecord] = field(default_factory=list)
    # Skipped pools every credential of which is retired for good (401s): set by a 503
    # route_exhausted's Retry-After look-up, named with their variables in its message.
    revoked: tuple[str, ...] = ()
    chosen: str | None = None
    status: int | None = None  # status sent to the client
    # The game-day fault whose synthetic answer was served (`fail`'s 503, `revoke`'s 401):
    # nothing reached the upstream, so the budget guard charges nothing for it.
    served_fault: str | None = None
    outcome: str | None = None  # "served" or an error code (SPEC §5), or "aborted"
    rule: str | None = None  # the SPEC §5/§12 rule that ended the walk locally (error body)
    committed: bool = False  # http.response.start sent to the client
    guarded: bool = False  # a BudgetGuard took it (the walker serves no budgeted route else)
    completed: bool = False  # final body chunk sent
    client_disconnected: bool = False
    request_model: str | None = None
    usage: Usage = field(default_factory=Usage)
    trace: object | None = None  # telemetry's own per-request state (spans in flight)
    # The credentials nothing recorded of this request may carry (request/secrets.py).
    secrets: RequestSecrets | None = None

    @classmethod
    def routed(
        cls,
        route: RouteView,
        upstreams: Mapping[str, UpstreamView],
        tenant: str,
        session: str | None,
        method: str,
        path: str,
        query: bytes,
        deadline: float,
        configured_deadline_ms: int | None,
        caller_deadline_ms: int | None,
        mount: str,
        vary: tuple[bytes, ...],
        spelled_path: str | None,
        overrides: frozenset[str],
        started: float,
        upstream_auth_headers: frozenset[bytes],
        request_model: str | None,
        secrets: RequestSecrets | None,
    ) -> RequestContext:
        """The context the resolver makes for a routed request: what
        `RequestContext(route=..., ...)` makes of these fields, every other at its default
        (a new request id, new lists and a new `Usage`), for half the instructions (about
        11k against 22k): a class called with keywords builds a dictionary of them, and
        its `__init__` binds each of the 38 parameters. Called positionally, once per
        request; every field is set here (tests/test_context_routed.py holds that)."""
        self = _new(cls)
        self.route = route
        self.upstreams = upstreams
        self.tenant = tenant
        self.session = session
        self.method = method
        self.path = path
        self.query = query
        self.deadline = deadline
        self.configured_deadline_ms = configured_deadline_ms
        self.caller_deadline_ms = caller_deadline_ms
        self.mount = mount
        self.vary = vary
        self.spelled_path = spelled_path
        self.backoff_cut = None
        self.overrides = overrides
        self.request_id = new_request_id()
        self.started = started
        self.candidates = []
        self.canary = False
        self.canary_candidate = None
        self.pinned = None
        self.upstream_auth_headers = upstream_auth_headers
        self.forward_headers = []
        self.credentials = None
        self.body = None
        self.attempts = []
        self.skipped = []
        self.revoked = ()
        self.chosen = None
        self.status = None
        self.served_fault = None
        self.outcome = None
        self.rule = None
        self.committed = False
        self.guarded = False
        self.completed = False
        self.client_disconnected = False
        self.request_model = request_model
        self.usage = Usage()
        self.trace = None
        self.secrets = secrets
        return self

    def __repr__(self) -> str:
        # The context rides in the ASGI scope, which every frame of the host app holds: an
        # error reporter recording locals (Sentry, rich's show_locals) showed the dataclass's
        # fields, the provider keys injected (`credentials`), the caller's query and body.
        return f"<RequestContext {self.request_id} route={self.route.id!r} {self.method}>"

    def credential(self, upstream: str, index: int) -> tuple[str, str] | None:
        found = (self.credentials or {}).get(upstream, ())
        return found[index] if 0 <= index < len(found) else None

    def has_credential(self, upstream: str, index: int) -> bool:
        return self.credential(upstream, index) is not None

    @property
    def attempt_count(self) -> int:
        return len(self.attempts)

    @property
    def remaining(self) -> float:
        return self.deadline - monotonic()

    @property
    def fault(self) -> bool:
        """Game-day traffic (SPEC §12): a pin chose the order, a fault drove an attempt, or
        a candidate was skipped because a breaker that fault outcomes opened is open."""
        if self.pinned is not None:
            return True
        # Loops, not `any()` over generators: asked at every request's end.
        for attempt in self.attempts:
            if attempt.fault:
                return True
        for skip in self.skipped:  # noqa: SIM110 (any() over a generator: what this avoids)
            if skip.fault:
                return True
        return False

    @property
    def fallback(self) -> bool:
        return (
            self.chosen is not None
            and bool(self.candidates)
            and (self.chosen != self.candidates[0])
        )


# `RequestContext.routed`'s allocation, without `__init__`: `object.__new__` in the pure
# build, the native class's own when compiled (scripts/compile.py), whose instances
# `object.__new__` refuses (`cls.__new__(cls)` in the method crashes mypyc).
_new: Final[Callable[[type[RequestContext]], RequestContext]] = RequestContext.__new__


def get_context(scope: MutableMapping[str, Any]) -> RequestContext | None:
    context = scope.get(SCOPE_KEY)
    return context if isinstance(context, RequestContext) else None


def host_cancelled(context: RequestContext) -> None:
    """The host cancelled the request's task (serve's `--timeout-graceful-shutdown` cutting
    a request in flight, a host that cancels on disconnect): recorded as `cancelled` (log
    line, span, metrics, usage record), not as the gateway's `internal_error`, unless an
    outcome was already known."""
    if context.outcome is None:
        context.outcome = "cancelled"


def host_refused(context: RequestContext) -> None:
    """The host's `receive` raised while the gateway read the request body (a middleware in
    front refusing it: Starlette's `max_body_size`, a signature check): the host ends the
    request, with its exception, and answers it. Recorded as `cancelled`, rule
    `host_refused`, not as the gateway's `internal_error` nor any upstream's failure."""
    if context.outcome is None:
        context.outcome = "cancelled"
        context.rule = "host_refused"


def walk_order(context: RequestContext) -> list[AttemptRecord | SkipRecord]:
    """Attempts and skips in the order the walk met them (a skip made after k attempts
    comes before attempt k + 1): what `usage` and `request` show as the request's trail."""
    # attrgetter keys, not lambdas: no Python call per record (asked at every request's end).
    skips = sorted(context.skipped, key=_AFTER_ATTEMPTS)
    steps: list[AttemptRecord | SkipRecord] = []
    for record in sorted(context.attempts, key=_NUMBER):
        while skips and skips[0].after_attempts < record.number:
            steps.append(skips.pop(0))
        steps.append(record)
    steps.extend(skips)
    return steps


_AFTER_ATTEMPTS: Final = operator.attrgetter("after_attempts")
_NUMBER: Final = operator.attrgetter("number")
