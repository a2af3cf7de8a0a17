"""PlanWalker: attempts, failover rules, the deadline, and streaming to the client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote

from fallback_mw.config import GatewayConfig, RouteConfig, UpstreamConfig
from fallback_mw.context import AttemptRecord, RequestContext, SkipRecord, get_context
from fallback_mw.credentials import CredentialInjector
from fallback_mw.errors import gateway_headers, send_error
from fallback_mw.failover import (
    CREDENTIAL_STATUSES,
    WalkState,
    further_attempt_allowed,
    is_failover_class,
)
from fallback_mw.faults import FaultSource, NoFaults
from fallback_mw.health import AlwaysHealthy, HealthState
from fallback_mw.hedge import attempt_with_hedge, hedge_applies
from fallback_mw.plan import candidate_order, is_canary
from fallback_mw.security import forwardable_response_headers
from fallback_mw.telemetry import Telemetry
from fallback_mw.types import ASGIApp, Receive, Scope, Send
from fallback_mw.upstream import make_client
from fallback_mw.upstream.base import (
    Timeouts,
    UpstreamClient,
    UpstreamError,
    UpstreamRequest,
    UpstreamResponse,
)

_PATH_SAFE = "/:@!$&'()*+,;=-._~"


class _RequestTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class SyntheticResponse:
    """A response made by the gateway itself (a `fail` fault): no packet leaves."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.headers: list[tuple[bytes, bytes]] = [(b"content-length", b"0")]

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        return
        yield b""  # pragma: no cover - makes this an async generator

    async def aclose(self) -> None:
        return None


@dataclass(slots=True)
class _Body:
    """The request body as read from the client."""

    buffered: bytes | None  # the whole body when it fit in replay_buffer
    stream: AsyncIterator[bytes] | None = None  # otherwise: the rest, read on demand
    too_large: bool = False


