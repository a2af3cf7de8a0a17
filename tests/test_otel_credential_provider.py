"""`serve`'s OTLP/HTTP exporters with a credential provider: the session the SDK's
`OTEL_PYTHON_EXPORTER_OTLP_HTTP[_TRACES|_METRICS]_CREDENTIAL_PROVIDER` names, an entry
point of the `opentelemetry_otlp_credential_provider` group (a cloud's authorized session).
A provider that is not installed, fails or gives no session is refused in one line naming
the variable."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from fallback_mw.cli.otel_setup import TelemetrySetupError, configure_opentelemetry

GENERAL = "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER"
TRACES = "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER"


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set OTEL_* variables for one test, starting from none (the SDK reads os.environ)."""
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)

    def set_env(**values: str) -> None:
        for key, value in values.items():
            monkeypatch.setenv(key, value)

    return set_env


def providers(tmp_path: Path, **factories: str) -> Path:
    """A directory to put on sys.path holding an installed distribution whose
    credential-provider entry points are `factories` (name: the factory's Python body,
    returning the session)."""
    tmp_path.mkdir(exist_ok=True)
    module = ["import requests", ""]
    for name, body in factories.items():
        module += [f"def {name}():", *(f"    {line}" for line in body.splitlines()), ""]
    (tmp_path / "fmw_test_providers.py").write_text("\n".join(module), encoding="utf-8")
    info = tmp_path / "fmw_test_providers-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fmw-test-providers\nVersion: 1.0\n", encoding="utf-8"
    )
    (info / "entry_points.txt").write_text(
        "[opentelemetry_otlp_credential_provider]\n"
        + "".join(f"{name} = fmw_test_providers:{name}\n" for name in factories),
        encoding="utf-8",
    )
    return tmp_path


@pytest.mark.parametrize("variable", [GENERAL, TRACES])
def test_a_provider_that_is_not_installed_is_refused_naming_the_variable(
    otel_env: Any, variable: str
) -> None:
    """It was "unexpected internal error (RuntimeError); please report it": the SDK's
    RuntimeError, which serve took for a bug of its own."""
    otel_env(
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
        **{variable: "not-installed"},
    )
    with pytest.raises(TelemetrySetupError) as refused:
        configure_opentelemetry(set_global=False)
    message = str(refused.value)
    assert message.startswith(f"{variable}: "), message
    assert "'not-installed'" in message and "opentelemetry_otlp_credential_provider" in message
    assert f"unset {variable}" in message


