"""GenAI semantic conventions (issue 19): `gen_ai.operation.name` (from the request path)
and `gen_ai.provider.name` (what each upstream declares, `provider = "openai"`) on the
request and attempt spans; `check` warns when a route's candidate is provider
`anthropic` and its `failover_status` lacks 529 (Anthropic's overloaded)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fallback_mw import ConfigError, Gateway, load_config
from fallback_mw.telemetry import Telemetry
from fallback_mw.telemetry.genai import operation_name
from tests.helpers import client_for
from tests.upstreams import host_app, status_handler, upstream

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def spans() -> Iterator[tuple[InMemorySpanExporter, Telemetry]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter, Telemetry(tracer_provider=provider)
    provider.shutdown()


@pytest.mark.anyio
async def test_operation_and_provider_on_request_and_attempt_spans(
    spans: tuple[InMemorySpanExporter, Telemetry],
) -> None:
    exporter, telemetry = spans
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        conf = {
            "upstreams": {"primary": {"url": p.url, "provider": "openai"},
                          "backup": {"url": b.url, "provider": "anthropic"}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"],
                        "retries": 1, "replayable_methods": ["POST"]}],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf, telemetry=telemetry)
        async with client_for(gateway) as client:
            response = await client.post(
                "/v1/chat/completions", json={"model": "m"}, headers={"traceparent": TRACEPARENT}
            )
        await gateway.aclose()
    assert response.status_code == 200
    finished = exporter.get_finished_spans()
    request = next(s for s in finished if s.name == "gateway.request")
    attempts = sorted(
        (s for s in finished if s.name == "gateway.attempt"),
        key=lambda s: int((s.attributes or {})["gateway.attempt.number"]),  # type: ignore[arg-type]
    )
    assert request.attributes is not None
    assert request.attributes["gen_ai.operation.name"] == "chat"
    assert request.attributes["gen_ai.provider.name"] == "anthropic"  # the one that served
    assert [(a.attributes or {}).get("gen_ai.provider.name") for a in attempts] == [
        "openai", "anthropic",
    ]  # fmt: skip
    assert all((a.attributes or {})["gen_ai.operation.name"] == "chat" for a in attempts)


@pytest.mark.parametrize(
    ("path", "operation"),
    [
        ("/v1/chat/completions", "chat"),
        ("/v1/messages", "chat"),
        ("/v1/responses", "chat"),
        ("/v1/completions", "text_completion"),
        ("/v1/embeddings", "embeddings"),
        ("/v1beta/models/gemini-2.0-flash:generateContent", "generate_content"),
        ("/v1/models", None),
    ],
)
def test_operation_name_from_the_path(path: str, operation: str | None) -> None:
    assert operation_name(path) == operation


def test_provider_must_be_a_name() -> None:
    with pytest.raises(ConfigError, match="provider"):
        load_config({"upstreams": {"p": {"url": "http://127.0.0.1:9", "provider": "Open AI"}}})


def test_check_warns_about_an_anthropic_candidate_without_529(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    body = (
        '[upstreams.openai]\nurl = "http://127.0.0.1:9001"\nprovider = "openai"\n'
        'first_byte_timeout_ms = 2000\nauth_env = "FMW_GENAI_KEY"\n'
        '[upstreams.claude]\nurl = "http://127.0.0.1:9002"\nprovider = "anthropic"\n'
        'auth_header = "x-api-key"\nauth_scheme = ""\nauth_env = "FMW_GENAI_KEY"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["openai", "claude"]\nretries = 1\n'
    )
    config.write_text(body, encoding="utf-8")
    fallback_mw = str(Path(sys.executable).with_name("fallback-mw"))
    env = {**os.environ, "FMW_GENAI_KEY": "sk-genai-0001"}
    result = subprocess.run([fallback_mw, "check", "--config", str(config)], env=env,
                            capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (
        "  warning: candidate 'claude' is provider anthropic, and 529 (Anthropic's "
        "overloaded_error) is not in failover_status: add 529 to fail over when it is overloaded"
    ) in result.stdout.splitlines()
    assert result.stdout.rstrip().endswith("1 route(s), 1 warning(s)")
    config.write_text(body + "failover_status = [502, 503, 504, 529]\n", encoding="utf-8")
    result = subprocess.run([fallback_mw, "check", "--config", str(config)], env=env,
                            capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert "warning" not in result.stdout
