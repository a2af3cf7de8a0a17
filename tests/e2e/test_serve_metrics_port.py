"""`fallback-mw serve`'s `/metrics` port (OTEL_METRICS_EXPORTER=prometheus) under hostile
clients: idle connections by the hundred, a client that resets part-way. The port holds a
bounded number of connections for a bounded time; the gateway's own port is unaffected,
a scrape still answers, and nothing lands in the log."""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from fallback_mw.cli.metrics_server import CONNECTION_SECONDS, CONNECTIONS, RENDER_GAP
from fallback_mw.cli.otel_setup import TELEMETRY_FLUSH_SECONDS
from tests.e2e.telemetry_serve import Served, serving
from tests.helpers import free_port, wait_listening

pytestmark = pytest.mark.e2e

IDLE = 120


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


@asynccontextmanager
async def serving_metrics(tmp_path: Path, metrics_port: int) -> AsyncIterator[Served]:
    """serve exporting no traces and its metrics on a /metrics port of its own, `metrics_port`,
    both ports listening."""
    async with serving(
        tmp_path,
        OTEL_TRACES_EXPORTER="none",
        OTEL_METRICS_EXPORTER="prometheus",
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
        OTEL_EXPORTER_PROMETHEUS_PORT=str(metrics_port),
    ) as serve:
        await wait_listening(serve.process, metrics_port, serve.log)
        yield serve


def closed(sock: socket.socket) -> bool:
    """Whether the other end closed (or reset) `sock`; it sent nothing else."""
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
@pytest.mark.anyio
async def test_idle_connections_to_the_metrics_port_are_bounded(tmp_path: Path) -> None:
    """Each connection to /metrics held a thread and a file descriptor of serve's process
    for as long as the client kept it open, without limit: a few hundred idle ones under
    `ulimit -n 256` (a thousand under the usual 1024) left none for the gateway, whose
    port then accepted nothing, and no line said why; a client that reset its connection
    mid-head wrote a 25-line traceback to the log."""
    metrics_port = free_port()
    async with serving_metrics(tmp_path, metrics_port) as serve:
        threads = threads_of(serve.process.pid)

        # A head cut by a reset, then IDLE connections that send nothing.
        with socket.create_connection(("127.0.0.1", metrics_port)) as reset:
            reset.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            await anyio.sleep(0.3)
            reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

        def connect(_: int) -> socket.socket:
            return socket.create_connection(("127.0.0.1", metrics_port), timeout=30)

        opened = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            idle = await anyio.to_thread.run_sync(lambda: list(pool.map(connect, range(IDLE))))
        try:
            for sock in idle:
                sock.setblocking(False)
            deadline = time.monotonic() + 20
            while sum(map(closed, idle)) < IDLE - CONNECTIONS - 4:
                assert time.monotonic() < deadline, (
                    f"{sum(map(closed, idle))} of {IDLE} idle connections closed; serve "
                    f"holds {threads_of(serve.process.pid)} threads (at start {threads})"
                )
                await anyio.sleep(0.2)
            assert threads_of(serve.process.pid) <= threads + CONNECTIONS + 4
            async with httpx.AsyncClient(timeout=10) as client:
                # The gateway answers while they are held ...
                response = await client.get(serve.chat)
                assert response.status_code == 200
                # ... and, once those held are past their time, so does /metrics.
                await anyio.sleep(max(0.0, opened + CONNECTION_SECONDS - time.monotonic()))
                deadline = time.monotonic() + 10
                while True:
                    try:
                        scrape = await client.get(f"http://127.0.0.1:{metrics_port}/metrics")
                        break
                    except httpx.TransportError:
                        assert time.monotonic() < deadline, serve.text()[-2000:]
                        await anyio.sleep(0.2)
                assert scrape.status_code == 200
                assert "gateway_requests_total" in scrape.text
        finally:
            for sock in idle:
                sock.close()
        serve.process.send_signal(signal.SIGINT)
        status = serve.process.wait(timeout=TELEMETRY_FLUSH_SECONDS + 10)
    text = serve.text()
    assert status == 0, text[-2000:]
    assert "Traceback" not in text and "Exception occurred" not in text, text[-3000:]


@pytest.mark.anyio
async def test_scrapes_in_a_loop_are_paced(tmp_path: Path) -> None:
    """Each scrape makes the metrics text in serve's process, under its interpreter lock
    (about 3 ms here, more with a large route table): four clients scraping in a loop had
    it made 255 times a second, and the gateway's median latency went from 2 to 9 ms,
    its p99 from 10 to 47 ms. Made once every RENDER_GAP at most, it is bounded."""
    metrics_port = free_port()
    seconds = 3.0
    async with serving_metrics(tmp_path, metrics_port) as serve:
        scraped: list[int] = []
        lock = threading.Lock()

        def scrape_in_a_loop() -> None:
            end = time.monotonic() + seconds
            with httpx.Client(timeout=10) as client:
                while time.monotonic() < end:
                    answer = client.get(f"http://127.0.0.1:{metrics_port}/metrics")
                    assert answer.status_code == 200
                    with lock:
                        scraped.append(1)

        scrapers = [threading.Thread(target=scrape_in_a_loop) for _ in range(4)]
        for scraper in scrapers:
            scraper.start()
        for scraper in scrapers:
            await anyio.to_thread.run_sync(scraper.join)
        serve.process.send_signal(signal.SIGINT)
        serve.process.wait(timeout=TELEMETRY_FLUSH_SECONDS + 10)
    # Those started within the time, and one each that began as it ended.
    assert 1 <= len(scraped) <= seconds / RENDER_GAP + 1 + 4, len(scraped)


