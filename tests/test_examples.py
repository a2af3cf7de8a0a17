"""The examples run offline from their one command: `python examples/<name>/run.py` starts
the mock upstreams (a primary answering 503, an OpenAI-shaped backup) and the example app on
uvicorn. Each is started for real and driven with the official `openai` SDK, streaming and
not; Django's own async test client drives the Django example too."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from fallback_mw import load_config
from tests.examples_runner import EXAMPLES, running_example

MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["fastapi_app", "django_app"])
def test_example_runs_offline_and_fails_a_chat_completion_over_with_the_openai_sdk(
    name: str,
) -> None:
    with running_example(name) as example:
        url = example.url
        own = httpx.get(f"{url}/health", timeout=10)
        garbage = httpx.post(f"{url}/v1/chat/completions", content=b"not json{", timeout=10)
        # JSON of the wrong shape (a query-injection probe): a real API's 400, not a 500.
        misshapen = httpx.post(
            f"{url}/v1/chat/completions", json={"model": {"$gt": ""}, "messages": "x"}, timeout=10
        )
        with OpenAI(
            base_url=f"{url}/v1", api_key="caller-key-never-forwarded", max_retries=0
        ) as client:
            raw = client.chat.completions.with_raw_response.create(
                model="gpt-4o-mini", messages=MESSAGES
            )
            completion = raw.parse()
            stream = client.chat.completions.create(
                model="gpt-4o-mini",
                messages=MESSAGES,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(stream)
    # The app keeps its own route; the gateway does not touch it.
    assert own.status_code == 200 and own.json() == {"status": "ok"}
    assert "x-gateway-route" not in own.headers
    # A body that is not JSON: the backup's 400 is an answer, passed through as-is.
    assert garbage.status_code == 400 and garbage.headers["x-gateway-provider"] == "backup"
    assert garbage.json()["error"]["type"] == "invalid_request_error"
    assert misshapen.status_code == 400, misshapen.text
    assert misshapen.json()["error"]["type"] == "invalid_request_error"
    # The POST failed over: the primary answered 503, the backup served.
    assert raw.headers["x-gateway-provider"] == "backup"
    assert raw.headers["x-gateway-attempts"] == "2"
    assert completion.choices[0].message.content == "Hello from the backup upstream."
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == "Hello from the backup upstream."
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
    # The failovers are logged by Python's default logging (nothing configured it).
    failovers = [line for line in example.output if line.startswith("gateway request ")]
    assert len(failovers) == 4, "".join(example.output)
    assert all("chosen=backup attempts=2" in line for line in failovers)
    output = "".join(example.output)
    assert "Traceback" not in output
    # Started and stopped without a warning: the lifespan is handled (Django's through
    # with_lifespan) and the upstream sessions are closed at shutdown.
    assert "lifespan' protocol appears unsupported" not in output, output
    assert "Unclosed" not in output and "Waiting for application shutdown" in output, output


@pytest.mark.parametrize(
    ("name", "app"), [("fastapi_app", "app:app"), ("django_app", "asgi:application")]
)
def test_example_under_plain_uvicorn_refuses_a_missing_variable_in_one_line(
    name: str, app: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PRIMARY_API_KEY", "GATEWAY_CONFIG")}
    env["BACKUP_API_KEY"] = "b"
    result = subprocess.run(
        [sys.executable, "-m", "uvicorn", app, "--port", "0"],
        cwd=EXAMPLES / name,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.endswith(
        "upstream 'primary': environment variable PRIMARY_API_KEY is not set\n"
    )
    assert len(result.stderr.splitlines()) == 1, result.stderr


@pytest.mark.parametrize("name", ["fastapi_app", "django_app"])
def test_example_on_a_busy_port_says_so_in_one_line(name: str) -> None:
    # Port 8000, the examples' default, is often taken. uvicorn's failed start-up used to
    # escape the example's event loop as "Task exception was never retrieved" and two
    # tracebacks, after the mock upstreams had started.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, str(EXAMPLES / name / "run.py"), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith(f"cannot listen on 127.0.0.1:{port}: "), result.stderr
    assert result.stderr.endswith("; pass --port N for another port, or --port 0 for a free one\n")
    assert len(result.stderr.splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
    ("name", "absent", "line"),
    [
        (
            "fastapi_app",
            ["uvicorn", "fastapi"],
            "this example needs uvicorn, fastapi, not installed here: "
            "pip install 'fallback_mw[serve]' fastapi",
        ),
        (
            "django_app",
            ["uvicorn", "django"],
            "this example needs uvicorn, django, not installed here: "
            "pip install 'fallback_mw[serve,django]'",
        ),
        (
            "fastapi_app",
            ["fastapi"],
            "this example needs fastapi, not installed here: pip install fastapi",
        ),
    ],
)
def test_example_without_its_packages_says_what_to_install_in_one_line(
    name: str, absent: list[str], line: str
) -> None:
    # `pip install fallback_mw` and then the example's one command: a traceback ending in
    # "No module named 'uvicorn'" after the mocks had started (FastAPI is in no extra).
    hide = "".join(f"sys.modules[{module!r}] = None; " for module in absent)
    run = EXAMPLES / name / "run.py"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import runpy, sys; {hide}sys.argv = [{str(run)!r}, '--port', '0']; "
            f"runpy.run_path({str(run)!r}, run_name='__main__')",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == line + "\n", result.stderr


DJANGO_TEST_CLIENT = """
import asyncio, json, os
from pathlib import Path
import django
from mock_upstreams import config_for_mocks, start_mocks

