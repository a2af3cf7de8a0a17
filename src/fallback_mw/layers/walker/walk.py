"""One request's walk (`_Walk`, the plan walker's per-request helper object): it reads the
body, orders the candidates, and walks them: the cursor picks, the runner attempts,
`decide` says what happens next, the stream relays the chosen response. It knows nothing
of budgets."""

from __future__ import annotations

import asyncio
import functools

import anyio

from fallback_mw.capacity import asker
from fallback_mw.failover.attempt import AttemptLifecycle
from fallback_mw.failover.decide import (
    Decision,
    WalkState,
    decide,
    further_attempt_possible,
    walk_state,
)
from fallback_mw.failover.messages import error_message
from fallback_mw.failover.outcome import Outcome
from fallback_mw.failover.replay import attempt_ceiling, is_keyed_post, may_hedge, replay_rule
from fallback_mw.faults import NoFaults
from fallback_mw.health.pool import affinity_key
from fallback_mw.layers.walker.cursor import CandidateCursor, Pick, skip_recorder
from fallback_mw.layers.walker.disconnect import DisconnectWatch
from fallback_mw.layers.walker.hedge import run_hedged
from fallback_mw.layers.walker.kit import WalkKit
from fallback_mw.layers.walker.max_forwards import MAX_FORWARDS_METHODS, answered_here
from fallback_mw.layers.walker.preflight import refusal
from fallback_mw.layers.walker.retry_after import retry_after
from fallback_mw.layers.walker.stream import commit
from fallback_mw.layers.walker.via import came_back, refuse_loop
from fallback_mw.plan import candidate_order, is_canary
from fallback_mw.request.body import read_body
from fallback_mw.request.body_json import estimate_source, request_json
from fallback_mw.request.connection_loss import SCOPE_KEY as LOSS_KEY
from fallback_mw.request.connection_loss import ConnectionLoss
from fallback_mw.request.context import AttemptRecord, RequestContext, host_cancelled, host_refused
from fallback_mw.request.local_errors import send_error
from fallback_mw.request.types import Receive, Scope, Send
from fallback_mw.shadow import should_shadow
from fallback_mw.timers import current_task
from fallback_mw.upstream.base import UpstreamResponse


