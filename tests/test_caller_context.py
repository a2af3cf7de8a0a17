"""The caller's trace context read without the propagators when the headers hold none of
their fields (telemetry/propagation.py `_caller_context`): what they would have read."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import baggage, propagate
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from fallback_mw.telemetry import Telemetry
from fallback_mw.telemetry.propagation import extract

HEADERS = [(b"content-type", b"application/json"), (b"authorization", b"Bearer k")]


@pytest.fixture
def telemetry() -> Telemetry:
    return Telemetry(tracer_provider=TracerProvider(), meter_provider=MeterProvider())


@pytest.fixture
def with_baggage() -> Iterator[None]:
    token = otel_context.attach(baggage.set_baggage("team", "blue"))
    try:
        yield
    finally:
        otel_context.detach(token)


@pytest.fixture
def baggage_first() -> Iterator[None]:
    before = propagate.get_global_textmap()
    propagate.set_global_textmap(
        CompositePropagator([W3CBaggagePropagator(), TraceContextTextMapPropagator()])
    )
    try:
        yield
    finally:
        propagate.set_global_textmap(before)


def test_no_field_reads_what_the_default_propagators_read(
    telemetry: Telemetry, with_baggage: None
) -> None:
    read = telemetry._caller_context(HEADERS, None)
    assert read == extract(HEADERS) == otel_context.Context()


def test_baggage_first_runs_the_propagators(
    telemetry: Telemetry, with_baggage: None, baggage_first: None
) -> None:
    # The baggage propagator starts from the current context: its baggage is read.
    read = telemetry._caller_context(HEADERS, None)
    assert read == extract(HEADERS)
    assert baggage.get_all(read) == {"team": "blue"}


def test_a_field_in_any_case_runs_the_propagators(telemetry: Telemetry) -> None:
    headers = [*HEADERS, (b"Baggage", b"team=red")]
    read = telemetry._caller_context(headers, None)
    assert baggage.get_all(read) == {"team": "red"}
