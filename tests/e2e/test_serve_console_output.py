"""`fallback-mw serve` with OTEL_TRACES_EXPORTER=console and a stdout that cannot take the
spans: a reader that stopped reading (`serve | less` left on one page, a stalled log
shipper), a reader that has exited (EPIPE), stdout closed (`>&-`). The gateway serves and
stops as always; console telemetry is what gives way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from tests.helpers import free_port, log_text, wait_listening
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.e2e

KEY = "console-secret-71b2c9d4"


def write_config(tmp_path: Path, url: str) -> Path:
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[upstreams.primary]\nurl = "{url}"\nauth_env = "FMW_CONSOLE_KEY"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    return config


@contextmanager
def serve_console(
    config: Path, port: int, log: Path, *, stdout: str, interval_ms: int = 200
) -> Iterator[subprocess.Popen[bytes]]:
    """serve with console spans and metrics (exported every `interval_ms`); `stdout`
    "pipe" (never read), "gone" (a pipe whose read end is closed at once) or "closed"
    (`>&-`); stderr in `log`."""
    env = dict(
        os.environ,
        FMW_CONSOLE_KEY=KEY,
        OTEL_TRACES_EXPORTER="console",
        OTEL_METRICS_EXPORTER="console",
        OTEL_METRIC_EXPORT_INTERVAL=str(interval_ms),
    )
    command = [
        *(sys.executable, "-m", "fallback_mw", "serve", "--config", str(config)),
        *("--host", "127.0.0.1", "--port", str(port)),
    ]
    if stdout == "closed":
        command = ["bash", "-c", 'exec "$@" >&-', "bash", *command]
    with log.open("wb") as err:
        process = subprocess.Popen(
            command,
            stdout=None if stdout == "closed" else subprocess.PIPE,
            stderr=err,
            env=env,
        )
        if stdout == "gone":
            assert process.stdout is not None
            process.stdout.close()  # the reader has exited: every write is EPIPE
        try:
            yield process
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()


async def requests_then_stop(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """200 requests, each answered (not one held behind a console write), then a stop."""
    await wait_listening(process, port, log)
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(200):
            try:
                response = await client.get(f"http://127.0.0.1:{port}/v1/chat")
            except httpx.TimeoutException:
                pytest.fail(f"the gateway stopped answering: {log_text(log)[-2000:]}")
            assert response.status_code == 200
    process.send_signal(signal.SIGINT)
    try:
        assert process.wait(timeout=15) == 0, log_text(log)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve did not stop within 15 s of SIGINT: {log_text(log)[-2000:]}")


@pytest.mark.anyio
async def test_console_spans_on_a_stdout_nobody_reads_never_stop_the_gateway(
    tmp_path: Path,
) -> None:
    """The console exporter wrote each span on the event loop as the request ended: once
    the pipe's buffer was full (about 25 requests), the next write blocked the loop, and
    with it every request and the stop (SIGINT, SIGTERM: only SIGKILL ended it)."""
    port, log = free_port(), tmp_path / "serve.log"
    async with upstream(status_handler(200, b"ok")) as primary:
        config = write_config(tmp_path, primary.url)
        with serve_console(config, port, log, stdout="pipe") as process:
            await requests_then_stop(process, port, log)
    assert "Traceback" not in log_text(log)


@pytest.mark.anyio
@pytest.mark.parametrize("interval_ms", [200, 10])
@pytest.mark.parametrize("stdout", ["gone", "closed"])
async def test_console_spans_on_a_stdout_that_is_gone_say_so_once_not_a_traceback_each(
    tmp_path: Path, stdout: str, interval_ms: int
) -> None:
    """A reader that exited (`serve | head`) or stdout closed: each span and each metric
    export wrote a traceback (BrokenPipeError, or AttributeError on None) to the log, two
    for every request, for as long as the gateway ran. The line saying so once was lost
    when the first metric export came before serve had set up its log (a 10 ms interval
    here; 200 ms on a loaded machine, where starting took longer): nothing said it."""
    port, log = free_port(), tmp_path / "serve.log"
    async with upstream(status_handler(200, b"ok")) as primary:
        config = write_config(tmp_path, primary.url)
        with serve_console(config, port, log, stdout=stdout, interval_ms=interval_ms) as process:
            await requests_then_stop(process, port, log)
    text = log_text(log)
    assert "Traceback" not in text and "Exception while exporting" not in text, text[-2000:]
    assert text.count("console telemetry") == 1, text[-2000:]
    assert KEY not in text


def test_console_output_on_a_non_blocking_stdout_waits_for_room(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stdout a parent left non-blocking (it shares the open file): a full pipe is
    EAGAIN, room later, not a stdout gone."""
    import threading
    import time

    from fallback_mw.cli.console_stream import ConsoleStream

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    received = bytearray()

    def read_later() -> None:
        time.sleep(0.5)
        while chunk := os.read(read_end, 65536):
            received.extend(chunk)

    reader = threading.Thread(target=read_later)
    reader.start()
    with os.fdopen(write_end, "w") as target:
        stream = ConsoleStream(target)
        for _ in range(200):
            stream.write("x" * 1023 + "\n")  # 200 KiB: three times a pipe's buffer
        stream.close(10)
    assert stream._thread is not None
    stream._thread.join(10)
    assert stream._fd is None  # its copy of the descriptor closed: the reader sees the end
    reader.join(10)
    assert not reader.is_alive()
    os.close(read_end)
    assert len(received) == 200 * 1024
    assert "console telemetry stopped" not in caplog.text