async def main():
    async with start_mocks() as mocks:
        config = config_for_mocks(Path("gateway.toml"), mocks, Path(os.environ["TMP_CONFIG"]))
        os.environ["GATEWAY_CONFIG"] = str(config)
        django.setup()
        from django.test import AsyncClient
        from fallback_mw.django import aclose_gateways

        client = AsyncClient()
        health = await client.get("/health")
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
        plain = await client.post("/v1/chat/completions", body, content_type="application/json")
        plain_body = b"".join([chunk async for chunk in plain.streaming_content])
        streamed = await client.post(
            "/v1/chat/completions", {**body, "stream": True}, content_type="application/json"
        )
        events = b"".join([chunk async for chunk in streamed.streaming_content])
        await aclose_gateways()
    print(json.dumps({
        "health": [health.status_code, json.loads(health.content)],
        "plain": [plain.status_code, plain["x-gateway-provider"], plain["x-gateway-attempts"],
                  json.loads(plain_body)["choices"][0]["message"]["content"]],
        "stream": [streamed["content-type"], events.decode().rstrip().endswith("data: [DONE]")],
        "primary": mocks.primary.requests, "backup": mocks.backup.requests,
    }))

asyncio.run(main())
"""


def test_django_example_with_djangos_own_async_test_client(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_CONFIG"}
    env.update(
        DJANGO_SETTINGS_MODULE="settings",
        PYTHONPATH=os.pathsep.join([str(EXAMPLES / "django_app"), str(EXAMPLES)]),
        PRIMARY_API_KEY="p",
        BACKUP_API_KEY="b",
        TMP_CONFIG=str(tmp_path / "gateway.toml"),
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", DJANGO_TEST_CLIENT],
        cwd=EXAMPLES / "django_app",
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {
        "health": [200, {"status": "ok"}],
        "plain": [200, "backup", "2", "Hello from the backup upstream."],
        "stream": ["text/event-stream", True],
        "primary": ["POST /v1/chat/completions", "POST /v1/chat/completions"],
        "backup": ["POST /v1/chat/completions", "POST /v1/chat/completions"],
    }, result.stderr


@pytest.mark.parametrize("name", ["fastapi_app", "django_app"])
def test_example_config_lets_chat_completions_fail_over(name: str) -> None:
    config = load_config(
        EXAMPLES / name / "gateway.toml", environ={"PRIMARY_API_KEY": "p", "BACKUP_API_KEY": "b"}
    )
    (route,) = config.routes
    assert "POST" in route.replayable_methods and route.plan == ("primary", "backup")
