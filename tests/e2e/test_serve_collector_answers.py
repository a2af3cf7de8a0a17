"""`fallback-mw serve` exporting OTLP to a collector that answers badly: a body that never
ends (or a gigabyte of one). What a collector answers an export with is read up to a bound;
the rest is never read, and the gateway's memory does not follow the collector's answer."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
import pytest

from fallback_mw.cli.otel_setup import TELEMETRY_FLUSH_SECONDS
from tests.e2e.telemetry_serve import collector_at, read_request, serving

pytestmark = pytest.mark.e2e

COLLECTOR_KEY = "collector-key-4b1f7e02"
# More than a collector's answer may take and than loopback's socket buffers hold: a
# gateway that is sent this much on one export's connection read it all.
READ_IT_ALL = 128 << 20


@dataclass
class Collector:
    url: str = ""
    exports: int = 0
    # Per export connection: bytes of answer body the gateway took before it closed.
    sent: list[int] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)


@contextmanager
def endless_collector() -> Iterator[Collector]:
    """Answers the first export with 200 and a chunked body that never ends, until the
    gateway closes the connection or READ_IT_ALL is sent."""
    collector = Collector()
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b"\0" * (1 << 20))

    def answer(conn: socket.socket) -> None:
        sent = 0
        try:
            if not read_request(conn):
                return
            collector.exports += 1
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            while sent < READ_IT_ALL:
                conn.sendall(chunk)
                sent += 1 << 20
        finally:
            collector.sent.append(sent)
            collector.ended.set()

    with collector_at(answer) as collector.url:
        yield collector


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc for RSS")
@pytest.mark.anyio
async def test_a_collector_answer_that_never_ends_is_not_read_into_memory(
    tmp_path: Path,
) -> None:
    """The exporter read a collector's whole answer into memory before looking at its
    status: an answer that never ended grew serve's memory by about 100 MiB a second,
    without bound (a gigabyte answer took a gigabyte, twice over), and the export thread
    never came back."""
    with endless_collector() as collector:
        async with serving(
            tmp_path,
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
            OTEL_EXPORTER_OTLP_HEADERS=f"x-api-key={COLLECTOR_KEY}",
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_METRICS_EXPORTER="none",
            OTEL_BSP_SCHEDULE_DELAY="100",
        ) as serve:
            before = rss_mib(serve.process.pid)
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.get(serve.chat)
                assert response.status_code == 200
                # The export's answer, the collector's end of it (the gateway closed the
                # connection, or took READ_IT_ALL), then serve still answers.
                ended = await anyio.to_thread.run_sync(collector.ended.wait, 60)
                assert ended, serve.text()[-2000:]
                grown = rss_mib(serve.process.pid) - before
                response = await client.get(serve.chat)
                assert response.status_code == 200
            serve.process.send_signal(signal.SIGINT)
            status = serve.process.wait(timeout=TELEMETRY_FLUSH_SECONDS + 10)
    text = serve.text()
    assert collector.exports >= 1
    assert collector.sent[0] < READ_IT_ALL, f"serve read {collector.sent[0] >> 20} MiB"
    assert grown < 64, f"serve grew by {grown:.0f} MiB"
    assert status == 0, text[-2000:]
    assert COLLECTOR_KEY not in text and "Traceback" not in text, text[-2000:]


@contextmanager
def answering(answer: bytes) -> Iterator[Collector]:
    """Answers every export with `answer` (a whole HTTP response), connection kept."""
    collector = Collector()

    def answer_all(conn: socket.socket) -> None:
        while read_request(conn):
            collector.exports += 1
            conn.sendall(answer)

    with collector_at(answer_all) as collector.url:
        yield collector


@pytest.mark.anyio
async def test_a_collector_reason_phrase_reaches_the_log_printable_and_short(
    tmp_path: Path,
) -> None:
    """The exporter logs the reason phrase of a refused export ("Failed to export spans
    batch code: 400, reason: ..."), which is the collector's to write: its escape
    sequences reached serve's log as they were (a terminal tailing it cleared, recoloured,
    retitled), a carriage return drew a line of the collector's over the gateway's, and a
    reason of any length was written whole on every export."""
    reason = b"\x1b[2J\x1b]0;owned\x07FORGED\rINFO fallback_mw.request fake line " + b"R" * 6000
    answer = b"HTTP/1.1 400 " + reason + b"\r\ncontent-length: 0\r\n\r\n"
    with answering(answer) as collector:
        async with serving(
            tmp_path,
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_METRICS_EXPORTER="none",
            OTEL_BSP_SCHEDULE_DELAY="100",
        ) as serve:
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.get(serve.chat)
                assert response.status_code == 200
            deadline = anyio.current_time() + 20
            while "Failed to export" not in serve.text():
                assert anyio.current_time() < deadline, serve.text()[-2000:]
                await anyio.sleep(0.1)
            serve.process.send_signal(signal.SIGINT)
            serve.process.wait(timeout=TELEMETRY_FLUSH_SECONDS + 10)
    text = serve.text()
    failed = [line for line in text.splitlines() if "Failed to export" in line]
    assert failed and "FORGED" in failed[0], text[-2000:]  # the line is kept, and says what
    assert "\x1b" not in text and "\x07" not in text and "\r" not in text, failed[0][:300]
    assert max(map(len, failed)) < 1200, max(map(len, failed))


@pytest.mark.anyio
async def test_a_collector_that_redirects_is_said_once_and_not_followed(tmp_path: Path) -> None:
    """An OTLP endpoint that answered every export with a redirect (a collector moved
    behind a load balancer, http:// answered with a 308 to https://, or a hostile one
    pointing at the metadata service): the exporter follows none, and counted each 3xx as
    delivered. All telemetry went nowhere and nothing said so."""
    answer = (
        b"HTTP/1.1 307 Temporary Redirect\r\n"
        b"location: http://169.254.169.254/latest/meta-data/?token=meta-7a1\r\n"
        b"content-length: 0\r\n\r\n"
    )
    with answering(answer) as collector:
        async with serving(
            tmp_path,
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
            OTEL_EXPORTER_OTLP_HEADERS=f"x-api-key={COLLECTOR_KEY}",
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_METRICS_EXPORTER="otlp",
            OTEL_BSP_SCHEDULE_DELAY="100",
            OTEL_METRIC_EXPORT_INTERVAL="300",
        ) as serve:
            async with httpx.AsyncClient(timeout=10) as client:
                for _ in range(3):
                    response = await client.get(serve.chat)
                    assert response.status_code == 200
            deadline = anyio.current_time() + 20
            while collector.exports < 4:
                assert anyio.current_time() < deadline, serve.text()[-2000:]
                await anyio.sleep(0.1)
            serve.process.send_signal(signal.SIGINT)
            serve.process.wait(timeout=TELEMETRY_FLUSH_SECONDS + 10)
    text = serve.text()
    said = [line for line in text.splitlines() if "redirect" in line]
    assert len(said) == 1, text[-3000:]  # once, however many exports it answered so
    assert "307" in said[0] and "not delivered" in said[0], said
    assert "169.254" not in text and "meta-7a1" not in text and COLLECTOR_KEY not in text
