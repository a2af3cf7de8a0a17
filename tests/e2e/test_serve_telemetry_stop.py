"""`fallback-mw serve` exporting OTLP to a collector that accepts connections and never
answers (a hung collector, a firewall that swallows the packets): the gateway starts,
serves and stops promptly; what the exporters still held is dropped, said in one line."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import anyio
import httpx
import pytest

from fallback_mw.cli.otel_setup import TELEMETRY_FLUSH_SECONDS
from tests.e2e.telemetry_serve import serving, silent_collector

pytestmark = pytest.mark.e2e

COLLECTOR_KEY = "collector-key-5e0d81aa"


@pytest.mark.anyio
async def test_serve_stops_promptly_when_the_otlp_collector_never_answers(
    tmp_path: Path,
) -> None:
    """SIGINT left serve flushing for 20 s (the span exporter's 10 s export timeout, then
    the metric exporter's), a second Ctrl-C ignored, nothing said until the SDK's own
    lines: past a supervisor's or Kubernetes' stop grace once requests had taken theirs."""
    with silent_collector() as collector:
        async with serving(
            tmp_path,
            OTEL_EXPORTER_OTLP_ENDPOINT=collector,
            OTEL_EXPORTER_OTLP_HEADERS=f"authorization=Bearer%20{COLLECTOR_KEY}",
        ) as serve:
            async with httpx.AsyncClient(timeout=10) as client:
                for _ in range(3):
                    response = await client.get(serve.chat)
                    assert response.status_code == 200
            started = time.monotonic()
            serve.process.send_signal(signal.SIGINT)
            try:
                status = serve.process.wait(timeout=TELEMETRY_FLUSH_SECONDS + 5)
            except subprocess.TimeoutExpired:
                pytest.fail(f"serve still flushing after SIGINT: {serve.text()[-2000:]}")
            took = time.monotonic() - started
    text = serve.text()
    assert status == 0, text
    assert took < TELEMETRY_FLUSH_SECONDS + 5
    assert text.count("telemetry export did not finish") == 1, text[-2000:]
    assert COLLECTOR_KEY not in text and "Traceback" not in text


@pytest.mark.anyio
async def test_an_otlp_endpoint_query_string_never_reaches_the_log(tmp_path: Path) -> None:
    """A collector key passed in the endpoint's query (`...?api-key=KEY`): every failed
    export's retry line (the SDK's "Transient error ... url: /?api-key=KEY/v1/traces")
    wrote the key to the log, several times a minute while the collector was down."""
    with socket.socket() as closed:  # a port nothing listens on: connection refused
        closed.bind(("127.0.0.1", 0))
        refused = closed.getsockname()[1]
    async with serving(
        tmp_path,
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{refused}/otlp?api-key={COLLECTOR_KEY}",
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_METRIC_EXPORT_INTERVAL="300",
    ) as serve:
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.get(serve.chat)
            assert response.status_code == 200
        deadline = time.monotonic() + 20
        # The log is a file another process writes: polled.
        while "Transient error" not in serve.text():
            if time.monotonic() > deadline:
                break
            await anyio.sleep(0.1)
        serve.process.send_signal(signal.SIGINT)
        serve.process.wait(timeout=TELEMETRY_FLUSH_SECONDS + 5)
    text = serve.text()
    assert "Transient error" in text, text[-2000:]  # the line is still there, without the key
    assert "api-key" not in text and COLLECTOR_KEY not in text, text[-2000:]


@pytest.mark.anyio
async def test_a_second_ctrl_c_during_the_telemetry_flush_stops_serve_at_once(
    tmp_path: Path,
) -> None:
    """The first Ctrl-C stops the gateway and gives the exporters up to 3 s to send what
    they hold; a second one, as uvicorn's own second Ctrl-C does, stops at once: it was
    ignored, and serve went on waiting for a collector that never answers."""
    with silent_collector() as collector:
        async with serving(
            tmp_path,
            OTEL_EXPORTER_OTLP_ENDPOINT=collector,
            OTEL_EXPORTER_OTLP_HEADERS=f"authorization=Bearer%20{COLLECTOR_KEY}",
        ) as serve:
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.get(serve.chat)
                assert response.status_code == 200
            serve.process.send_signal(signal.SIGINT)
            # The line serve writes once the flush has lasted FLUSH_NOTICE_SECONDS. The
            # log is a file another process writes: polled.
            deadline = time.monotonic() + 30
            while "Ctrl-C again" not in serve.text():
                assert serve.process.poll() is None, serve.text()[-2000:]
                assert time.monotonic() < deadline, serve.text()[-2000:]
                await anyio.sleep(0.02)
            started = time.monotonic()
            serve.process.send_signal(signal.SIGINT)
            try:
                status = serve.process.wait(timeout=TELEMETRY_FLUSH_SECONDS + 10)
            except subprocess.TimeoutExpired:
                pytest.fail(f"serve went on after a second Ctrl-C: {serve.text()[-2000:]}")
            took = time.monotonic() - started
    text = serve.text()
    assert took < TELEMETRY_FLUSH_SECONDS / 2, (took, text[-2000:])
    assert status == 0, text[-2000:]
    assert "telemetry export cut short by a second Ctrl-C" in text, text[-2000:]
    assert "did not finish within" not in text, text[-2000:]
    assert "interrupted" not in text and "shutdown can only be called once" not in text, text
    assert COLLECTOR_KEY not in text and "Traceback" not in text, text[-2000:]
