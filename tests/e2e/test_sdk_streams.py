"""Streamed answers as an application team meets them: the real `openai` SDK reading a
chat-completions stream from the Gateway on a real uvicorn socket, in front of a local
upstream that streams like the real API (SSE chunks, the usage chunk of
`stream_options.include_usage`, `data: [DONE]`)."""

from __future__ import annotations

import asyncio
import json
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiohttp import web
from openai import OpenAI

from fallback_mw import Gateway
from fallback_mw.cli import main
from tests.test_budget_guard import status_of
from tests.upstreams import host_app, serve_asgi, upstream

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

USAGE = {"prompt_tokens": 11, "completion_tokens": 20, "total_tokens": 31}


def chat_stream(*, after_done: float) -> Any:
    """An OpenAI chat-completions stream with usage, whose body ends `after_done` seconds
    after `data: [DONE]` (a provider, or a proxy in front of it, that closes the stream a
    moment after its last event: the terminating chunk travels on its own)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        base = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": body["model"]}

        async def event(fields: dict[str, Any]) -> None:
            await response.write(b"data: " + json.dumps({**base, **fields}).encode() + b"\n\n")

        await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for word in ("Hello", " there"):
            await event({"choices": [{"index": 0, "delta": {"content": word}}]})
        await event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        await event({"choices": [], "usage": USAGE})
        await response.write(b"data: [DONE]\n\n")
        await asyncio.sleep(after_done)
        await response.write_eof()
        return response

    return handle


async def settled(gateway: Gateway) -> None:
    """Until nothing is held: the settlement runs once the relay has ended."""
    for _ in range(250):
        if not (await status_of(gateway))[1]:
            return
        await anyio.sleep(0.02)
    raise AssertionError("the hold was never settled")


def config(primary: str, store: str) -> dict[str, Any]:
    return {
        "gateway": {"store": store, "deadline_ms": 10_000},
        "upstreams": {"primary": {"url": primary}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"], "budget": "acme"}],
        "budgets": {"acme": {"limit": "100", "window": "month", "default_hold": "0.01"}},
        "prices": {"gpt-test": {"input_per_mtok": "1000", "output_per_mtok": "2000"}},
    }


async def test_a_stream_the_sync_sdk_closes_after_done_is_charged_its_reported_usage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The sync openai SDK closes the response as soon as it reads `data: [DONE]`. When the
    # upstream's end of body came a moment after that event, the gateway saw the client
    # leave "mid-stream": the answer, whole with its usage, was recorded
    # client_disconnected and charged its hold (max_tokens 4000: 8.0) instead of the
    # 0.051 its 11 + 20 tokens cost.
    store = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with upstream(chat_stream(after_done=0.5)) as primary:
        gateway = Gateway(host_app, config=config(primary.url, store))
        try:
            async with serve_asgi(gateway) as url:

                def read() -> tuple[str, Any]:
                    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
                    stream = client.chat.completions.create(
                        model="gpt-test",
                        messages=[{"role": "user", "content": "Say hello"}],
                        max_tokens=4000,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                    text, usage = "", None
                    for chunk in stream:
                        if chunk.choices:
                            text += chunk.choices[0].delta.content or ""
                        usage = chunk.usage or usage
                    client.close()
                    return text, usage

                with anyio.fail_after(10):
                    text, usage = await anyio.to_thread.run_sync(read)
                assert text == "Hello there"
                assert usage is not None and usage.completion_tokens == 20
                await settled(gateway)
                # 11 input tokens at 1000 / Mtok, 20 output tokens at 2000 / Mtok.
                assert await status_of(gateway) == (Decimal("0.051"), Decimal(0))
        finally:
            await gateway.aclose()
    capsys.readouterr()
    assert await anyio.to_thread.run_sync(main, ["usage", "--store", store, "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert record["outcome"] == "served"
    assert Decimal(record["charged"]) == Decimal("0.051")


async def test_streams_the_sync_sdk_closes_after_done_count_their_reported_tokens_in_tpm(
    tmp_path: Path,
) -> None:
    # The same close at `[DONE]` left each answer's estimate (its max_tokens, 2000) counted
    # against the upstream's declared tpm instead of the 31 tokens it reported: the third
    # sequential request of a team with tpm = 5000 was refused 503 route_exhausted
    # (`capacity`), the upstream having served 93 tokens that minute.
    async with upstream(chat_stream(after_done=0.3)) as primary:
        conf = config(primary.url, f"sqlite:///{tmp_path / 'ledger.db'}")
        conf["upstreams"]["primary"]["tpm"] = 5000
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as url:

                def read() -> list[str]:
                    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
                    served = []
                    for _ in range(4):
                        stream = client.chat.completions.create(
                            model="gpt-test",
                            messages=[{"role": "user", "content": "Say hello"}],
                            max_tokens=2000,
                            stream=True,
                            stream_options={"include_usage": True},
                        )
                        served.append(
                            "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                        )
                        time.sleep(0.5)  # the gateway has seen the client go
                    client.close()
                    return served

                with anyio.fail_after(20):
                    served = await anyio.to_thread.run_sync(read)
                assert served == ["Hello there"] * 4
        finally:
            await gateway.aclose()


async def test_a_stream_the_sync_sdk_closes_after_done_is_shadowed(tmp_path: Path) -> None:
    # A route shadowing every session to a candidate under evaluation: the copies of
    # answers the sync openai SDK read to `[DONE]` (and closed there, before the upstream's
    # end of body) were never sent, so the candidate saw a fraction of the slice.
    async with (
        upstream(chat_stream(after_done=0.3)) as primary,
        upstream(chat_stream(after_done=0)) as candidate,
    ):
        conf = config(primary.url, f"sqlite:///{tmp_path / 'ledger.db'}")
        conf["upstreams"]["candidate"] = {"url": candidate.url}
        conf["routes"][0].update(
            {"shadow": "candidate", "shadow_percent": 100, "replayable_methods": ["POST"]}
        )
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as url:

                def read() -> str:
                    client = OpenAI(
                        base_url=f"{url}/v1",
                        api_key="unused",
                        max_retries=0,
                        default_headers={"x-session-id": "s1"},
                    )
                    stream = client.chat.completions.create(
                        model="gpt-test",
                        messages=[{"role": "user", "content": "Say hello"}],
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                    client.close()
                    return text

                with anyio.fail_after(10):
                    assert await anyio.to_thread.run_sync(read) == "Hello there"
                for _ in range(100):
                    if candidate.count:
                        break
                    await anyio.sleep(0.05)
                assert candidate.count == 1
        finally:
            await gateway.aclose()


async def test_an_sdk_closing_mid_stream_closes_the_upstream_connection_at_once(
    tmp_path: Path,
) -> None:
    # What held (docs/failover.md "Client disconnects"): the SDK's close() mid-answer
    # reaches the upstream as a closed connection within a second, the hold settles as a
    # cut-short answer, and no pooled connection to the upstream is left behind.
    gone = anyio.Event()
    clock: dict[str, float] = {}

    async def long_answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        try:
            for index in range(3000):  # a minute of tokens
                chunk = {"choices": [{"index": 0, "delta": {"content": f"t{index} "}}]}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await asyncio.sleep(0.02)
        except (ConnectionError, asyncio.CancelledError):  # aiohttp cancels the handler
            clock["gone"] = time.monotonic()
            gone.set()
            raise
        return response

    store = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with upstream(long_answer) as primary:
        gateway = Gateway(host_app, config=config(primary.url, store))
        try:
            async with serve_asgi(gateway) as url:

                def read_a_little() -> None:
                    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
                    stream = client.chat.completions.create(
                        model="gpt-test",
                        messages=[{"role": "user", "content": "Say hello"}],
                        max_tokens=4000,
                        stream=True,
                    )
                    for index, _ in enumerate(stream):
                        if index == 5:
                            break
                    clock["closed"] = time.monotonic()
                    stream.close()
                    client.close()

                with anyio.fail_after(10):
                    await anyio.to_thread.run_sync(read_a_little)
                    await gone.wait()
                assert clock["gone"] - clock["closed"] < 1.0
                await settled(gateway)
                # Cut short, no usage reported: the hold (4000 output tokens: 8.0, + input).
                assert await status_of(gateway) == (Decimal("8.026"), Decimal(0))
        finally:
            await gateway.aclose()