def test_a_stdout_gone_before_logging_is_set_up_is_still_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """serve sets up telemetry before its log handler: a metric export (every 200 ms with
    OTEL_METRIC_EXPORT_INTERVAL=200) on a closed stdout in that window said "console
    telemetry stopped" to the `fallback_mw` logger's NullHandler, and never again: the log
    said nothing about why the console stayed empty."""
    import logging

    from fallback_mw.cli.console_stream import ConsoleStream

    package = logging.getLogger("fallback_mw")
    quiet = logging.NullHandler()
    saved = package.handlers[:], package.propagate
    package.handlers[:] = [quiet]
    package.propagate = False  # as serve's, before its LineHandler: nothing is heard
    try:
        stream = ConsoleStream(None)
        stream.write("a span\n")
        package.handlers[:] = [quiet, caplog.handler]  # serve's handler, installed
        with caplog.at_level(logging.WARNING, logger="fallback_mw"):
            for _ in range(3):
                stream.write("a span\n")
        stream.close(1)
    finally:
        package.handlers[:], package.propagate = saved
    said = [r for r in caplog.records if "console telemetry stopped" in r.getMessage()]
    assert len(said) == 1, caplog.text


def test_the_stream_closes_its_copy_of_stdout_when_closed() -> None:
    """The stream writes to its own copy of stdout's descriptor; closing the stream left it
    open (one descriptor per telemetry setup, a pipe's reader never seeing the end)."""
    from fallback_mw.cli.console_stream import ConsoleStream

    for writes in (0, 3):
        read_end, write_end = os.pipe()
        with os.fdopen(write_end, "w") as target:
            stream = ConsoleStream(target)
            for _ in range(writes):
                stream.write("line\n")
            stream.close(5)
        if stream._thread is not None:
            stream._thread.join(5)
        assert stream._fd is None
        with os.fdopen(read_end, "rb") as reader:  # the end: every writer closed
            assert reader.read() == b"line\n" * writes


@pytest.mark.anyio
async def test_console_metrics_of_a_large_route_table_are_written(tmp_path: Path) -> None:
    """One metric export of a gateway with 120 routes (each route's series exported at 0
    from the start) is some 2.5 MB of the console exporter's JSON, more than the 1 MiB the
    stream queues: every export was dropped whole, and the line counting the drops waits
    for a record that gets through, so stdout stayed empty and nothing said why. A record
    is queued whatever its size while nothing else waits (the bound is then 1 MiB or that
    one record)."""
    port, log, out = free_port(), tmp_path / "serve.log", tmp_path / "stdout.txt"
    upstreams = "".join(f'[upstreams.u{i}]\nurl = "http://127.0.0.1:{9 + i}"\n' for i in range(10))
    routes = "".join(
        f'[[routes]]\nid = "r{i}"\nprefix = "/p{i}/"\nplan = ["u{i % 10}", "u{(i + 1) % 10}"]\n'
        "retries = 1\n"
        for i in range(120)
    )
    config = tmp_path / "gateway.toml"
    config.write_text(upstreams + routes, encoding="utf-8")
    env = dict(
        os.environ,
        OTEL_TRACES_EXPORTER="none",
        OTEL_METRICS_EXPORTER="console",
        OTEL_METRIC_EXPORT_INTERVAL="300",
    )
    command = [
        *(sys.executable, "-m", "fallback_mw", "serve", "--config", str(config)),
        *("--host", "127.0.0.1", "--port", str(port)),
    ]
    with started(command, env, out, log) as process:
        await wait_listening(process, port, log)
        for _ in range(100):  # 20 s at most
            if b"resource_metrics" in out.read_bytes():
                break
            await anyio.sleep(0.2)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0, log_text(log)
    text = out.read_text(encoding="utf-8", errors="replace")
    assert "resource_metrics" in text, (len(text), text[-500:], log_text(log)[-1000:])
    assert "dropped" not in text


@contextmanager
def started(
    command: list[str], env: dict[str, str], out: Path, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """`command` with its stdout in `out` and its stderr in `log`; killed if still running."""
    with log.open("wb") as err, out.open("wb") as stdout:
        process = subprocess.Popen(command, stdout=stdout, stderr=err, env=env)
        try:
            yield process
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
