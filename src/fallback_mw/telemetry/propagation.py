"""Trace context in and out: the caller's W3C context read (less any trace state or
baggage entry that carries a credential of the request), and the attempt span's context
propagated upstream in place of the caller's. Telemetry (telemetry/core.py) carries the
hooks; without an SDK and without a caller's context nothing is read or written."""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Sequence
from typing import Final

from opentelemetry import baggage as otel_baggage
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from fallback_mw.python_class import python_class
from fallback_mw.request.secrets import RequestSecrets
from fallback_mw.security.fields import name_forms
from fallback_mw.telemetry.redact import EXTRACTING, GETTER
from fallback_mw.telemetry.spans import AttemptTrace

try:
    from opentelemetry import propagate
except ValueError as refused:
    # OTEL_PROPAGATORS names a propagator that is not installed or is misspelled (`b3`
    # without its package, `bagage`): the API refuses at import. Importing fallback_mw (and
    # every `fallback-mw` command) must not die on it in a traceback; a gateway refuses to
    # start with one line saying so (Telemetry, telemetry/core.py).
    PROPAGATORS_REFUSED: str | None = (
        f"OTEL_PROPAGATORS: {refused} Install the package that provides it (b3: "
        "opentelemetry-propagator-b3, jaeger: opentelemetry-propagator-jaeger) or fix the "
        "name; tracecontext,baggage is the default"
    )
else:
    PROPAGATORS_REFUSED = None

_internal: Final = logging.getLogger("fallback_mw.telemetry")

# The attempt span in flight in this task, so `inject_headers` (called with the attempt's
# header list only) can propagate its context. Set in attempt_started, cleared after.
current_attempt: Final[contextvars.ContextVar[AttemptTrace | None]] = contextvars.ContextVar(
    "fallback_mw_current_attempt", default=None
)


# The global propagator, its field names as str and as header bytes, whether it is made of
# the W3C propagators only, and whether (W3C only, the trace context's first) it reads an
# empty context from headers holding none of its fields.
_Propagation = tuple[TextMapPropagator, frozenset[str], frozenset[bytes], bool, bool]
_W3C_PROPAGATORS: Final = (TraceContextTextMapPropagator, W3CBaggagePropagator)


def extract(headers: Sequence[tuple[bytes, bytes]]) -> otel_context.Context:
    """The caller's trace context, read by the global propagator."""
    return propagate.extract(headers, getter=GETTER)


