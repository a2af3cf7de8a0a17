"""telemetry/propagation.py reads the current context, its span and the global propagator
without the API's interpreted calls (`current_context`, `current_span`, `global_textmap`):
each must give what the API gives, and fall back to the API where its names are not where
they were read (another runtime context, another key)."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from fallback_mw.telemetry.propagation import current_context, current_span, global_textmap

SPAN = trace.NonRecordingSpan(
    trace.SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=trace.TraceFlags(1))
)


def test_the_current_context_is_the_apis() -> None:
    assert current_context() is otel_context.get_current()
    token = otel_context.attach(trace.set_span_in_context(SPAN))
    try:
        assert current_context() is otel_context.get_current()
        assert current_span(current_context()) is SPAN is trace.get_current_span()
    finally:
        otel_context.detach(token)
    assert current_span(current_context()) is trace.INVALID_SPAN is trace.get_current_span()


@pytest.mark.parametrize(
    "context",
    [
        otel_context.Context(),
        trace.set_span_in_context(SPAN),
        otel_context.set_value("unrelated", 1),
    ],
)
def test_the_span_of_a_context_is_the_apis(context: otel_context.Context) -> None:
    assert current_span(context) is trace.get_current_span(context)


def test_a_value_under_the_span_key_that_is_no_span_is_the_invalid_span() -> None:
    from opentelemetry.trace.propagation import _SPAN_KEY

    context = otel_context.set_value(_SPAN_KEY, "not a span", otel_context.Context())
    assert current_span(context) is trace.INVALID_SPAN is trace.get_current_span(context)


def test_another_runtime_context_is_asked_through_the_api(monkeypatch: Any) -> None:
    class Elsewhere(ContextVarsRuntimeContext):  # another runtime: not read directly
        def get_current(self) -> otel_context.Context:
            return otel_context.Context({"from": "elsewhere"})

    monkeypatch.setattr(otel_context, "_RUNTIME_CONTEXT", Elsewhere())
    assert current_context() == {"from": "elsewhere"}


def test_the_global_propagator_is_the_apis(monkeypatch: Any) -> None:
    assert global_textmap() is propagate.get_global_textmap()
    mine = CompositePropagator([TraceContextTextMapPropagator()])
    monkeypatch.setattr(propagate, "_HTTP_TEXT_FORMAT", mine)
    assert global_textmap() is mine is propagate.get_global_textmap()
    monkeypatch.delattr(propagate, "_HTTP_TEXT_FORMAT")
    monkeypatch.setattr(propagate, "get_global_textmap", lambda: mine)
    assert global_textmap() is mine
