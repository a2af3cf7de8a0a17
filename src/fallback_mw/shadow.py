"""Shadow traffic: a copy of a request sent to a route's `shadow` candidate, its answer read,
measured and discarded.

The copy starts only once the client's response has been sent (the walk is over), so it
can never delay, alter or fail it. It is not an attempt of the request: it counts against
neither the attempt ceiling nor the budget hold, and it has its own deadline (the route's,
counted from its start). It goes with the shadow candidate's own credential, is admitted
by that upstream's breaker and declared capacity like any attempt, and feeds its health.
Only a request in the slice (`shadow_percent` of sessions, deterministic per session),
whose body was buffered and whose method is replayable, is copied.

`ShadowTraffic` owns the copies in flight: at most `max_in_flight` at once, holding at most
`max_in_flight_bytes` of request bodies between them (a copy over either limit is dropped
and counted), each tracked so `aclose` cancels them and closes their
connections before the upstream client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import anyio

from fallback_mw.capacity import Ask, CapacityState, asker
from fallback_mw.config.views import AnyRoute, AnyUpstream
from fallback_mw.failover.attempt import AttemptLifecycle
from fallback_mw.failover.replay import is_replayable
from fallback_mw.failover.send import model_rewritten
from fallback_mw.faults import FaultSource
from fallback_mw.health import HealthState
from fallback_mw.health.pool import affinity_key
from fallback_mw.plan import canary_bucket
from fallback_mw.request.codings import body_coding
from fallback_mw.request.context import AttemptRecord, RequestBody, RequestContext, Usage
from fallback_mw.request.usage import UsageMeter
from fallback_mw.routing import effective_deadline_ms
from fallback_mw.telemetry import Telemetry
from fallback_mw.timers import deadline_after
from fallback_mw.upstream.base import UpstreamClient, UpstreamError, UpstreamResponse

MAX_IN_FLIGHT: Final = 256
# The request bodies copies in flight may keep alive between them: a copy holds its body
# until its own deadline, long after the caller's request has ended (256 copies of an
# 8 MiB replay_buffer would be 2 GiB; a caller picks a session id in the slice).
MAX_IN_FLIGHT_BYTES: Final = 64 * 1024 * 1024


def in_shadow_slice(route: AnyRoute, session: str | None, salt: str) -> bool:
    """`shadow_percent` of sessions, by the canary's hash under its own salt (so the shadow
    slice is not the canary slice). Requests without a session id are never copied."""
    if route.shadow is None or route.shadow_percent <= 0 or session is None:
        return False
    return canary_bucket(session, f"{salt}:shadow") < route.shadow_percent * 100


def should_shadow(context: RequestContext, body: RequestBody, salt: str) -> str | None:
    """The shadow candidate to copy this request to, or None. Called once the client's
    response has ended."""
    route = context.route
    name = route.shadow
    if name is None or name not in context.upstreams:
        return None
    if not context.completed or context.chosen is None:
        # Only after an upstream's answer went to the client whole: a response cut short
        # after the commit (a reset, over max_response_body) was not served.
        return None
    replayable = is_replayable(
        route,
        context.method,
        buffered=body.buffered is not None,
        headers=context.forward_headers,
        overrides=context.overrides,
    )
    if not replayable:
        return None  # never a request that cannot be sent twice
    if any(a.candidate == name for a in context.attempts):
        return None  # it already had this request, as a real attempt
    return name if in_shadow_slice(route, context.session, salt) else None


Asker = Callable[[str, AnyUpstream, bool], Ask]


def _kept(
    context: RequestContext, name: str, body: RequestBody, parsed: dict[str, Any] | None
) -> tuple[RequestBody, Asker, bool]:
    """What a copy keeps until it ends: the bytes it sends, never the body parsed as JSON,
    which holds many times their size (`[{},{},...]`: 64 bytes a dict per 3 sent) and is
    not counted in `max_in_flight_bytes`. Read from the parsed body now, while the request
    holds it: the candidate's `model` rewrite (the body then sent as it is: True) and the
    token estimate its declared `tpm` counts."""
    upstream = context.upstreams[name]
    estimate = asker(body.buffered, parsed, None)(name, upstream, False)
    buffered, rendered = body.buffered, False
    if upstream.model and buffered and parsed is not None:
        buffered = model_rewritten(upstream.model, parsed, buffered, context.forward_headers)
        rendered = True
    kept = dataclasses.replace(body, buffered=buffered, json=None, json_inspected=False)

    def ask(name: str, upstream: AnyUpstream, repeat: bool) -> Ask:
        return estimate._replace(repeat=repeat)

    return kept, ask, rendered


@dataclass(frozen=True, slots=True)
class ShadowResult:
    outcome: str  # "answered", "failed", or why no copy was sent ("breaker_open", ...)
    status: int | None = None
    failure_kind: str | None = None
    duration: float = 0.0
    received: int = 0  # response body bytes read (then discarded)


class ShadowTraffic:
    def __init__(
        self,
        *,
        client: UpstreamClient,
        health: HealthState,
        capacity: CapacityState,
        faults: FaultSource,
        telemetry: Telemetry,
        deadline_ms: int,
        max_response_body: int,
        max_in_flight: int = MAX_IN_FLIGHT,
        max_in_flight_bytes: int = MAX_IN_FLIGHT_BYTES,
    ) -> None:
        self.client = client
        self.health = health
        self.capacity = capacity
        self.faults = faults
        self.telemetry = telemetry
        self.deadline_ms = deadline_ms
        self.max_response_body = max_response_body
        self.max_in_flight = max_in_flight
        self.max_in_flight_bytes = max_in_flight_bytes
        self.bytes_in_flight = 0  # the buffered bodies the copies in flight hold
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def start(
        self, name: str, context: RequestContext, body: RequestBody, parsed: dict[str, Any] | None
    ) -> bool:
        """Start a copy of the request to `name` in the background; False when it was not
        started (shutting down, or too many copies or body bytes in flight)."""
        span = self.telemetry.shadow_started(context, name)
        try:
            body, ask, rendered = _kept(context, name, body, parsed)
        except Exception:  # taken on the caller's stack: a copy must never surface there
            # (a body nested just under what json.loads reads: rewriting it again, deeper in
            # the stack, raised RecursionError through the caller's served request)
            self.telemetry.shadow_finished(
                span, context.route.id, name, "failed", None, 0.0, failure_kind="internal"
            )
            return False
        size = len(body.buffered) if body.buffered is not None else 0
        if (
            self._closed
            or len(self._tasks) >= self.max_in_flight
            or self.bytes_in_flight + size > self.max_in_flight_bytes
        ):
            self.telemetry.shadow_finished(span, context.route.id, name, "overloaded", None, 0.0)
            return False
        route = context.route
        deadline = effective_deadline_ms(route, self.deadline_ms) / 1000
        # The copy's own context: its own deadline, no attempts, the caller long gone.
        # Its own usage: what the copy's answer reports is the candidate's, never the client's.
        copy = dataclasses.replace(
            context, deadline=time.monotonic() + deadline, attempts=[], skipped=[],
            client_disconnected=False, trace=None, usage=Usage(), body=body,
        )  # fmt: skip
        parent = self.telemetry.shadow_parent(context)  # the caller's baggage, for the copy
        task = asyncio.create_task(self._run(name, copy, body, ask, rendered, span, parent))
        self._tasks.add(task)
        self.bytes_in_flight += size

        def done(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            self.bytes_in_flight -= size

        task.add_done_callback(done)
        return True

    async def _run(
        self,
        name: str,
        context: RequestContext,
        body: RequestBody,
        ask: Asker,
        rendered: bool,
        span: Any,
        parent: Any,
    ) -> None:
        result = ShadowResult("cancelled")
        try:
            with self.telemetry.shadow_scope(span, parent):
                result = await self._copy(name, context, body, ask, rendered)
        except asyncio.CancelledError:
            raise  # shutdown: recorded below as cancelled
        except Exception:  # a copy must never surface anywhere: it is only measured
            result = ShadowResult("failed", failure_kind="internal")
        finally:
            self.telemetry.shadow_finished(
                span, context.route.id, name, result.outcome, result.status, result.duration,
                failure_kind=result.failure_kind,
            )  # fmt: skip

    async def _copy(
        self, name: str, context: RequestContext, body: RequestBody, ask: Asker, rendered: bool
    ) -> ShadowResult:
        upstream = context.upstreams[name]
        credential: int | None = None
        pool = len(upstream.credential_envs)
        if pool:
            credential = await self.health.pick_credential(
                name, pool, exclude=frozenset(), selection=upstream.selection,
                session=affinity_key(context.route.id, context.request_model, context.session),
            )  # fmt: skip
            if credential is None or context.credential(name, credential) is None:
                return ShadowResult("no_credential")
        # The same lifecycle as the walk's attempts: its gates and health marking; the
        # copy is not an attempt of the request, so it is neither started nor finished.
        attempts = AttemptLifecycle(
            context, body, None, client=self.client, faults=self.faults, health=self.health,
            capacity=self.capacity, telemetry=self.telemetry, ask=ask, shadow=True,
            rendered=rendered,
        )  # fmt: skip
        reservation = await attempts.gate(name, upstream, repeat=False)
        if isinstance(reservation, str):
            return ShadowResult(reservation)
        record = AttemptRecord(
            candidate=name,
            number=0,
            server_address=upstream.host,
            server_port=upstream.port,
            credential_index=credential,
        )
        started = time.monotonic()
        try:
            outcome, response = await attempts.run(name, upstream, record)
        except BaseException as exc:
            # Cancelled (shutdown) in the attempt: nothing proven, and a half-open probe
            # slot the copy held must not stay taken for its lease (in Redis, for every
            # process).
            with anyio.CancelScope(shield=True):
                await attempts.release(name)
            raise exc
        try:
            # Judged by its head, as an attempt is (the body is not graded): a probe copy
            # whose answer streams for a minute held the half-open slot all that time.
            mark = await attempts.mark_health(name, credential, outcome, response)
        except BaseException as exc:
            if response is not None:  # cancelled (shutdown): nobody reads it
                with anyio.CancelScope(shield=True):
                    await response.aclose()
            raise exc
        received = 0 if response is None else await self._read(context, response)
        await attempts.settle_tokens(name, outcome.status)
        answered = outcome.kind == "status" and not mark
        return ShadowResult(
            "answered" if answered else "failed",
            status=outcome.status,
            failure_kind=outcome.failure_kind or ("status" if mark else None),
            duration=time.monotonic() - started,
            received=received,
        )

    async def _read(self, context: RequestContext, response: UpstreamResponse) -> int:
        """The copy's body, up to max_response_body (the bytes received). Metered like a
        served response: the usage it reports replaces the estimate counted against the
        candidate's `tpm` (the copy's tokens are spent there)."""
        received = 0
        meter = UsageMeter(context.usage)
        content_type, content_encoding = body_coding(response.headers)
        try:
            with deadline_after(max(context.remaining, 0.0)):
                async for chunk in response.iter_chunks():
                    received += len(chunk)
                    if received > self.max_response_body:
                        break  # measured enough; the rest is not read
                    meter.observe(chunk, content_type, content_encoding)
        except (TimeoutError, UpstreamError):
            pass  # the head arrived: the upstream answered; the body is not graded
        except BaseException as exc:
            # Not a `finally`: a mypyc-compiled coroutine re-raises a stale exception after
            # a `finally` that awaits (scripts/compile.py).
            await _closed(meter, response)
            raise exc
        await _closed(meter, response)
        return received

    def reopen(self) -> None:
        """Copies start again (a lifespan startup after the shutdown that closed them)."""
        self._closed = False

    async def aclose(self) -> None:
        """Cancel every copy in flight and wait for their connections to close."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _closed(meter: UsageMeter, response: UpstreamResponse) -> None:
    meter.finish()
    with anyio.CancelScope(shield=True):
        await response.aclose()
