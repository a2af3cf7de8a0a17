"""The official `openai` and `anthropic` SDKs as real clients of a real `fallback-mw serve`,
against local upstreams shaped like the real APIs (examples/mock_upstreams.py): OpenAI
/v1/chat/completions (JSON, SSE with usage in the final chunk) and Anthropic /v1/messages
(JSON, SSE message_start ... message_stop with usage). The primary answers 503, so every
call is a POST that must fail over to the backup."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anthropic
import pytest
from anthropic import Anthropic
from examples.mock_upstreams import REPLY, Mocks, start_mocks
from openai import InternalServerError, OpenAI

from tests.helpers import free_port, log_text, serve_process

pytestmark = pytest.mark.e2e

CALLER_KEY = "caller-key-must-not-reach-upstreams"
MESSAGES = [{"role": "user", "content": "Say hello"}]


@dataclass
class Running:
    url: str
    mocks: Mocks


@contextmanager
def serving(config: Path, env: dict[str, str]) -> Iterator[str]:
    """A real `fallback-mw serve` on a free port; yields its URL once it listens."""
    port = free_port()
    log = config.with_suffix(".log")
    with serve_process(config, port, log, env=env) as process:
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None, log_text(log)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "serve did not listen: " + log_text(log)
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def mocks() -> Iterator[Mocks]:
    """The mock upstreams on their own event loop in a thread, for the module's tests."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    context = start_mocks()
    started = asyncio.run_coroutine_threadsafe(context.__aenter__(), loop).result(timeout=20)
    try:
        yield started
    finally:
        asyncio.run_coroutine_threadsafe(context.__aexit__(None, None, None), loop).result(20)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@pytest.fixture(scope="module")
