"""The one lifecycle every attempt goes through.

`AttemptLifecycle` is one request's attempts from the gates to the end: `gate` (the
breaker admits it, then capacity reserves room: declared capacity and, for a repeat, the
repeat allowance), `cancel` (through the gates, never started), `start` (the record and
its span), `run` (the upstream request: `failover.send.AttemptRunner`), `finish` (the
record, the span, the health marks) and `lose` (the loser of a hedge race). The walk
loop, the hedge and the shadow copy all go through it; `mark_health` is the one place
`failover.outcome.health_mark` is applied to breakers and credentials.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import anyio

import fallback_mw.health.memory_calls as memory_calls
from fallback_mw.capacity import (
    Ask,
    CapacityState,
    Reservation,
    immediate_capacity,
    reported_tokens,
)
from fallback_mw.config.views import AnyUpstream
from fallback_mw.failover.outcome import Outcome, fails_in_a_race, health_mark
from fallback_mw.failover.send import AttemptResult, AttemptRunner, _derived
from fallback_mw.faults import FaultSource
from fallback_mw.health import Admission, HealthState, ImmediateHealth, immediate_health
from fallback_mw.health.breaker import PROBE_LEASE_MARGIN
from fallback_mw.health.memory import MemoryHealth
from fallback_mw.health.quota import credential_retry_after, spent_quota
from fallback_mw.request.context import AttemptRecord, RequestBody, RequestContext
from fallback_mw.telemetry import Telemetry
from fallback_mw.timers import monotonic
from fallback_mw.upstream.base import UpstreamClient, UpstreamResponse


class AttemptLifecycle:
    """One request's attempts (a per-request helper object; nothing here outlives it)."""

    def __init__(
        self,
        context: RequestContext,
        body: RequestBody,
        parsed: dict[str, Any] | None,
        client: UpstreamClient,
        faults: FaultSource,
        health: HealthState,
        capacity: CapacityState,
        telemetry: Telemetry,
        ask: Callable[[str, AnyUpstream, bool], Ask],
        shadow: bool = False,
        replayable: bool = False,
        rendered: bool = False,
    ) -> None:
        self.context = context
        self.health = health
        self.capacity = capacity
        # The states that answer at the call (memory): no coroutine per call below.
        self._health_now = immediate_health(health)
        # Exactly the memory state (not a subclass, which may override its methods): its
        # per-attempt calls made here compiled (health/memory_calls.py), not through it.
        self._memory = type(health) is MemoryHealth
        self._capacity_now = immediate_capacity(capacity)
        self.telemetry = telemetry
        self.ask = ask
        self.failover_status = context.route.failover_status  # a few codes: a tuple will do
        # Positional: a class called with keywords builds a dict of them for every call
        # (one per request here; docs/performance.md).
        self.runner = AttemptRunner(
            context, body, parsed, client, faults, telemetry.inject_headers, shadow,
            replayable, rendered,
        )  # fmt: skip
        self.reservations: dict[str, Reservation] = {}  # the latest, per upstream
        # The latest breaker admission per upstream (`gate`), then each started attempt's
        # own (`start`, by the record's id): its outcome or release names it, so a
        # half-open breaker heeds only its probe, also when a hedge at the same upstream is
        # the probe and the attempt it races was admitted before the breaker opened.
        self.admissions: dict[str, Admission] = {}
        self._admitted: dict[int, Admission] = {}
        # Each started attempt's own reservation (by the record's id), as its admission: a
        # hedge at the upstream its primary waits on replaces the primary's in
        # `reservations`, and two attempts that both end unsent give back two counts.
        self._reserved: dict[int, Reservation] = {}

    async def gate(self, name: str, upstream: AnyUpstream, repeat: bool) -> Reservation | str:
        """The body, the breaker, then declared capacity (and, for a repeat or a hedge, the
        repeat allowance). Returns the reservation, or the skip reason (`model_rewrite`,
        `breaker_open`, ...); a refusal after the breaker admitted frees the half-open probe
        slot it held."""
        if not self.runner.takes_body(upstream):
            return "model_rewrite"  # never sent without the model it needs
        admission = Admission()
        lease = _derived(upstream)[1]  # upstream_probe_lease, made once per upstream
        if self.runner.body.stream is not None:
            # A streamed body's upload is the caller's time (SPEC §12), bounded by the walk's
            # deadline only: a half-open probe still uploading past the upstream's lease
            # lost its slot, and a second probe went out beside it.
            lease = max(lease, self.context.remaining + PROBE_LEASE_MARGIN)
        health_now = self._health_now
        if self._memory:
            admitted = memory_calls.admit(self.health, name, lease, admission)
        elif health_now is not None:
            admitted = health_now.admit_now(name, lease, admission)
        else:
            admitted = await self.health.admit(name, lease=lease, admission=admission)
        if not admitted:
            return "breaker_open"
        self.admissions[name] = admission
        ask = self.ask(name, upstream, repeat)
        capacity_now = self._capacity_now
        if capacity_now is not None:
            reservation = capacity_now.reserve_now(name, ask)
        else:
            try:
                reservation = await self.capacity.reserve(name, ask)
            except BaseException as exc:
                # Cancelled while the capacity is counted (a Redis round trip): a half-open
                # probe slot this admission took would be held for nobody for its lease.
                with anyio.CancelScope(shield=True):
                    await self.health.release(name, admission)
                raise exc
        if isinstance(reservation, str):
            if health_now is not None:
                health_now.release_now(name, admission)
            else:
                await self.health.release(name, admission)
            return reservation
        self.reservations[name] = reservation
        return reservation

    async def capacity_free_in(self, name: str) -> float | None:
        """Seconds until an attempt at `name` fits its declared `rpm` / `tpm` (a 503's
        Retry-After; None: never)."""
        upstream = self.context.upstreams[name]
        return await self.capacity.free_in(name, self.ask(name, upstream, False))

    async def cancel(self, name: str, reservation: Reservation) -> None:
        """Through the gates but never started (e.g. the deadline passed in the backoff).
        In a task of its own: a caller that leaves during the first round trip (a shared
        state's) must not cut the second, or the count stands for a request never sent (a
        task's own cancel reaches through an anyio shield)."""
        await asyncio.shield(self._give_back(name, reservation))

    async def _give_back(self, name: str, reservation: Reservation) -> None:
        await self.release(name)
        await self.capacity.cancel(reservation)

    def start(
        self,
        name: str,
        upstream: AnyUpstream,
        credential_index: int | None,
        *,
        hedge: bool = False,
    ) -> AttemptRecord:
        context = self.context
        # The first fields positional, the rest set after (a class called with keywords
        # builds a dict of them for every attempt).
        record = AttemptRecord(name, len(context.attempts) + 1, upstream.host, upstream.port)
        record.credential_index, record.hedge = credential_index, hedge
        context.attempts.append(record)
        if name == context.canary_candidate:
            context.canary = True
        admission = self.admissions.get(name)
        if admission is not None:  # the admission `gate` just made for this attempt
            self._admitted[id(record)] = admission
        reservation = self.reservations.get(name)
        if reservation is not None:  # and the reservation it made
            self._reserved[id(record)] = reservation
        self.telemetry.attempt_started(context, record)
        return record

    async def run(self, name: str, upstream: AnyUpstream, record: AttemptRecord) -> AttemptResult:
        # Not a `finally`: a mypyc-compiled coroutine re-raises a stale exception after a
        # `finally` that awaits (scripts/compile.py).
        try:
            result = await self.runner.run(name, upstream, record)
        except BaseException as exc:
            if record.fault is not None or record.queued_only:
                await self._unsent(name, record)
            raise exc
        if record.fault is not None or record.queued_only:
            await self._unsent(name, record)
        return result

    async def _unsent(self, name: str, record: AttemptRecord) -> None:
        """A fault answered the attempt (or the blackhole listener), or it ended waiting
        for a connection under max_connections: nothing reached the upstream, so nothing
        counts against its declared rpm / tpm (a game day or a burst must not leave the
        upstream capacity-skipped for a minute after it). Its own reservation (a shadow
        copy, never started: the latest), popped: each such attempt gives back its count
        once, never another's."""
        reservation = self._reserved.pop(id(record), None)
        if reservation is None:
            reservation = self.reservations.pop(name, None)
        elif self.reservations.get(name) is reservation:
            del self.reservations[name]
        if reservation is not None:
            with anyio.CancelScope(shield=True):
                await self.capacity.release_capacity(reservation)

    def finish(
        self, record: AttemptRecord, outcome: Outcome, response: UpstreamResponse | None
    ) -> Coroutine[Any, Any, bool | None] | None:
        """Finish the attempt's record and telemetry; feed health with upstream outcomes only
        (`decide.health_mark`): a local outcome frees a half-open probe slot and marks
        nothing. The record is finished at the call, the marks too where the health state
        answers there (None returned); else they are the coroutine returned."""
        record.duration = monotonic() - record.started
        record.status = outcome.status
        record.responsible = outcome.responsible
        mark = health_mark(outcome, self.failover_status)
        if mark or outcome.kind != "status" or outcome.fault is not None:
            record.failure_kind = outcome.failure_kind or "status"
        self.telemetry.attempt_finished(self.context, record)
        name, admission = record.candidate, self._admitted.get(id(record))
        now = self._health_now
        if now is not None and outcome.fault is None:  # a fault's outcome asks after it
            admission = admission or self.admissions.get(name)
            self._marked_now(now, name, record.credential_index, outcome, response,
                             record.duration, admission, mark)  # fmt: skip
            return None
        return self.mark_health(
            name, record.credential_index, outcome, response, latency=record.duration,
            admission=admission,
        )  # fmt: skip

    async def mark_health(
        self,
        name: str,
        credential_index: int | None,
        outcome: Outcome,
        response: UpstreamResponse | None,
        *,
        latency: float | None = None,
        admission: Admission | None = None,
    ) -> bool | None:
        """The one place an outcome reaches the breaker and the credential's health (with
        `_marked_now`). Returns the mark (True a failure, False a success, None nothing
        recorded). `admission`: the attempt's (default: the latest at `name`)."""
        admission = admission or self.admissions.get(name)
        mark = health_mark(outcome, self.failover_status)
        # The fault ended (cleared, expired) while this attempt hung on it: the revert has
        # reset the breaker, and a late outcome of the fault must not open it again with no
        # fault left to reset it (it outlived the fault by a whole cooldown). Booked as
        # nothing, like a local outcome.
        if (
            mark is not None
            and outcome.fault is not None
            and await self.runner.faults.upstream_fault(name) is None
        ):
            mark = None
        now = self._health_now
        if now is not None:
            self._marked_now(now, name, credential_index, outcome, response, latency,
                             admission, mark)  # fmt: skip
        elif mark is None:
            await self.health.release(name, admission)
        else:
            await self.health.record(name, failure=mark, fault=outcome.fault, admission=admission)
            if credential_index is not None:
                await self.health.credential_result(
                    name, credential_index, status=outcome.status, failure=mark,
                    retry_after=credential_retry_after(response), session=self.context.session,
                    latency=latency,
                    quota=spent_quota(response, self.context.upstreams[name].quota_retire_ms),
                )  # fmt: skip
        if mark is not None and credential_index is not None and outcome.fault is not None:
            await self.health.fault_marked(name, credential_index, outcome.fault)  # its revert
        return mark

    def _marked_now(
        self, now: ImmediateHealth, name: str, credential_index: int | None, outcome: Outcome,
        response: UpstreamResponse | None, latency: float | None, admission: Admission | None,
        mark: bool | None,
    ) -> None:  # fmt: skip
        """`mark_health`'s marks, by a health state that answers at the call (no coroutine)."""
        if mark is None:
            now.release_now(name, admission)
            return
        if self._memory:
            memory_calls.record(now, name, mark, outcome.fault, admission)
            pooled = memory_calls.pooled(now, name)
        else:
            now.record_now(name, mark, outcome.fault, admission)
            pooled = now.pooled(name)
        if credential_index is not None and pooled:
            retire_ms = self.context.upstreams[name].quota_retire_ms
            now.credential_result_now(
                name, credential_index, outcome.status, mark, credential_retry_after(response),
                self.context.session, latency, spent_quota(response, retire_ms),
            )  # fmt: skip

    async def lose(
        self, record: AttemptRecord, result: AttemptResult | None
    ) -> UpstreamResponse | None:
        """The attempt that lost a hedge race: cancelled (None) or with a head it does not
        need, it proved nothing about the upstream (an error head, a 400, still gives its
        tpm estimate back: it generated nothing); a real failure before the winner's head
        is finished like any attempt. A failover-class answer (a 503), or a pool
        credential's own refusal (a 401 retires that key), is returned open: it is an
        upstream answer the walk keeps, as any failed attempt's, for
        `on_exhausted = "last_response"` (the caller keeps or closes it)."""
        pooled = len(self.context.upstreams[record.candidate].credential_envs) > 1
        if result is not None and (
            result[1] is None or fails_in_a_race(result[0], self.failover_status, pooled=pooled)
        ):
            # It failed (before the winner's head, or beside it): booked like any attempt.
            try:
                marks = self.finish(record, result[0], result[1])
                if marks is not None:
                    await marks
                if (result[0].status or 0) >= 400:
                    # An error answer that lost the race generated nothing: its estimate
                    # leaves the upstream's tpm, as one the walk moves past does (`_act`).
                    unused = self.tokens_to_give_back(record.candidate, record)
                    if unused is not None:
                        await self.capacity.settle(unused, 0)
            except BaseException as exc:
                # Cut while booked (a shared state's round trip, the caller gone): nobody
                # will keep or close the answer, and its connection would stay taken.
                if result[1] is not None:
                    await result[1].aclose()
                raise exc
            return result[1]
        if result is not None:
            assert result[1] is not None
            record.status = result[1].status
            await result[1].aclose()
            if record.status >= 400:  # an error head beside the winner's (a 400): as above
                unused = self.tokens_to_give_back(record.candidate, record)
                if unused is not None:
                    with anyio.CancelScope(shield=True):
                        await self.capacity.settle(unused, 0)
        record.duration = monotonic() - record.started
        record.failure_kind = "cancelled"
        record.decision, record.reason = "abort", "lost the hedge race"
        self.telemetry.attempt_finished(self.context, record)
        await self.release(record.candidate, record)
        return None

    async def release(self, name: str, record: AttemptRecord | None = None) -> None:
        """The attempt at `name` (`record`, once started) ended for a local reason: the probe
        slot it held (if it was the half-open probe) is freed, nothing recorded."""
        admission = self._admitted.get(id(record)) if record is not None else None
        await self.health.release(name, admission or self.admissions.get(name))

    def tokens_to_give_back(
        self, name: str, record: AttemptRecord | None = None
    ) -> Reservation | None:
        """An error answer (400 and up) the walk moves past or ends on, unread: it generated
        nothing, so its estimate leaves the upstream's `tpm` (the request stays in `rpm`):
        the reservation to settle at 0 (the attempt `record`'s own, when known), None when
        it has no estimate (no declared tpm). Popped from both places a settlement looks:
        the answer kept for `last_response` is not settled again when served (it was, at 0
        once more, and the minute's count went below zero). Not a coroutine: most upstreams
        declare no tpm, and the caller awaits only a settle."""
        if record is None:
            reservation = self.reservations.pop(name, None)
        else:  # none left: given back already (it reached no upstream), never another's
            reservation = self._reserved.pop(id(record), None)
            if reservation is not None and self.reservations.get(name) is reservation:
                del self.reservations[name]
        return reservation if reservation is not None and reservation.counted else None

    async def settle_tokens(
        self, name: str, status: int | None, record: AttemptRecord | None = None
    ) -> None:
        """The usage the upstream reported (metered as the response went to the client)
        replaces the estimate counted against its `tpm`: the estimate of the attempt that
        answered (`record`, when known; else the latest at `name`). An error answer
        (`status` 400 and up) that reports none generated nothing: its estimate is given
        back, or a caller asking for an output limit the upstream refuses held the
        minute's tpm from everyone."""
        due = self.tokens_to_settle(name, status, record)
        if due is not None:
            await self.capacity.settle(*due)

    def tokens_to_settle(
        self, name: str, status: int | None, record: AttemptRecord | None = None
    ) -> tuple[Reservation, int] | None:
        """What `settle_tokens` settles (the reservation and its tokens), None when nothing:
        asked without a coroutine, as a request with no declared tpm has nothing to settle."""
        if record is not None:  # none left: given back already (it reached no upstream)
            reservation = self._reserved.get(id(record))
        else:
            reservation = self.reservations.get(name)
        if reservation is None or not reservation.counted:
            return None
        tokens = reported_tokens(self.context.usage)
        if tokens is None and (status or 0) >= 400:
            tokens = 0
        return None if tokens is None else (reservation, tokens)
