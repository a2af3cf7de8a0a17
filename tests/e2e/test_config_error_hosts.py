"""A broken configuration never serves (issue 19). `app.add_middleware(Gateway,
config="gateway.toml")` with an unset key variable, in a FastAPI app under a real uvicorn
process: Starlette builds its middleware on the first ASGI call and uvicorn's default
lifespan mode ("auto") swallows an exception raised there, so the gateway fails the
lifespan startup itself (uvicorn stops, naming the problem in one line); with the
lifespan off, every request is a local 503 `config_error` naming it, logged once.
In-process: the same for a dict and a loaded model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from fallback_mw import ConfigError, Gateway
from fallback_mw.config import GatewayConfig
from tests.e2e.test_host_servers import require_server
from tests.helpers import free_port, http_scope, log_text

VARIABLE = "CFG_ERR_PRIMARY_KEY"
PROBLEM = f"upstream 'primary': environment variable {VARIABLE} is not set"

APP = """
from fastapi import FastAPI
from fallback_mw import Gateway

app = FastAPI()

@app.get("/health")
def health():
    return {"ok": True}

app.add_middleware(Gateway, config="gateway.toml")
"""

TOML = f"""
[upstreams.primary]
url = "http://127.0.0.1:9"
auth_env = "{VARIABLE}"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary"]
"""


SERVERS = {
    "uvicorn": ["uvicorn", "app:app", "--port", "{port}"],
    "hypercorn": ["hypercorn", "app:app", "--bind", "127.0.0.1:{port}"],
    "granian": ["granian", "--interface", "asgi", "--port", "{port}", "app:app"],
    "daphne": ["daphne", "-p", "{port}", "app:app"],
}


def _start(
    tmp: Path, *uvicorn_args: str, server: str = "uvicorn"
) -> tuple[subprocess.Popen[bytes], int, Path]:
    (tmp / "app.py").write_text(APP)
    (tmp / "gateway.toml").write_text(TOML)
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    port = free_port()
    log = tmp / f"{server}.log"
    command = [part.format(port=port) for part in SERVERS[server]]
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            [sys.executable, "-m", *command, *uvicorn_args],
            cwd=tmp,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return process, port, log


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _get(port: int, path: str, deadline: float) -> httpx.Response | None:
    """GET until the server answers; None if it never does (it stopped, or time ran out)."""
    while time.monotonic() < deadline:
        try:
            return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)
        except httpx.TransportError:
            time.sleep(0.05)
    return None


@pytest.mark.e2e
def test_uvicorn_default_lifespan_stops_with_one_line(tmp_path: Path) -> None:
    process, port, log = _start(tmp_path)
    try:
        deadline = time.monotonic() + 20
        served: list[int] = []
        while process.poll() is None and time.monotonic() < deadline:
            answer = _get(port, "/health", min(deadline, time.monotonic() + 0.2))
            if answer is not None:
                served.append(answer.status_code)
        assert process.poll() is not None, "uvicorn kept serving a broken configuration"
    finally:
        _stop(process)
    output = log_text(log)
    assert 500 not in served and 200 not in served, (served, output)
    assert process.returncode != 0
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if PROBLEM in line]
    assert lines, output
    assert "ASGI 'lifespan' protocol appears unsupported" not in output


@pytest.mark.e2e
def test_uvicorn_without_lifespan_answers_503_naming_the_problem_logged_once(
    tmp_path: Path,
) -> None:
    process, port, log = _start(tmp_path, "--lifespan", "off")
    try:
        answers = [_get(port, path, time.monotonic() + 20) for path in ("/health", "/v1/x") * 3]
    finally:
        _stop(process)
    output = log_text(log)
    for answer in answers:
        assert answer is not None, output
        assert answer.status_code == 503, (answer.status_code, answer.text, output)
        error = answer.json()["error"]
        assert error["code"] == "config_error" and error["rule"] == "config"
        assert PROBLEM in error["message"]
    assert "Traceback" not in output, output
    assert sum(PROBLEM in line for line in output.splitlines()) == 1, output


@pytest.mark.e2e
@pytest.mark.parametrize("server", ["hypercorn", "granian"])
def test_other_lifespan_servers_stop_naming_the_problem(tmp_path: Path, server: str) -> None:
    require_server(server)
    process, port, log = _start(tmp_path, server=server)
    try:
        deadline = time.monotonic() + 20
        served: list[int] = []
        while process.poll() is None and time.monotonic() < deadline:
            answer = _get(port, "/health", min(deadline, time.monotonic() + 0.2))
            if answer is not None:
                served.append(answer.status_code)
        assert process.poll() is not None, f"{server} kept serving a broken configuration"
    finally:
        _stop(process)
    output = log_text(log)
    assert 500 not in served and 200 not in served, (served, output)
    # docs/operations.md: hypercorn exits 0 after a failed startup, granian does not.
    assert (process.returncode == 0) == (server == "hypercorn"), (process.returncode, output)
    # hypercorn reports a failed startup with its own traceback, whose last line is it.
    assert PROBLEM in output.strip().splitlines()[-1] or any(
        PROBLEM in line and "ERROR" in line for line in output.splitlines()
    ), output


@pytest.mark.e2e
def test_daphne_without_lifespan_answers_503_naming_the_problem(tmp_path: Path) -> None:
    require_server("daphne")
    process, port, log = _start(tmp_path, server="daphne")
    try:
        answers = [_get(port, path, time.monotonic() + 20) for path in ("/health", "/v1/x") * 2]
    finally:
        _stop(process)
    output = log_text(log)
    for answer in answers:
        assert answer is not None and answer.status_code == 503, output
        assert answer.json()["error"]["code"] == "config_error"
    assert "Traceback" not in output, output
    assert sum(PROBLEM in line for line in output.splitlines()) == 1, output


def _broken(form: str) -> Any:
    data = {
        "upstreams": {"primary": {"url": "http://127.0.0.1:9", "auth_env": VARIABLE}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }
    if form == "model":
        return GatewayConfig.model_validate(data)
    return data


async def _host(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the host app is never reached through a broken gateway")


@pytest.mark.anyio
@pytest.mark.parametrize("form", ["dict", "model"])
async def test_every_config_form_refuses_to_serve(form: str) -> None:
    gateway = Gateway(_host, config=_broken(form), environ={})
    assert gateway.config_error is not None and PROBLEM in gateway.config_error
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def lifespan_receive() -> dict[str, Any]:
        return incoming.pop(0)

    # The failed startup ends the lifespan: said in the message, then raised.
    with pytest.raises(ConfigError, match=PROBLEM):
        await gateway({"type": "lifespan"}, lifespan_receive, send)  # type: ignore[arg-type]
    assert sent == [{"type": "lifespan.startup.failed", "message": gateway.config_error}]
    # A server that asks for a shutdown alone (no startup) is answered.
    sent.clear()
    await gateway({"type": "lifespan"}, lifespan_receive, send)  # type: ignore[arg-type]
    assert sent == [{"type": "lifespan.shutdown.complete"}]
    sent.clear()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    await gateway(http_scope("GET", "/anything"), receive, send)  # type: ignore[arg-type]
    assert sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"]["code"] == "config_error"
    await gateway.aclose()


def test_starlette_testclient_raises_the_problem_instead_of_hanging() -> None:
    # A FastAPI user's test suite hung for ever: `with TestClient(app)` (Starlette's, which
    # FastAPI re-exports) waits, after `lifespan.startup.failed`, for the app to end its
    # lifespan (Starlette's own router re-raises there), and the gateway kept waiting for a
    # shutdown message instead. Now the failed startup raises the problem, as the router's.
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    app.add_middleware(Gateway, config=_broken("dict"), environ={})
    outcome: list[BaseException | None] = []

    def enter() -> None:
        try:
            with TestClient(app):
                outcome.append(None)
        except BaseException as exc:  # what the user's test would see
            outcome.append(exc)

    thread = threading.Thread(target=enter, daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), "TestClient hung on the gateway's failed lifespan startup"
    assert len(outcome) == 1 and isinstance(outcome[0], ConfigError), outcome
    assert PROBLEM in str(outcome[0])
