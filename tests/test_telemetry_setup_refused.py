"""`otel_setup`: a setup refused part-way leaves nothing of itself running in the process.

A metric reader is made (its export thread started), a tracer provider (its batch thread)
or the Prometheus `/metrics` server before a later setting is refused: the refusal must
stop them. A periodic reader that no meter provider took kept ticking for the life of
the process, logging "Cannot call collect on a MetricReader until it is registered on a
MeterProvider" at every export interval (a host that caught the error and went on, or the
next test of a pytest worker, got that WARNING in its log)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from typing import Any

import pytest

from fallback_mw.cli.otel_setup import TelemetrySetupError, configure_opentelemetry
from tests.upstreams import free_port

NOT_REGISTERED = "Cannot call collect on a MetricReader"
FAST = {"OTEL_METRIC_EXPORT_INTERVAL": "50"}  # a leaked reader ticks 20 times a second
OTLP_TRACES = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}


@pytest.fixture
def clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)

    def set_env(**values: str) -> None:
        for key, value in values.items():
            monkeypatch.setenv(key, value)

    return set_env


def otel_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("Otel")}


@pytest.mark.parametrize(
    "variables",
    [
        # The meter provider refuses the exemplar filter after the console reader started,
        # and after the tracer provider (its OTLP batch thread) was made.
        {"OTEL_METRICS_EXPORTER": "console", "OTEL_METRICS_EXEMPLAR_FILTER": "bogus",
         **OTLP_TRACES},
        # The second metric exporter is refused after the first one's reader started.
        {"OTEL_METRICS_EXPORTER": "console,otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
    ],
    ids=["meter-provider-refused", "second-reader-refused"],
)  # fmt: skip
def test_a_refused_setup_leaves_no_reader_ticking_and_no_thread(
    clean_otel_env: Any, caplog: pytest.LogCaptureFixture, variables: dict[str, str]
) -> None:
    clean_otel_env(**FAST, **variables)
    caplog.set_level(logging.WARNING)
    before = otel_threads()
    with pytest.raises(TelemetrySetupError):
        configure_opentelemetry(set_global=False)
    time.sleep(0.5)  # ten export intervals of a reader left running
    assert otel_threads() - before == set()
    # The refusal is the one error: no line of the SDK's beside it, at the time or later.
    assert [r.getMessage() for r in caplog.records] == []


@pytest.mark.parametrize(
    "refused",
    [{"OTEL_METRICS_EXEMPLAR_FILTER": "bogus"}, {"OTEL_METRIC_EXPORT_INTERVAL": "-5"}],
    ids=["meter-provider-refused", "periodic-reader-refused"],
)
def test_a_refused_setup_stops_the_metrics_server_it_started(
    clean_otel_env: Any, refused: dict[str, str]
) -> None:
    # /metrics was served, then the console reader's interval (or the meter provider's
    # exemplar filter) was refused: the port was left held by a server nothing would
    # ever stop.
    port = free_port()
    clean_otel_env(
        OTEL_METRICS_EXPORTER="prometheus,console",
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
        OTEL_EXPORTER_PROMETHEUS_PORT=str(port),
        **refused,
    )
    with pytest.raises(TelemetrySetupError, match=next(iter(refused))[:18]):
        configure_opentelemetry(set_global=False)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    with socket.socket() as again:  # the port is free for the next try
        again.bind(("127.0.0.1", port))


def test_a_refused_setup_installs_no_global_provider(tmp_path: Any) -> None:
    # serve's setup (set_global) with traces built and metrics refused: the process's
    # tracer provider was the half-made one, stopped; a host that caught the error and
    # set up its own could not (the global is set once).
    script = textwrap.dedent("""
        import os
        from opentelemetry import metrics, trace
        from fallback_mw.cli.otel_setup import TelemetrySetupError, configure_opentelemetry
        try:
            configure_opentelemetry()
        except TelemetrySetupError:
            pass
        for provider in (trace.get_tracer_provider(), metrics.get_meter_provider()):
            print(type(provider).__module__.startswith("opentelemetry.sdk"))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_TRACES_EXPORTER="console", OTEL_METRICS_EXPORTER="console",
               OTEL_METRICS_EXEMPLAR_FILTER="bogus")  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]  # the API's proxies: nothing set
    assert result.stderr == ""