@pytest.mark.anyio
async def test_a_scrape_gets_through_while_idle_clients_hold_every_connection(
    tmp_path: Path,
) -> None:
    """CONNECTIONS clients that connect and send nothing (a port scanner, a stuck load
    balancer check) held every connection /metrics serves: each scrape after them was
    closed at once, unanswered, until they were CONNECTION_SECONDS old, and Prometheus saw
    the target down (`up` 0) for as long as they came back. A connection that has not sent
    its request head now gives way to a new one, the oldest first: a scrape, which sends
    its head at once, is answered."""
    metrics_port = free_port()
    async with serving_metrics(tmp_path, metrics_port) as serve:
        process = serve.process
        # Accepted in the order they connected: every one of these before the scrape.
        opened = time.monotonic()
        idle = [
            socket.create_connection(("127.0.0.1", metrics_port), timeout=30)
            for _ in range(CONNECTIONS)
        ]
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                for _ in range(3):
                    scrape = await client.get(f"http://127.0.0.1:{metrics_port}/metrics")
                    assert scrape.status_code == 200
                    assert "gateway_" in scrape.text
            # The oldest gave way; the newest, younger than CONNECTION_SECONDS, did not.
            assert idle[0].recv(1) == b""
            idle[-1].setblocking(False)
            if time.monotonic() - opened < CONNECTION_SECONDS - 1:
                assert not closed(idle[-1])
        finally:
            for sock in idle:
                sock.close()
        process.send_signal(signal.SIGINT)
        status = process.wait(timeout=TELEMETRY_FLUSH_SECONDS + 10)
    text = serve.text()
    assert status == 0, text[-2000:]
    assert "Traceback" not in text, text[-3000:]


def _answer(port: int, head: bytes) -> bytes:
    """All that the port answers `head` with, up to its close (one request a connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.anyio
async def test_head_of_metrics_answers_its_headers_without_a_body(tmp_path: Path) -> None:
    """Health checkers and load balancers that check with HEAD got 405 Method Not Allowed
    (only GET and OPTIONS were served) and counted the gateway's metrics target down. HEAD
    is answered as GET is, 200 with the same headers, and no body (RFC 9110, 9.3.2)."""
    metrics_port = free_port()
    async with serving_metrics(tmp_path, metrics_port) as serve:
        process = serve.process
        request = b" /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        before = await anyio.to_thread.run_sync(_answer, metrics_port, b"GET" + request)
        head = await anyio.to_thread.run_sync(_answer, metrics_port, b"HEAD" + request)
        get = await anyio.to_thread.run_sync(_answer, metrics_port, b"GET" + request)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=TELEMETRY_FLUSH_SECONDS + 10)
    head_lines, _, head_body = head.partition(b"\r\n\r\n")
    get_lines, _, get_body = get.partition(b"\r\n\r\n")
    assert head_lines.split(b"\r\n")[0].endswith(b" 200 OK"), head
    assert head_body == b"", head
    # The headers GET answers.
    fields = {line.split(b":")[0].lower() for line in head_lines.split(b"\r\n")[1:]}
    assert fields == {line.split(b":")[0].lower() for line in get_lines.split(b"\r\n")[1:]}
    assert b"content-length" in fields and b"content-type" in fields, head
    assert get_lines.split(b"\r\n")[0].endswith(b" 200 OK") and b"# HELP" in get_body
    # Content-Length the size of the body GET answers (RFC 9110, 8.6: never another
    # number; it was 0). No request came between the GETs: the counts, and so the text,
    # are the same for the three (either GET's would do if one had come).
    (length,) = [
        line.split(b":")[1].strip()
        for line in head_lines.split(b"\r\n")[1:]
        if line.lower().startswith(b"content-length:")
    ]
    bodies = {len(get_body), len(before.partition(b"\r\n\r\n")[2])}
    assert int(length) in bodies, (length, bodies)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
@pytest.mark.anyio
async def test_a_connection_cut_to_make_room_is_not_served(tmp_path: Path) -> None:
    """Clients that send a head and never end it (a slowloris) are cut to make room for a
    newcomer, and a cut connection's head ends where its input does: each was then served
    as a scrape for nobody, outside the CONNECTIONS bound, its thread and socket held in
    the RENDER_GAP queue. 150 such clients sent in a burst held 150 threads of serve's
    process for 15 s, growing for as long as they came faster than 10 a second, and a real
    scrape waited behind them all. A connection cut before its head was read is closed
    unserved: serve's threads stay within the bound and the scrape is answered."""
    metrics_port = free_port()
    slow = 150
    async with serving_metrics(tmp_path, metrics_port) as serve:
        process = serve.process
        threads = threads_of(process.pid)

        def connect(_: int) -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", metrics_port), timeout=30)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the head goes on
            return sock

        held = [await anyio.to_thread.run_sync(connect, n) for n in range(slow)]
        try:
            deadline = time.monotonic() + 5
            while threads_of(process.pid) > threads + CONNECTIONS + 4:
                assert time.monotonic() < deadline, (
                    f"serve holds {threads_of(process.pid)} threads after {slow} slow heads "
                    f"(at start {threads}, at most {CONNECTIONS} connections served)"
                )
                await anyio.sleep(0.1)
            asked = time.monotonic()
            async with httpx.AsyncClient(timeout=30) as client:
                scrape = await client.get(f"http://127.0.0.1:{metrics_port}/metrics")
            assert scrape.status_code == 200 and "gateway_" in scrape.text
            assert time.monotonic() - asked < 5, "the scrape waited behind those cut"
        finally:
            for sock in held:
                sock.close()
        process.send_signal(signal.SIGINT)
        status = process.wait(timeout=TELEMETRY_FLUSH_SECONDS + 10)
    text = serve.text()
    assert status == 0, text[-2000:]
    assert "Traceback" not in text, text[-3000:]