@python_class  # Telemetry's base: a Python class under mypyc, as Telemetry
class TracePropagation:
    """Telemetry's propagation: the global propagator's fields, cached per propagator."""

    _global_tracer: bool
    _propagation: _Propagation | None

    def inject_headers(self, headers: list[tuple[str, str]]) -> None:
        """Propagate the attempt span's context upstream: the caller's own `traceparent`
        (and `tracestate`, `baggage`) are replaced, never duplicated. Without an SDK the
        caller's context passes through unchanged."""
        try:
            entry = current_attempt.get()
            propagator, fields, _, quiet, _ = self._propagation_fields()
            if entry is None and quiet and not otel_context.get_current():
                return  # no span, no baggage: W3C propagators would write nothing
            ctx = entry.context if entry is not None else None
            carrier: dict[str, str] = {}
            propagator.inject(carrier, context=ctx)
            if not carrier and entry is None:
                return  # no trace context of ours at all: leave the caller's untouched
            headers[:] = [(k, v) for k, v in headers if k.lower() not in fields]
            headers.extend(carrier.items())
        except Exception:
            _internal.debug("inject_headers failed", exc_info=False)

    def _propagation_fields(self) -> _Propagation:
        """The global propagator, its field names (as str and header bytes) and whether
        it is made of the W3C propagators only (which inject nothing from an empty
        context), computed again only when another propagator is installed."""
        propagator = propagate.get_global_textmap()
        cached = self._propagation
        if cached is None or cached[0] is not propagator:
            names = frozenset(f.lower() for f in propagator.fields)
            parts = (
                getattr(propagator, "_propagators", None)
                if type(propagator) is CompositePropagator
                else (propagator,)
            )
            quiet = parts is not None and all(type(p) in _W3C_PROPAGATORS for p in parts)
            # The trace context's propagator starts from an empty context when given none
            # (the baggage one from the current context): with it first, nothing read
            # leaves an empty context.
            blank = (
                quiet
                and parts is not None
                and len(parts) > 0
                and type(parts[0]) is TraceContextTextMapPropagator
            )
            fields = frozenset(n.encode("latin-1") for n in names)
            cached = (propagator, names, fields, quiet, blank)
            self._propagation = cached
        return cached

    def _nothing_to_trace(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        """No SDK behind the global tracer and no trace context from the caller: a span
        would record nothing and propagate nothing (the caller's headers pass unchanged
        either way), so the request skips span bookkeeping altogether."""
        if not self._global_tracer or not _tracing_off():
            return False
        return not _carries(headers, self._propagation_fields()[2])

    def _caller_context(
        self, headers: Sequence[tuple[bytes, bytes]], secrets: RequestSecrets | None
    ) -> otel_context.Context:
        """The caller's trace context, read by the global propagator, `without_secrets`.
        From headers holding none of its fields, W3C propagators with the trace context's
        first read an empty context (no trace state, no baggage): made here without
        running them (their reads of each field cost some 15,000 instructions a request)."""
        _, _, fields, _, blank = self._propagation_fields()
        if blank and not _carries(headers, fields):
            return otel_context.Context()
        token = EXTRACTING.set(True)
        try:
            incoming = extract(headers)
        finally:
            EXTRACTING.reset(token)
        return without_secrets(incoming, secrets)


def _carries(headers: Sequence[tuple[bytes, bytes]], fields: frozenset[bytes]) -> bool:
    """Whether a header is one of the propagator's `fields` (lower-case), in any case:
    ASGI lets a host pass names as they came, and the propagators read them so (a
    `Traceparent` skipped here sent its `Tracestate` upstream uncleaned). A loop, not
    `any()` over a generator (about 2,000 instructions): every request."""
    for name, _ in headers:  # noqa: SIM110
        if name_forms(name)[0] in fields:
            return True
    return False


_MISSING: Final = object()


def _tracing_off() -> bool:
    """The global tracer provider is the API's proxy (no SDK installed) or a no-op one."""
    provider = getattr(trace, "_TRACER_PROVIDER", _MISSING)
    if provider is None:  # unset: the proxy (checked without `get_tracer_provider()`'s
        return True  # environment lookup per call; the API sets it once, never unsets it)
    if provider is _MISSING:  # an API without the global: ask it
        provider = trace.get_tracer_provider()
    return isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def without_secrets(
    incoming: otel_context.Context, secrets: RequestSecrets | None
) -> otel_context.Context:
    """What the spans carry and the attempts propagate upstream (the caller's context, or
    the host's extraction of it): no trace state or baggage entry holding a credential."""
    return without_secret_baggage(without_secret_trace_state(incoming, secrets), secrets)


def without_secret_trace_state(
    incoming: otel_context.Context, secrets: RequestSecrets | None
) -> otel_context.Context:
    """The caller's context less any `tracestate` entry that carries a credential of the
    request: every span of the trace inherits the parent's trace state, and exporters write
    it out with each span (OTLP `trace_state`), so a caller could otherwise get its own
    token or a provider key recorded through a header value. The other entries stay and
    propagate upstream as W3C asks."""
    if secrets is None:
        return incoming
    parent = trace.get_current_span(incoming).get_span_context()
    state = parent.trace_state
    if not parent.is_valid or not state:
        return incoming
    kept = [
        (key, value)
        for key, value in state.items()
        if not secrets.carried_by(key) and not secrets.carried_by(value)
    ]
    if len(kept) == len(state):
        return incoming
    cleaned = trace.SpanContext(
        parent.trace_id,
        parent.span_id,
        is_remote=parent.is_remote,
        trace_flags=parent.trace_flags,
        trace_state=trace.TraceState(kept),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(cleaned), incoming)


def without_secret_baggage(
    incoming: otel_context.Context, secrets: RequestSecrets | None
) -> otel_context.Context:
    """The caller's context less any baggage entry whose name or value carries a credential
    of the request: the attempts propagate the caller's baggage upstream (W3C `baggage`),
    so a `session.id` a page's instrumentation set to its session cookie, or a token,
    reached the provider beside the stripped `cookie` / `authorization`."""
    if secrets is None:
        return incoming
    entries = otel_baggage.get_all(incoming)
    for name, value in entries.items():
        if secrets.carried_by(name) or secrets.carried_by(str(value)):
            incoming = otel_baggage.remove_baggage(name, incoming)
    return incoming