class _Walk:
    """One request's walk (the per-request helper object; nothing here outlives it)."""

    def __init__(
        self, walker: WalkKit, context: RequestContext, scope: Scope, receive: Receive,
        send: Send,
    ) -> None:  # fmt: skip
        self.walker = walker
        self.context = context
        self.route = context.route
        self.scope = scope
        self.receive = receive
        self.send = send
        # The response kept to serve, with the attempt that produced it.
        self.last_response: tuple[str, UpstreamResponse, AttemptRecord | None] | None = None

    async def run(self) -> None:
        context = self.context
        body = await read_body(context, self.scope, self.receive, self.walker.settings)
        if body.client_gone:
            context.outcome = "client_disconnected"
            context.rule = "client_gone"
            return
        walker = self.walker
        refused = refusal(context, body, walker.settings)
        if refused is not None:
            allow = None
            if refused[0] == "method_not_allowed":
                allow = [(b"allow", ", ".join(self.route.accepted_methods).encode())]
            await send_error(self.send, context, *refused, headers=allow)
            return
        if came_back(context, walker.via_secret, self.scope):
            await refuse_loop(self.send, context)
            return
        if context.method in MAX_FORWARDS_METHODS and await answered_here(self.send, context):
            return
        parsed = request_json(context, body)
        faults = walker.faults
        # No fault source (no store): no coroutine asked for what is always None.
        pinned = None if type(faults) is NoFaults else await faults.pinned_candidate(self.route.id)
        if pinned is not None and pinned in self.route.plan:
            context.pinned = pinned
        in_slice = context.pinned is None and is_canary(
            self.route, context.session, walker.settings.canary_salt
        )
        context.candidates = candidate_order(self.route, canary=in_slice, pinned=context.pinned)
        if in_slice:  # named canary once an attempt goes there (AttemptLifecycle.start)
            context.canary_candidate = context.candidates[0]
        self.body = body
        self.unreplayable = replay_rule(
            self.route,
            context.method,
            buffered=body.buffered is not None,
            headers=context.forward_headers,
            overrides=context.overrides,
        )
        self.replayable = self.unreplayable is None
        self.parsed = parsed
        # Not buffered: the size read whole (a chunked body) or the declared length.
        size = body.length if body.length is not None else body.declared
        # Positional (a class called with keywords builds a dict of them for every call):
        # the client, faults, health, capacity, telemetry, the ask, shadow, replayable.
        self.attempts = AttemptLifecycle(
            context, body, parsed, walker.client, walker.faults, walker.health,
            walker.capacity, walker.telemetry,
            # A partial of locals, not a lambda over `self`: the walk holds its lifecycle,
            # which holds this, and a cycle per request left every walk to the garbage
            # collector (+4 % instructions per request, the collections' traversals).
            asker(
                body.buffered, parsed, size,
                functools.partial(
                    estimate_source, self.scope, body, walker.settings.replay_buffer
                ),
            ),
            False, self.replayable,
        )  # fmt: skip
        attempts = self.attempts
        # Positional (a class called with keywords builds a dict of them): the order, the
        # upstreams, health, the affinity key, has_credential, on_skip, the gate.
        self.cursor = CandidateCursor(
            context.candidates, context.upstreams, walker.health,
            affinity_key(self.route.id, context.request_model, context.session),
            # A method of the context, not a lambda: compiled, a lambda holds the whole
            # of this method's locals (`self` too), and the walk holds its cursor.
            context.has_credential,
            skip_recorder(context, walker.telemetry),  # no cycle back to self
            attempts.gate,
        )  # fmt: skip
        # A client disconnect cancels the attempt in flight and starts nothing new. The
        # watcher (a task reading `receive`) starts once the walk has lasted WATCH_AFTER:
        # a walk done sooner never pays for it, and a disconnect is noticed at most that
        # much later (the server keeps it: `receive` says `http.disconnect` when asked).
        # Under serve the server tells of the loss itself: no task (connection_loss.py).
        walk_task = current_task(asyncio.get_running_loop())
        assert walk_task is not None
        loss = self.scope.get(LOSS_KEY)
        watch = DisconnectWatch(
            self.receive, body, context, walk_task,
            loss if isinstance(loss, ConnectionLoss) else None,
        )  # fmt: skip
        try:
            # The walk's loop, in this frame rather than a coroutine of its own: every
            # await below passes through each frame of the chain (docs/performance.md).
            while True:
                if context.remaining <= 0:
                    await self._act(Outcome("deadline"), None, None, None)
                    break
                pick = await self.cursor.pick()
                if not isinstance(pick, Pick):  # every candidate skipped, or no repeat allowed
                    await self._act(pick, None, None, None)
                    break
                if pick.repeat and self.route.backoff_ms:
                    try:
                        await asyncio.sleep(
                            min(self.route.backoff_ms / 1000, max(context.remaining, 0))
                        )
                    except asyncio.CancelledError as exc:
                        # The caller left during the backoff: the repeat is never sent, so it
                        # gives back its capacity slot and any probe slot it held.
                        with anyio.CancelScope(shield=True):
                            await attempts.cancel(pick.name, pick.reservation)
                        raise exc  # not bare: see scripts/compile.py
                    if context.remaining <= 0:
                        await attempts.cancel(pick.name, pick.reservation)
                        context.backoff_cut = pick.name
                        await self._act(Outcome("deadline"), None, None, None)
                        break
                record = attempts.start(pick.name, pick.upstream, pick.credential_index)
                # The Idempotency-Key is looked for only on a route that hedges.
                hedged = self.route.hedge_after_ms > 0 and may_hedge(
                    self.route,
                    replayable=self.replayable,
                    first_attempt=context.attempt_count == 1,
                    at_first_candidate=pick.name == context.candidates[0],
                    keyed_post=is_keyed_post(context.method, context.forward_headers),
                )
                try:
                    if hedged:
                        (outcome, response), record = await run_hedged(
                            attempts, self.cursor, pick, record,
                            after=self.route.hedge_after_ms / 1000,
                            may_start=lambda: further_attempt_possible(self.state()),
                            keep=self._keep,
                        )  # fmt: skip
                    else:
                        outcome, response = await attempts.run(pick.name, pick.upstream, record)
                except asyncio.CancelledError as exc:
                    # The caller left mid-attempt (or the host cancelled it): nothing proven of
                    # the upstream, and a half-open probe slot the attempt held is free now, not
                    # at the end of its lease (every request skipped the upstream meanwhile).
                    with anyio.CancelScope(shield=True):
                        await attempts.release(pick.name, record)
                    raise exc
                try:
                    marks = attempts.finish(record, outcome, response)
                    if marks is not None:  # a health state that waits (Redis)
                        await marks
                    done = await self._act(outcome, response, pick.name, record)
                except BaseException as exc:
                    # Cut short before the response was kept, relayed or closed (the caller
                    # left while a shared state's round trip booked it): closed here, or its
                    # upstream connection stays open and taken for good. Closing twice is safe.
                    if response is not None:
                        await response.aclose()
                    raise exc
                if done:
                    break
        except BaseException as exc:
            # Swallow only our own cancellation; anyone else's propagates. The walk's end
            # is not a `finally`: a mypyc-compiled coroutine re-raises a stale exception
            # after a `finally` that awaits (scripts/compile.py).
            cancelled = isinstance(exc, asyncio.CancelledError)
            if not cancelled or not context.client_disconnected or walk_task.uncancel() > 0:
                if cancelled:
                    host_cancelled(context)
                watch.stop()
                if self.last_response is not None:
                    await self.last_response[1].aclose()
                raise exc
        watch.stop()
        if self.last_response is not None:
            await self.last_response[1].aclose()
        refused_by_host = body.host_refusal
        if refused_by_host is not None and not context.committed:
            host_refused(context)
            raise refused_by_host  # the host's middleware answers its own refusal
        if context.client_disconnected and context.outcome is None:
            if context.usage.done:
                # It left after `data: [DONE]` (the sync openai SDK closes the response
                # there), before the upstream's end of body: nothing it reads was lost.
                context.completed = True
                context.outcome = "served"
                if context.chosen is not None:
                    await self._served(context.chosen)
            else:
                context.outcome = "client_disconnected"
                context.rule = "client_gone"

    def state(self, *, other_credential: bool = False, holding: bool = False) -> WalkState:
        """The walk as `decide` reads it. `holding`: the outcome being decided came with a
        response (not yet kept): it is the last upstream answer `last_response` serves."""
        context = self.context
        return walk_state(
            replayable=self.replayable,
            client_connected=not context.client_disconnected,
            deadline_left=context.remaining > 0,
            response_started=context.committed,
            attempts_made=context.attempt_count,
            attempt_ceiling=attempt_ceiling(self.route, replayable=self.replayable),
            failover_status=self.route.failover_status,
            on_exhausted=self.route.on_exhausted,
            other_credential=other_credential,
            has_last_response=holding or self.last_response is not None,
            unreplayable=self.unreplayable,
            caller_deadline=context.caller_deadline_ms is not None,
        )

    async def _act(
        self,
        outcome: Outcome,
        response: UpstreamResponse | None,
        name: str | None,
        record: AttemptRecord | None,
    ) -> bool:
        """Carry out the decision for `outcome`; True when the walk is over."""
        other = name is not None and self.cursor.other_credential(name)
        state = self.state(other_credential=other, holding=response is not None)
        decision: Decision = decide(outcome, state)
        if record is not None:
            record.decision, record.reason = decision.action, decision.reason
            if decision.action != "serve":  # a served attempt's, once the relay has ended
                self.walker.telemetry.attempt_decided(self.context, record)
        if decision.rule is not None:
            self.context.rule = decision.rule
        if decision.action != "serve" and name is not None and (outcome.status or 0) >= 400:
            # A pool's 401 moving to another key, a 503 failing over: nothing generated.
            reservation = self.attempts.tokens_to_give_back(name, record)
            if reservation is not None:
                await self.walker.capacity.settle(reservation, 0)
        if decision.action in ("next_candidate", "next_credential"):
            if response is not None:
                if self.last_response is None and name is not None:
                    self.last_response = (name, response, record)  # nothing to close
                else:
                    await self._keep(name, response, record)
            if decision.action == "next_credential":
                self.cursor.same_upstream_again()
            return False
        if decision.action == "serve":
            if response is not None and name is not None:
                if self.last_response is None:
                    self.last_response = (name, response, record)  # nothing to close
                else:
                    await self._keep(name, response, record)
            assert self.last_response is not None
            chosen, kept, served = self.last_response
            self.last_response = None
            if served is not None and served.fault is not None:
                self.context.served_fault = served.fault  # a synthetic answer (`fail`, `revoke`)
            failed = await commit(
                self.send, self.context, chosen, kept,
                max_response_body=self.walker.settings.max_response_body,
                coding=served.coding if served is not None else None,
            )  # fmt: skip
            if failed is not None:
                self._aborted(failed, served)
            if record is not None:  # its decision as it stands now (the relay may change it)
                self.walker.telemetry.attempt_decided(self.context, record)
            if self.attempts.tokens_to_settle(chosen, self.context.status, served) is None:
                self._shadowed()  # nothing to settle (no tpm): no coroutine
            else:
                await self._served(chosen, served)
            return True
        if response is not None:
            await response.aclose()
        if decision.action == "local_error":
            assert decision.error is not None
            headers = []
            if decision.error == "route_exhausted":  # asked only here: no cost when served
                headers = await retry_after(self.context, self.walker.health, self.attempts)
            elif decision.error == "overloaded":  # the host's descriptors free as requests end
                headers = [(b"retry-after", b"1")]
            await send_error(
                self.send, self.context, decision.error, error_message(decision, self.context),
                rule=decision.rule, headers=headers,
            )  # fmt: skip
        return True

    async def _served(self, chosen: str, record: AttemptRecord | None = None) -> None:
        """After the relay of `chosen`'s response ended (the attempt `record`, when known):
        its reported tokens replace the estimate counted against its tpm, and a served
        request is copied to the shadow (`_shadowed`, alone when nothing is settled)."""
        due = self.attempts.tokens_to_settle(chosen, self.context.status, record)
        if due is not None:  # a declared tpm: the estimate counted is settled
            await self.walker.capacity.settle(*due)
        self._shadowed()

    def _shadowed(self) -> None:
        shadow = should_shadow(self.context, self.body, self.walker.settings.canary_salt)
        if shadow is not None:  # the client's response is sent: a copy cannot touch it
            self.walker.shadows.start(shadow, self.context, self.body, self.parsed)

    async def _keep(
        self, name: str | None, response: UpstreamResponse, record: AttemptRecord | None
    ) -> None:
        """Keep the newest response (for `on_exhausted = "last_response"`); close the rest."""
        if self.last_response is not None:
            await self.last_response[1].aclose()
        assert name is not None
        self.last_response = (name, response, record)

    def _aborted(self, outcome: Outcome, record: AttemptRecord | None) -> None:
        """The relay failed after the commit point: the attempt whose response it was says
        how, and `decide` why no failover followed (the rule for the log line, the usage
        record and the trace). Nothing reaches health (`failover.outcome.health_mark`)."""
        decision = decide(outcome, self.state())
        self.context.rule = decision.rule
        if record is not None:
            record.failure_kind = outcome.failure_kind
            record.responsible = outcome.responsible
            record.decision, record.reason = decision.action, decision.reason
            self.walker.telemetry.response_aborted(self.context, record)