class PlanWalker:
    def __init__(
        self,
        app: ASGIApp,
        /,
        *,
        config: GatewayConfig,
        client: UpstreamClient | None = None,
        health: HealthState | None = None,
        faults: FaultSource | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.app = app
        settings = config.gateway
        self.settings = settings
        self.client = client or make_client(settings.engine, allow_hosts=settings.allow_hosts)
        self.health: HealthState = health or AlwaysHealthy()
        self.faults: FaultSource = faults or NoFaults()
        self.telemetry = telemetry or Telemetry()
        self._hygiene = CredentialInjector(self._walk, config=config)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        context = get_context(scope)
        if context is None:
            await self.app(scope, receive, send)
            return
        if context.credential_for is None:
            # Used without CredentialInjector: apply the same hygiene here.
            await self._hygiene(scope, receive, send)
            return
        await self._walk(scope, receive, send)

    async def _walk(self, scope: Scope, receive: Receive, send: Send) -> None:
        context = get_context(scope)
        assert context is not None
        self.telemetry.request_started(context)
        try:
            await _Walk(self, context, scope, receive, send).run()
        finally:
            self.telemetry.request_finished(context)

    async def aclose(self) -> None:
        await self.client.aclose()


class _Walk:
    """One request's walk (the per-request helper object; nothing here outlives it)."""

    def __init__(
        self,
        walker: PlanWalker,
        context: RequestContext,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        self.walker = walker
        self.settings = walker.settings
        self.context = context
        self.route: RouteConfig = context.route
        self.scope = scope
        self.receive = receive
        self.send = send
        self.used_credentials: dict[str, set[int]] = {}
        self.body_done = asyncio.Event()
        self.deadline_passed = False

    # --- the request body -------------------------------------------------------------

    def _declared_length(self) -> int | None:
        for key, value in self.scope.get("headers", ()):
            if key.lower() == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    async def _read_body(self) -> _Body | None:
        """Buffer up to replay_buffer; beyond it the body streams and is not replayable.
        Returns None when the request is over max_request_body."""
        limit = self.settings.max_request_body
        declared = self._declared_length()
        if declared is not None and declared > limit:
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            more = bool(message.get("more_body", False))
            if not more and size <= self.settings.replay_buffer:
                self.body_done.set()
                return _Body(buffered=b"".join(chunks))
            if size > self.settings.replay_buffer:
                # Larger than replay_buffer, even when it came in one message: not replayable.
                if not more:
                    self.body_done.set()
                body = _Body(buffered=None)
                body.stream = self._stream_rest(b"".join(chunks), size, body)
                return body

    async def _stream_rest(self, head: bytes, size: int, body: _Body) -> AsyncIterator[bytes]:
        """Over replay_buffer: the body goes to one attempt only, read as it is sent."""
        yield head
        if self.body_done.is_set():
            return
        limit = self.settings.max_request_body
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.context.client_disconnected = True
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                body.too_large = True
                raise _RequestTooLarge
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                self.body_done.set()
                return

    def _inspect_json(self, body: bytes) -> dict[str, Any] | None:
        if not body or body[:1] not in (b"{", b" ", b"\n", b"\r", b"\t"):
            return None
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return None
        return parsed if isinstance(parsed, dict) else None

    # --- the walk ---------------------------------------------------------------------

    async def run(self) -> None:
        context = self.context
        try:
            body = await self._read_body()
        except _ClientGone:
            context.client_disconnected = True
            context.outcome = "client_disconnected"
            return
        if body is None:
            await send_error(
                self.send,
                context,
                "request_too_large",
                f"request body exceeds max_request_body ({self.settings.max_request_body} bytes)",
            )
            return
        parsed: dict[str, Any] | None = None
        if body.buffered is not None:
            parsed = self._inspect_json(body.buffered)
            if parsed is not None and isinstance(parsed.get("model"), str):
                context.request_model = parsed["model"]
        needs_rewrite = any(
            context.upstreams[name].model for name in self.route.plan if name in context.upstreams
        )
        if needs_rewrite and (body.buffered is None or (body.buffered and parsed is None)):
            await send_error(
                self.send,
                context,
                "bad_request",
                "this route rewrites the model: the body must be a JSON object within "
                "replay_buffer",
            )
            return
        for hook in context.admission_hooks:
            refusal = await hook(body.buffered)
            if refusal is not None:
                await send_error(
                    self.send,
                    context,
                    refusal,
                    _REFUSAL_MESSAGES.get(refusal, "the request was refused"),
                )
                return

        pinned = await self.walker.faults.pinned_candidate(self.route.id)
        if pinned is not None and pinned in self.route.plan:
            context.pinned = pinned
        context.canary = pinned is None and is_canary(
            self.route, context.session, self.settings.canary_salt
        )
        context.candidates = candidate_order(
            self.route, canary=context.canary, pinned=context.pinned
        )

        # A client disconnect cancels the attempt in flight and starts nothing new. Plain
        # asyncio here (the engines are asyncio-only): one watcher task per request.
        walk_task = asyncio.current_task()
        assert walk_task is not None
        watcher = asyncio.create_task(self._watch_disconnect(walk_task))
        try:
            await self._walk(body, parsed)
        except asyncio.CancelledError:
            # Swallow only our own cancellation; anyone else's propagates.
            if not context.client_disconnected or walk_task.uncancel() > 0:
                raise
        finally:
            watcher.cancel()
        if context.client_disconnected and context.outcome is None:
            context.outcome = "client_disconnected"

    async def _watch_disconnect(self, walk_task: asyncio.Task[Any]) -> None:
        await self.body_done.wait()
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.context.client_disconnected = True
                walk_task.cancel()
                return

    def _state(self, body: _Body) -> WalkState:
        context = self.context
        return WalkState(
            replayable=body.buffered is not None
            and context.method in self.route.replayable_methods,
            client_connected=not context.client_disconnected,
            deadline_left=context.remaining > 0 and not self.deadline_passed,
            response_started=context.committed,
            attempts_made=context.attempt_count,
            attempt_ceiling=self.route.attempt_ceiling,
        )

    async def _walk(self, body: _Body, parsed: dict[str, Any] | None) -> None:
        context = self.context
        order = context.candidates
        walker = self.walker
        position = 0
        attempted_in_pass = False
        tried: set[str] = set()
        last_response: UpstreamResponse | None = None
        last_candidate: str | None = None
        last_error: UpstreamError | None = None
        retry_same = False
        while True:
            if context.attempt_count >= self.route.attempt_ceiling:
                break
            if context.remaining <= 0:
                break
            if retry_same:
                position -= 1
                retry_same = False
            elif position and position % len(order) == 0:
                if not attempted_in_pass:
                    break  # a whole pass with every candidate skipped
                attempted_in_pass = False
                # A pool's credentials are each used at most once per request (SPEC §6); an
                # upstream with a single credential may be repeated on a later pass.
                for used_name in list(self.used_credentials):
                    if len(context.upstreams[used_name].credential_envs) < 2:
                        del self.used_credentials[used_name]
            name = order[position % len(order)]
            position += 1
            upstream = context.upstreams[name]

            credential_index: int | None = None
            pool = len(upstream.credential_envs)
            if pool:
                used = frozenset(self.used_credentials.get(name, set()))
                credential_index = await walker.health.pick_credential(
                    name, pool, exclude=used, session=context.session
                )
                if (
                    credential_index is None
                    or context.credential_for is None
                    or (context.credential_for(name, credential_index) is None)
                ):
                    self._skip(name, "no_credential")
                    continue
            if not await walker.health.admit(name):
                self._skip(name, "breaker_open")
                continue

            if name in tried and self.route.backoff_ms:
                await asyncio.sleep(min(self.route.backoff_ms / 1000, max(context.remaining, 0)))
                if context.remaining <= 0:
                    break
            tried.add(name)
            attempted_in_pass = True
            if last_response is not None:
                await _close(last_response)
                last_response = None
            record = self._start_attempt(name, upstream, credential_index)
            if hedge_applies(self, name, body):
                outcome, record, credential_index = await attempt_with_hedge(
                    self, name, upstream, record, body, parsed, credential_index
                )
            else:
                outcome = await self._attempt(
                    name, upstream, record, body, parsed, credential_index
                )
            response, error, deadline_hit = outcome
            record.duration = time.monotonic() - record.started
            failover_class = is_failover_class(
                self.route, status=response.status if response else None, error=error
            )
            if error is not None:
                record.failure_kind = "fault" if record.fault else error.telemetry_kind
            elif response is not None:
                record.status = response.status
                if failover_class:
                    record.failure_kind = "fault" if record.fault else "status"
            walker.telemetry.attempt_finished(context, record)
            await walker.health.record(name, failure=failover_class)
            if credential_index is not None:
                await walker.health.credential_result(
                    name,
                    credential_index,
                    status=response.status if response else None,
                    failure=failover_class,
                    retry_after=_retry_after(response),
                    session=context.session,
                )

            if body.too_large:
                if response is not None:
                    await _close(response)
                await send_error(
                    self.send,
                    context,
                    "request_too_large",
                    f"request body exceeds max_request_body "
                    f"({self.settings.max_request_body} bytes)",
                )
                return
            if deadline_hit:
                self.deadline_passed = True
                if response is not None:
                    await _close(response)
                break
            if response is not None and not failover_class:
                if (
                    response.status in CREDENTIAL_STATUSES
                    and pool > 1
                    and further_attempt_allowed(self._state(body), last_failed_failover_class=True)
                    and len(self.used_credentials.get(name, ())) < pool
                ):
                    # SPEC §6: within a pool, 401/403/429 may move to another credential.
                    await _close(response)
                    retry_same = True
                    continue
                await self._commit(name, response)
                return
            last_candidate = name
            last_error = error
            if response is not None:
                last_response = response
            if not further_attempt_allowed(
                self._state(body), last_failed_failover_class=failover_class
            ):
                break

        await self._finish_without_success(body, last_response, last_candidate, last_error)

    async def _finish_without_success(
        self,
        body: _Body,
        last_response: UpstreamResponse | None,
        last_candidate: str | None,
        last_error: UpstreamError | None,
    ) -> None:
        context = self.context
        state = self._state(body)
        if context.client_disconnected:
            if last_response is not None:
                await _close(last_response)
            return
        if (
            last_response is not None
            and last_candidate is not None
            and (self.route.on_exhausted == "last_response" or not state.replayable)
            and state.deadline_left
        ):
            # Not replayable: the upstream's own answer is served as-is. Exhausted with
            # on_exhausted = "last_response": the last answer passes through.
            await self._commit(last_candidate, last_response)
            return
        if last_response is not None:
            await _close(last_response)
        if not state.deadline_left:
            await send_error(
                self.send,
                context,
                "deadline_exceeded",
                f"the route deadline passed after {context.attempt_count} attempt(s)",
            )
        elif context.attempt_count == 0:
            await send_error(
                self.send,
                context,
                "route_exhausted",
                "no candidate could be attempted (breakers open or credentials unusable)",
            )
        else:
            kind = last_error.telemetry_kind if last_error is not None else "status"
            await send_error(
                self.send,
                context,
                "upstream_failed",
                f"all {context.attempt_count} attempt(s) failed (last failure: {kind})",
            )

    def _skip(self, name: str, reason: str) -> None:
        self.context.skipped.append(SkipRecord(candidate=name, reason=reason))
        self.walker.telemetry.skipped(self.context, name, reason)

    def _start_attempt(
        self,
        name: str,
        upstream: UpstreamConfig,
        credential_index: int | None,
        *,
        hedge: bool = False,
    ) -> AttemptRecord:
        """Mark the credential used, and record and report the attempt about to start."""
        if credential_index is not None:
            self.used_credentials.setdefault(name, set()).add(credential_index)
        record = AttemptRecord(
            candidate=name,
            number=self.context.attempt_count + 1,
            server_address=upstream.host,
            credential_index=credential_index,
            hedge=hedge,
        )
        self.context.attempts.append(record)
        self.walker.telemetry.attempt_started(self.context, record)
        return record

    # --- one attempt ------------------------------------------------------------------

    def _request_body(
        self, upstream: UpstreamConfig, body: _Body, parsed: dict[str, Any] | None
    ) -> bytes | AsyncIterator[bytes]:
        if body.buffered is None:
            assert body.stream is not None
            return body.stream
        if upstream.model and parsed is not None:
            rewritten = dict(parsed)
            rewritten["model"] = upstream.model
            return json.dumps(rewritten, separators=(",", ":"), ensure_ascii=False).encode()
        return body.buffered

    def _request_url(self, upstream: UpstreamConfig) -> str:
        url = upstream.url + quote(self.context.path, safe=_PATH_SAFE)
        if self.context.query:
            url += "?" + self.context.query.decode("latin-1")
        return url

    async def _attempt(
        self,
        name: str,
        upstream: UpstreamConfig,
        record: AttemptRecord,
        body: _Body,
        parsed: dict[str, Any] | None,
        credential_index: int | None,
    ) -> tuple[UpstreamResponse | None, UpstreamError | None, bool]:
        """Returns (response, error, deadline_hit). The response is owned by the caller."""
        context = self.context
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in context.forward_headers]
        if credential_index is not None and context.credential_for is not None:
            credential = context.credential_for(name, credential_index)
            if credential is not None:
                headers.append(credential)
        self.walker.telemetry.inject_headers(headers)
        timeouts = Timeouts(
            connect=upstream.connect_timeout_ms / 1000,
            first_byte=upstream.first_byte_timeout_ms / 1000,
            idle=upstream.idle_timeout_ms / 1000,
        )
        request = UpstreamRequest(
            method=context.method,
            url=self._request_url(upstream),
            headers=headers,
            body=self._request_body(upstream, body, parsed),
            timeouts=timeouts,
        )
        fault = await self.walker.faults.upstream_fault(name)
        remaining = max(context.remaining, 0.0)
        try:
            async with asyncio.timeout(remaining) as deadline:
                if fault == "fail":
                    record.fault = "fail"
                    return SyntheticResponse(503), None, False
                if fault == "hang":
                    record.fault = "hang"
                    await asyncio.sleep(timeouts.first_byte)
                    raise UpstreamError("timeout", "first_byte", "fault: hang")
                response = await self.walker.client.send(request)
        except UpstreamError as exc:
            return None, exc, False
        except TimeoutError:
            if deadline.expired():
                record.failure_kind = "timeout"
                return None, UpstreamError("timeout", "first_byte", "route deadline"), True
            raise
        except (_RequestTooLarge, _ClientGone):
            return None, UpstreamError("transport", "connect", "request body aborted"), False
        # A redirect is never followed: it is an answer like any other.
        return response, None, False

    # --- the commit point and streaming -----------------------------------------------

    async def _commit(self, name: str, response: UpstreamResponse) -> None:
        context = self.context
        limit = self.settings.max_response_body
        try:
            declared = _content_length(response.headers)
            if declared is not None and declared > limit:
                await send_error(
                    self.send,
                    context,
                    "response_too_large",
                    f"the upstream response exceeds max_response_body ({limit} bytes)",
                )
                return
            context.chosen = name
            context.status = response.status
            content_type = next((v for k, v in response.headers if k == b"content-type"), None)
            headers = forwardable_response_headers(response.headers) + gateway_headers(context)
            await self.send(
                {"type": "http.response.start", "status": response.status, "headers": headers}
            )
            context.committed = True
            received = 0
            try:
                async for chunk in response.iter_chunks():
                    received += len(chunk)
                    if received > limit:
                        context.outcome = "response_too_large"
                        return  # abort: the client sees an incomplete response
                    for observe in context.response_observers:
                        observe(chunk, content_type)
                    await self.send(
                        {"type": "http.response.body", "body": chunk, "more_body": True}
                    )
            except UpstreamError:
                context.outcome = "aborted"
                return  # never ended as if complete
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
            context.completed = True
            context.outcome = "served"
        finally:
            await _close(response)


_REFUSAL_MESSAGES: Mapping[str, str] = {
    "budget_exceeded": "the budget for this route has no room for this request",
    "budget_unavailable": "the budget ledger cannot be reached; refusing (fail closed)",
}


async def _close(response: UpstreamResponse) -> None:
    # Engines complete aclose even when the calling task is being cancelled.
    await response.aclose()


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for key, value in headers:
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _retry_after(response: UpstreamResponse | None) -> float | None:
    """Retry-After as seconds from now: delta-seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if response is None:
        return None
    for key, value in response.headers:
        if key == b"retry-after":
            text = value.decode("latin-1").strip()
            if text.isdigit():
                return float(text)
            try:
                when = parsedate_to_datetime(text)
            except (TypeError, ValueError, IndexError):
                return None
            if when.tzinfo is None:
                return None
            return max((when - datetime.now(UTC)).total_seconds(), 0.0)
    return None