def gateway(mocks: Mocks, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("llm")
    config = tmp / "gateway.toml"
    config.write_text(
        f"""
[gateway]
allow_hosts = ["127.0.0.1"]
deadline_ms = 20000

[upstreams.primary]
url = "{mocks.primary.url}"
auth_env = "SDK_PRIMARY_KEY"

[upstreams.backup]
url = "{mocks.backup.url}"
auth_env = "SDK_BACKUP_KEY"

[upstreams.claude_primary]
url = "{mocks.primary.url}"
auth_header = "x-api-key"
auth_scheme = ""
auth_env = "SDK_CLAUDE_PRIMARY_KEY"

[upstreams.claude_backup]
url = "{mocks.backup.url}"
auth_header = "x-api-key"
auth_scheme = ""
auth_env = "SDK_CLAUDE_BACKUP_KEY"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retries = 1
replayable_methods = ["GET", "HEAD", "OPTIONS", "POST"]

[[routes]]
id = "messages"
prefix = "/v1/messages"
plan = ["claude_primary", "claude_backup"]
retries = 1
replayable_methods = ["POST"]
""",
        encoding="utf-8",
    )
    env = {
        **os.environ,
        "SDK_PRIMARY_KEY": "openai-primary-key",
        "SDK_BACKUP_KEY": "openai-backup-key",
        "SDK_CLAUDE_PRIMARY_KEY": "claude-primary-key",
        "SDK_CLAUDE_BACKUP_KEY": "claude-backup-key",
    }
    with serving(config, env) as url:
        yield Running(url=url, mocks=mocks)


def _since(mocks: Mocks) -> tuple[int, int]:
    return len(mocks.primary.requests), len(mocks.backup.requests)


def test_openai_sdk_chat_completion_fails_over(gateway: Running) -> None:
    before = _since(gateway.mocks)
    with OpenAI(base_url=f"{gateway.url}/v1", api_key=CALLER_KEY, max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=MESSAGES
        )
        completion = raw.parse()
        assert raw.headers["x-gateway-route"] == "chat"
        assert raw.headers["x-gateway-provider"] == "backup"
        assert int(raw.headers["x-gateway-attempts"]) in (1, 2)  # 1 once the breaker opens
        assert completion.choices[0].message.content == REPLY
        assert completion.usage is not None and completion.usage.completion_tokens == 5
        backup = gateway.mocks.backup
        assert backup.requests[before[1] :] == ["POST /v1/chat/completions"]
        assert backup.credentials[before[1] :] == ["Bearer openai-backup-key"]


def test_openai_sdk_streams_with_usage_in_the_final_chunk(gateway: Running) -> None:
    with OpenAI(base_url=f"{gateway.url}/v1", api_key=CALLER_KEY, max_retries=0) as client:
        with client.chat.completions.with_streaming_response.create(
            model="gpt-4o-mini",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        ) as response:
            assert response.headers["x-gateway-provider"] == "backup"
            assert response.headers["content-type"].startswith("text/event-stream")
            chunks = list(response.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.strip() == REPLY
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 5
        assert all(c.usage is None for c in chunks[:-1])


def test_anthropic_sdk_message_fails_over(gateway: Running) -> None:
    before = _since(gateway.mocks)
    with Anthropic(base_url=gateway.url, api_key=CALLER_KEY, max_retries=0) as client:
        raw = client.messages.with_raw_response.create(
            model="claude-sonnet-5", max_tokens=64, messages=MESSAGES
        )
        message = raw.parse()
        assert raw.headers["x-gateway-route"] == "messages"
        assert raw.headers["x-gateway-provider"] == "claude_backup"
        assert message.content[0].type == "text" and message.content[0].text == REPLY
        assert message.usage.output_tokens == 5
        backup = gateway.mocks.backup
        assert backup.requests[before[1] :] == ["POST /v1/messages"]
        assert backup.credentials[before[1] :] == ["claude-backup-key"]


def test_anthropic_sdk_streams_its_event_types_with_usage(gateway: Running) -> None:
    with Anthropic(base_url=gateway.url, api_key=CALLER_KEY, max_retries=0) as client:
        with client.messages.stream(
            model="claude-sonnet-5", max_tokens=64, messages=MESSAGES
        ) as stream:
            events = [event.type for event in stream]
            final = stream.get_final_message()
        assert events[0] == "message_start" and events[-1] == "message_stop"
        assert {"content_block_start", "content_block_delta", "message_delta"} <= set(events)
        assert "".join(b.text for b in final.content if b.type == "text").strip() == REPLY
        assert final.usage.output_tokens == 5 and final.usage.input_tokens > 0


def test_a_route_without_post_replay_does_not_fail_over_for_the_sdk(
    gateway: Running, tmp_path: Path
) -> None:
    # The negative control: with the default replayable_methods (no POST) the same call is
    # not replayed: the SDK gets the local 502 and the backup is never asked.

    config = tmp_path / "gateway.toml"
    config.write_text(
        f"""
[upstreams.primary]
url = "{gateway.mocks.primary.url}"
[upstreams.backup]
url = "{gateway.mocks.backup.url}"
[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retries = 1
""",
        encoding="utf-8",
    )
    before = _since(gateway.mocks)
    with (
        serving(config, dict(os.environ)) as url,
        OpenAI(base_url=f"{url}/v1", api_key=CALLER_KEY, max_retries=0) as client,
        pytest.raises(InternalServerError) as caught,
    ):
        client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    # SPEC §5: a failover status on a non-replayable request ends the walk with the local
    # 502 upstream_failed, never the upstream's body.
    assert caught.value.status_code == 502
    assert caught.value.body == {  # the SDK unwraps the "error" object
        "type": "gateway_error",
        "code": "upstream_failed",
        "message": caught.value.body["message"],  # type: ignore[index]
        "route": "chat",
        "attempts": 1,
        "rule": "not_replayable_method",  # SPEC §12: and the message says how to opt in
    }
    assert 'add "POST" to its replayable_methods' in caught.value.body["message"]  # type: ignore[index]
    assert len(gateway.mocks.backup.requests) == before[1]
    assert len(gateway.mocks.primary.requests) == before[0] + 1


NOT_REPLAYED_ROUTES = """
[upstreams.primary]
url = "{primary}"
[upstreams.backup]
url = "{backup}"
[upstreams.claude_primary]
url = "{primary}"
auth_header = "x-api-key"
auth_scheme = ""
[upstreams.claude_backup]
url = "{backup}"
auth_header = "x-api-key"
auth_scheme = ""
[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retries = 1
[[routes]]
id = "messages"
prefix = "/v1/messages"
plan = ["claude_primary", "claude_backup"]
retries = 1
"""


def test_the_sdks_default_retries_do_not_resend_a_post_the_route_does_not_replay(
    gateway: Running, tmp_path: Path
) -> None:
    # Both SDKs retry a 5xx twice by default. The gateway's 502 after its walk says
    # `x-should-retry: false`, which they obey: the POST reaches the primary once, as the
    # route's replayable_methods promise, not once per SDK attempt.
    mocks = gateway.mocks
    config = tmp_path / "gateway.toml"
    config.write_text(
        NOT_REPLAYED_ROUTES.format(primary=mocks.primary.url, backup=mocks.backup.url),
        encoding="utf-8",
    )
    with (
        serving(config, dict(os.environ)) as url,
        OpenAI(base_url=f"{url}/v1", api_key=CALLER_KEY) as openai,
        Anthropic(base_url=url, api_key=CALLER_KEY) as claude,
    ):
        before = _since(mocks)
        with pytest.raises(InternalServerError) as chat:
            openai.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
        after_chat = _since(mocks)
        with pytest.raises(anthropic.InternalServerError) as message:
            claude.messages.create(model="claude-sonnet-5", max_tokens=64, messages=MESSAGES)
        after_message = _since(mocks)
    assert chat.value.status_code == 502 and message.value.status_code == 502
    assert after_chat == (before[0] + 1, before[1])
    assert after_message == (before[0] + 2, before[1])
    assert chat.value.response.headers["x-should-retry"] == "false"


IDEMPOTENT_ROUTES = """
[upstreams.primary]
url = "{primary}"
[upstreams.backup]
url = "{backup}"
[upstreams.claude_primary]
url = "{primary}"
auth_header = "x-api-key"
auth_scheme = ""
[upstreams.claude_backup]
url = "{backup}"
auth_header = "x-api-key"
auth_scheme = ""
[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retries = 1
replay_with_idempotency_key = true   # POST is not in replayable_methods
[[routes]]
id = "messages"
prefix = "/v1/messages"
plan = ["claude_primary", "claude_backup"]
retries = 1
replay_with_idempotency_key = true
"""


def test_sdks_with_an_idempotency_key_fail_over_and_without_one_do_not(
    gateway: Running, tmp_path: Path
) -> None:
    mocks = gateway.mocks
    config = tmp_path / "gateway.toml"
    config.write_text(
        IDEMPOTENT_ROUTES.format(primary=mocks.primary.url, backup=mocks.backup.url),
        encoding="utf-8",
    )
    with (
        serving(config, dict(os.environ)) as url,
        OpenAI(base_url=f"{url}/v1", api_key=CALLER_KEY, max_retries=0) as openai,
        Anthropic(base_url=url, api_key=CALLER_KEY, max_retries=0) as claude,
    ):
        before = _since(mocks)
        keyed = openai.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=MESSAGES, extra_headers={"Idempotency-Key": "chat-1"}
        )
        with claude.messages.stream(
            model="claude-sonnet-5",
            max_tokens=64,
            messages=MESSAGES,
            extra_headers={"Idempotency-Key": "msg-1"},
        ) as stream:
            streamed = "".join(stream.text_stream)
        after_keyed = _since(mocks)
        with pytest.raises(InternalServerError) as unkeyed:
            openai.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert keyed.headers["x-gateway-provider"] == "backup"
    assert keyed.parse().choices[0].message.content == REPLY
    assert streamed.strip() == REPLY
    # Both attempts of each keyed request carried the caller's key, unchanged.
    assert mocks.primary.idempotency_keys[before[0] : after_keyed[0]] == ["chat-1", "msg-1"]
    assert mocks.backup.idempotency_keys[before[1] : after_keyed[1]] == ["chat-1", "msg-1"]
    # Without the header the POST is not replayable: 502, the backup never asked.
    assert unkeyed.value.status_code == 502
    assert len(mocks.backup.requests) == after_keyed[1]
