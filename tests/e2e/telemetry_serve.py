"""`fallback-mw serve` with its telemetry set through the OTEL_* environment, for the tests of
what it does with a collector or a metrics port (test_serve_collector_answers.py,
test_serve_metrics_port.py, test_serve_telemetry_stop.py): one route, /v1/, to one upstream
answering 200 "ok", and stand-in collectors on plain sockets (each connection answered on a
thread of its own) that answer as a test makes them."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import free_port, log_text, serve_process, wait_listening
from tests.upstreams import status_handler, upstream

# The upstream's key (auth_env), never the collector's.
UPSTREAM_KEY = "primary-key-0c4f"


@dataclass(frozen=True)
class Served:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def chat(self) -> str:
        """The URL of a request the gateway routes to the upstream (200 "ok")."""
        return f"http://127.0.0.1:{self.port}/v1/chat"

    def text(self) -> str:
        return log_text(self.log)


@asynccontextmanager
async def serving(tmp_path: Path, **otel: str) -> AsyncIterator[Served]:
    """serve, listening, with this process's environment and `otel` (OTEL_* settings), its
    output in tmp_path/serve.log; SIGINT at the end if the test has not stopped it."""
    port, log = free_port(), tmp_path / "serve.log"
    env = dict(os.environ, FMW_TELEMETRY_TEST_KEY=UPSTREAM_KEY, **otel)
    async with upstream(status_handler(200, b"ok")) as primary:
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[upstreams.primary]\nurl = "{primary.url}"\nauth_env = "FMW_TELEMETRY_TEST_KEY"\n'
            '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
            encoding="utf-8",
        )
        with serve_process(config, port, log, env=env) as process:
            await wait_listening(process, port, log)
            yield Served(process, port, log)


@contextmanager
def collector_at(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """A listener on a free 127.0.0.1 port, each connection given to `answer` on a thread
    of its own (closed after); its URL. Closed at the end."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def answer_closing(conn: socket.socket) -> None:
        with conn, suppress(OSError):
            answer(conn)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer_closing, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


@contextmanager
def silent_collector() -> Iterator[str]:
    """A listener whose backlog takes every connection and never reads or answers one."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def read_request(conn: socket.socket) -> bool:
    """One export request's head and content-length body; False if the gateway closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return False
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return False
        rest += chunk
    return True