def test_serve_refuses_a_provider_that_fails_or_gives_no_session_in_one_line(
    tmp_path: Path,
) -> None:
    """A provider that raised (its cloud's credentials missing) or gave something else than
    a requests.Session stopped serve with "unexpected internal error"; the error's own words
    (they may quote a credential's path or value) are not shown."""
    path = providers(
        tmp_path / "site",
        broken="raise OSError('no credentials in /secret/key-7f3a')",
        wrong="return object()",
    )
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.primary]\nurl = "http://127.0.0.1:9"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    for name, said in [("broken", "failed making its session (OSError)"), ("wrong", "object")]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")])),
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
            **{GENERAL: name},
        )
        served = subprocess.run(
            [sys.executable, "-m", "fallback_mw", "serve", "--config", str(config), "--port", "0"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert served.returncode == 2, served.stderr
        (line,) = served.stderr.strip().splitlines()
        assert line.startswith(f"fallback-mw: error: {GENERAL}: "), line
        assert said in line and "internal error" not in line and "key-7f3a" not in line


# More than an OTLP answer may take and than loopback's socket buffers hold.
READ_IT_ALL = 128 << 20


@dataclass
class Collector:
    url: str
    exports: int = 0
    heads: list[bytes] = field(default_factory=list)  # each export's request head
    sent: list[int] = field(default_factory=list)  # each export's answer bytes taken
    ended: threading.Event = field(default_factory=threading.Event)


@contextmanager
def endless_collector() -> Iterator[Collector]:
    """Answers the first export with 200 and a chunked body that never ends, until the
    gateway closes the connection or READ_IT_ALL is sent."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    collector = Collector(url=f"http://127.0.0.1:{listener.getsockname()[1]}")
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b"\0" * (1 << 20))

    def answer(conn: socket.socket) -> None:
        sent = 0
        with conn:
            try:
                data = b""
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        return
                    data += more
                collector.heads.append(data.split(b"\r\n\r\n")[0])
                collector.exports += 1
                conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                while sent < READ_IT_ALL:
                    conn.sendall(chunk)
                    sent += 1 << 20
            except OSError:
                pass
            finally:
                collector.sent.append(sent)
                collector.ended.set()

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield collector
    finally:
        listener.close()


# A provider as a cloud's is: a requests.Session of its own class that signs each request.
SIGNING = """class Signing(requests.Session):
    def request(self, method, url, *args, **kwargs):
        kwargs.setdefault("headers", {})
        kwargs["headers"] = {**(kwargs["headers"] or {}), "x-signed": "by-provider"}
        return super().request(method, url, *args, **kwargs)
return Signing()"""


@pytest.mark.e2e
@pytest.mark.anyio
async def test_a_providers_session_reads_a_collector_answer_only_up_to_the_bound(
    tmp_path: Path,
) -> None:
    """With a credential provider the exporter sent through the provider's session as it
    came, which read a collector's whole answer into memory: one that never ended grew
    serve's memory without bound and held the export thread, as without a provider before
    cli/otel_session.py. Its answers are read as the gateway's own session's are, up to
    ANSWER_LIMIT and within the export's timeout; the provider still signs each export."""
    import anyio
    import httpx

    from fallback_mw.cli.otel_setup import TELEMETRY_FLUSH_SECONDS
    from tests.helpers import free_port, log_text, serve_process, wait_listening
    from tests.upstreams import status_handler, upstream

    path = providers(tmp_path / "site", signing=SIGNING)
    port, log = free_port(), tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")])),
        FMW_COLLECT_KEY="primary-key-0c4f",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="none",
        OTEL_BSP_SCHEDULE_DELAY="100",
        **{TRACES: "signing"},
    )
    async with upstream(status_handler(200, b"ok")) as primary:
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[upstreams.primary]\nurl = "{primary.url}"\nauth_env = "FMW_COLLECT_KEY"\n'
            '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
            encoding="utf-8",
        )
        with endless_collector() as collector:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = collector.url
            with serve_process(config, port, log, env=env) as process:
                await wait_listening(process, port, log)
                async with httpx.AsyncClient(timeout=10) as client:
                    response = await client.get(f"http://127.0.0.1:{port}/v1/chat")
                    assert response.status_code == 200
                    ended = await anyio.to_thread.run_sync(collector.ended.wait, 60)
                    assert ended, log_text(log)[-2000:]
                process.send_signal(signal.SIGINT)
                status = process.wait(timeout=TELEMETRY_FLUSH_SECONDS + 10)
    assert collector.exports >= 1
    assert collector.sent[0] < READ_IT_ALL, f"serve read {collector.sent[0] >> 20} MiB"
    assert b"x-signed: by-provider" in collector.heads[0].lower(), collector.heads[0]
    assert status == 0, log_text(log)[-2000:]


def test_a_provider_that_retries_through_its_own_request_keeps_the_answer(
    tmp_path: Path, otel_env: Any
) -> None:
    """A provider that, on a 401, refreshes its token and sends again through its own
    `request` (google-auth's AuthorizedSession does) had its second answer read twice:
    once by the inner call, then again, empty, by the outer: the exporter read the
    collector's refusal as no text (an SDK that quotes it, "Failed to export span batch
    code: 429, reason: ...", quoted nothing). The answer read once is the answer."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from fallback_mw.cli.otel_session import provider_session

    answers = iter([(401, b"token expired"), (429, b"quota exceeded for project")])

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            status, body = next(answers)
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    refreshing = """class Refreshing(requests.Session):
    def request(self, method, url, data=None, headers=None, _again=False, **kwargs):
        answer = super().request(method, url, data=data, headers=headers, **kwargs)
        if answer.status_code == 401 and not _again:
            return self.request(method, url, data=data, headers=headers, _again=True, **kwargs)
        return answer
return Refreshing()"""
    path = providers(tmp_path / "site", refreshing=refreshing)
    server = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sys.path.insert(0, str(path))
    try:
        session = provider_session(GENERAL, "refreshing")
        answer = session.request(
            method="POST",
            url=f"http://127.0.0.1:{server.server_address[1]}/v1/traces",
            data=b"spans",
            timeout=10,
        )
    finally:
        sys.path.remove(str(path))
        server.shutdown()
        server.server_close()
    assert answer.status_code == 429
    assert answer.content == b"quota exceeded for project"
    assert answer.text == "quota exceeded for project"
