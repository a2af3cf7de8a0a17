"""A hostile upstream's usage report, read as the OpenAI and Anthropic SDKs read it: the
budget is charged the usage a client's SDK sees, whatever spelling, framing or trailing
event the upstream uses to make the gateway read less (or more)."""

from __future__ import annotations

import json
import math
from decimal import Decimal

import pytest
from aiohttp import web

from fallback_mw import Gateway
from tests.helpers import client_for
from tests.test_budget_guard import gateway_config, status_of
from tests.upstreams import Handler, host_app, upstream

pytestmark = pytest.mark.anyio

ENGINES = ["aiohttp", "httpx"]
# 10 input tokens at 1000/Mtok + 20,000 output tokens at 2000/Mtok.
FULL_COST = Decimal("40.01")


def answering(body: bytes, content_type: str) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        return web.Response(body=body, headers={"content-type": content_type})

    return handle


async def charged_for(body: bytes, content_type: str, engine: str) -> Decimal:
    async with upstream(answering(body, content_type)) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1000")
        conf["gateway"]["engine"] = engine
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=b'{"model":"gpt-test"}')
            assert response.status_code == 200
            assert response.content == body  # relayed as it came
            spent, held = await status_of(gateway)
            assert held == 0
            return spent
        finally:
            await gateway.aclose()


async def sdk_output_tokens(
    body: bytes, engine: str, content_type: str = "text/event-stream", *, stream: bool = True
) -> int | None:
    """The completion tokens the openai SDK reads from this answer through the gateway,
    having asked for a stream (or not)."""
    import openai

    async with upstream(answering(body, content_type)) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1000")
        conf["gateway"]["engine"] = engine
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as http:
                client = openai.AsyncOpenAI(
                    base_url="http://gw/v1", api_key="unused", http_client=http, max_retries=0
                )
                if not stream:
                    answer = await client.chat.completions.create(model="gpt-test", messages=[])
                    return None if answer.usage is None else answer.usage.completion_tokens
                chunks = await client.chat.completions.create(
                    model="gpt-test", messages=[], stream=True
                )
                tokens = None
                async for chunk in chunks:
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                return tokens
        finally:
            await gateway.aclose()


def sse(*events: bytes, end: bytes = b"\n") -> bytes:
    return b"".join(b"data: " + event + end + end for event in events)


USAGE = json.dumps(
    {"model": "gpt-test", "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 20000}}
).encode()
CHUNK = json.dumps({"model": "gpt-test", "choices": [{"index": 0, "delta": {"content": "hi"}}]})


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("count", ["20000.0", "2e4", '"20000"'])
async def test_a_token_count_spelled_as_a_number_a_lenient_reader_takes_is_charged(
    engine: str, count: str
) -> None:
    # The SDKs' validated models (pydantic, lax) read 20000.0, 2e4 and "20000" as 20000;
    # the meter read none of them and charged the input tokens alone (0.01 of 40.01).
    body = b'{"model":"gpt-test","usage":{"prompt_tokens":10,"completion_tokens":%s}}' % (
        count.encode()
    )
    assert await charged_for(body, "application/json", engine) == FULL_COST


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("end", [b"\r", b"\r\n", b"\n"], ids=["CR", "CRLF", "LF"])
async def test_an_sse_stream_is_charged_whichever_line_ending_frames_it(
    engine: str, end: bytes
) -> None:
    # SSE ends a line at CRLF, LF or a lone CR (the SDKs' decoders take all three); a
    # stream framed with CR was read as one endless line and settled at the hold (0.01).
    body = sse(CHUNK.encode(), USAGE, b"[DONE]", end=end)
    assert await sdk_output_tokens(body, engine) == 20000
    assert await charged_for(body, "text/event-stream", engine) == FULL_COST


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "after",
    [
        b'{"usage":{"prompt_tokens":0,"completion_tokens":0}}',
        # More than the client saw: a count only grows over one response, so only the
        # stop at [DONE] keeps it out (a hand-made mutant that read on passed every test).
        b'{"usage":{"prompt_tokens":10,"completion_tokens":90000}}',
    ],
    ids=["less", "more"],
)
async def test_usage_sent_after_done_is_not_read(engine: str, after: bytes) -> None:
    # The SDKs stop at `data: [DONE]`: a client sees 20,000 completion tokens. A usage
    # event the upstream adds after it (never seen by any client) set the charge to 0.
    body = sse(CHUNK.encode(), USAGE, b"[DONE]", after)
    assert await sdk_output_tokens(body, engine) == 20000
    assert await charged_for(body, "text/event-stream", engine) == FULL_COST


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_large_answer_whose_usage_has_details_is_charged(engine: str) -> None:
    # Over the 1 MiB JSON cap only the tail is searched; OpenAI's usage nests
    # `prompt_tokens_details` / `completion_tokens_details`, which the tail search could not
    # read: a caller asking for a long answer (n=20, no max_tokens) was charged the hold.
    answer = {
        "model": "gpt-test",
        "choices": [{"index": 0, "message": {"content": "x" * 1_200_000}}],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 20000,
            "total_tokens": 20010,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
    }
    body = json.dumps(answer).encode()
    assert await charged_for(body, "application/json", engine) == FULL_COST


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_stream_event_too_large_to_parse_is_still_charged_its_usage(engine: str) -> None:
    # The Responses API's final `response.completed` event carries the whole response,
    # the caller's `instructions` echoed in it: a caller sending 1.2 MB of instructions
    # (a body over replay_buffer: the hold is default_hold) made that event too large to
    # parse, and the request was settled at the 0.01 hold.
    completed = {
        "type": "response.completed",
        "response": {
            "model": "gpt-test",
            "instructions": "x" * 1_200_000,
            "output": [],
            "usage": {
                "input_tokens": 10,
                "output_tokens": 20000,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        },
    }
    event = json.dumps(completed).encode()
    body = b"event: response.completed\ndata: " + event + b"\n\n"
    assert await charged_for(body, "text/event-stream", engine) == FULL_COST


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_later_event_reporting_fewer_tokens_does_not_lower_the_charge(
    engine: str,
) -> None:
    # Anthropic's stream: `message_start` (input), `message_delta` (cumulative output).
    # A hostile upstream adds an event the anthropic SDK skips (an unknown `event:` name)
    # whose usage says 0: read last-wins, it settled the request at its input alone. A
    # count only grows over a stream: the largest reported is charged.
    start = (
        b'{"type":"message_start","message":{"model":"gpt-test",'
        b'"usage":{"input_tokens":10,"output_tokens":1}}}'
    )
    delta = b'{"type":"message_delta","usage":{"output_tokens":20000}}'
    zero = b'{"type":"message_delta","usage":{"input_tokens":0,"output_tokens":0}}'
    body = (
        b"event: message_start\ndata: " + start + b"\n\n"
        b"event: message_delta\ndata: " + delta + b"\n\n"
        b"event: ping_usage\ndata: " + zero + b"\n\n"
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    assert await charged_for(body, "text/event-stream", engine) == FULL_COST


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("content_type", ["text/plain", "text/plain; charset=utf-8", ""])
async def test_a_json_answer_labelled_as_text_is_charged_its_usage(
    engine: str, content_type: str
) -> None:
    # The openai SDK parses an answer as JSON whatever its content type says: an upstream
    # labelling it `text/plain` (or not at all) was settled at the 0.01 hold.
    answer = {
        "model": "gpt-test",
        "choices": [],
        "usage": {"prompt_tokens": 10, "completion_tokens": 20000},
    }
    assert await charged_for(json.dumps(answer).encode(), content_type, engine) == FULL_COST


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "content_type",
    ["application/octet-stream", "text/html", "text/json", "text/event-stream", "image/png"],
)
async def test_a_json_answer_under_any_label_is_charged_its_usage(
    engine: str, content_type: str
) -> None:
    # The SDKs parse a non-streamed answer as JSON whatever its content type (openai's and
    # anthropic's _response.py: any label not ending in "json" is still tried as JSON): an
    # upstream labelling it application/octet-stream, text/html or even text/event-stream
    # was settled at the 0.01 hold while the client read 20,000 completion tokens.
    answer = json.dumps(
        {
            "model": "gpt-test",
            "choices": [],
            "usage": {"prompt_tokens": 10, "completion_tokens": 20000},
        }
    ).encode()
    assert await sdk_output_tokens(answer, engine, content_type, stream=False) == 20000
    assert await charged_for(answer, content_type, engine) == FULL_COST


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "content_type", ["application/json", "text/plain", "application/octet-stream"]
)
async def test_an_event_stream_under_any_label_is_charged_its_usage(
    engine: str, content_type: str
) -> None:
    # An SDK that asked for a stream reads the answer as SSE whatever its content type: a
    # stream labelled application/json was parsed as one JSON document, failed, and was
    # settled at the hold.
    body = sse(CHUNK.encode(), USAGE, b"[DONE]")
    assert await sdk_output_tokens(body, engine, content_type) == 20000
    assert await charged_for(body, content_type, engine) == FULL_COST


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_binary_answer_is_relayed_and_settled_at_the_hold(engine: str) -> None:
    # Audio, images: not metered (no SDK reads usage from them): the hold is charged.
    body = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 64
    assert await charged_for(body, "image/png", engine) == Decimal("0.01")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("digits", [41, 5001])
async def test_an_absurd_token_count_is_charged_the_largest_amount(
    engine: str, digits: int
) -> None:
    # docs/budgets.md: an upstream reporting 10^40 tokens is charged the largest amount.
    # One reporting 10^5000 was charged the 0.01 hold: Python refuses to read an integer of
    # over 4,300 digits, so the whole answer read as no usage at all.
    count = b"1" + b"0" * (digits - 1)
    body = b'{"model":"gpt-test","usage":{"prompt_tokens":%s,"completion_tokens":3}}' % count
    assert await charged_for(body, "application/json", engine) == Decimal(1_000_000_000)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("count", [b"1e400", b"Infinity"])
async def test_a_count_that_reads_as_infinity_is_charged_the_largest_amount(
    engine: str, count: bytes
) -> None:
    # JSON's 1e400 (and Python's `Infinity`) read as an infinite float: the SDK hands the
    # caller `completion_tokens == inf`, but the meter dropped the count as unreadable and
    # charged the input tokens alone, where 1e300 or 10^40 is charged the largest amount.
    body = b'{"model":"gpt-test","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%s}}'
    body %= count
    assert await sdk_output_tokens(body, engine, "application/json", stream=False) == math.inf
    assert await charged_for(body, "application/json", engine) == Decimal(1_000_000_000)
    assert await charged_for(sse(body), "text/event-stream", engine) == Decimal(1_000_000_000)


ANTHROPIC_CACHED_JSON = (
    b'{"type":"message","model":"gpt-test","content":[],"usage":{"input_tokens":10,'
    b'"cache_creation_input_tokens":100000,"cache_read_input_tokens":20000,'
    b'"output_tokens":20000}}'
)
ANTHROPIC_CACHED_SSE = (
    b'event: message_start\ndata: {"type":"message_start","message":{"model":"gpt-test",'
    b'"usage":{"input_tokens":10,"cache_creation_input_tokens":100000,'
    b'"cache_read_input_tokens":20000,"output_tokens":1}}}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":20000}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


@pytest.mark.parametrize(
    ("body", "content_type"),
    [(ANTHROPIC_CACHED_JSON, "application/json"), (ANTHROPIC_CACHED_SSE, "text/event-stream")],
    ids=["json", "sse"],
)
async def test_anthropic_cache_tokens_are_charged_as_input(body: bytes, content_type: str) -> None:
    # Anthropic's input_tokens leaves out the prompt it wrote to or read from its cache
    # (cache_creation_input_tokens, billed at 1.25x the input price; cache_read_input_tokens
    # at 0.1x): a caller marking a 120,000-token prompt cache_control was charged for 10
    # input tokens (40.01) where the provider bills for 120,010 of them.
    assert await charged_for(body, content_type, "aiohttp") == FULL_COST + Decimal("120")


GEMINI_USAGE = b'"usageMetadata":{"promptTokenCount":10,"candidatesTokenCount":15000,'
GEMINI_USAGE += b'"thoughtsTokenCount":5000,"totalTokenCount":20010}'
GEMINI_CHUNK = b'{"candidates":[{"content":{"parts":[{"text":"hi"}],"role":"model"}}],'
GEMINI_JSON = GEMINI_CHUNK + GEMINI_USAGE + b',"modelVersion":"gpt-test-001"}'
# A stream reports the prompt in its first chunk, the whole usage in its last; `alt=sse`
# frames chunks with CRLF, without it the chunks are one JSON array.
GEMINI_FIRST = GEMINI_CHUNK + b'"usageMetadata":{"promptTokenCount":10,"totalTokenCount":10}}'
GEMINI_SSE = b"data: " + GEMINI_FIRST + b"\r\n\r\ndata: " + GEMINI_JSON + b"\r\n\r\n"
GEMINI_ARRAY = b"[" + GEMINI_FIRST + b",\r\n" + GEMINI_JSON + b"]"
# An image model's answer: its inline image makes it larger than the meter parses whole.
GEMINI_IMAGE = (
    b'{"candidates":[{"content":{"parts":[{"inlineData":{"mimeType":"image/png","data":"'
    + b"A" * 2_000_000
    + b'"}}]}}],'
    + GEMINI_USAGE
    + b"}"
)
OLLAMA_LAST = b'{"model":"gpt-test","message":{"role":"assistant","content":""},"done":true,'
OLLAMA_LAST += b'"prompt_eval_count":10,"eval_count":20000}'
OLLAMA_LINE = b'{"model":"gpt-test","message":{"role":"assistant","content":"Hi"},"done":false}'
OLLAMA_NDJSON = OLLAMA_LINE + b"\n" + OLLAMA_LAST + b"\n"
# A long generation: more lines than the meter parses whole (json_cap, 1 MiB).
OLLAMA_LONG = (OLLAMA_LINE + b"\n") * 20_000 + OLLAMA_LAST + b"\n"
# Lines that report running counts before the last, whole one: the last line that reports
# is read (a hand-made mutant that read the first such line passed every test).
OLLAMA_RUNNING = OLLAMA_LINE + b"\n"
OLLAMA_RUNNING += b'{"model":"gpt-test","done":false,"prompt_eval_count":10,"eval_count":1}\n'
OLLAMA_RUNNING += OLLAMA_LAST + b"\n"


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (GEMINI_JSON, "application/json; charset=UTF-8"),
        (GEMINI_SSE, "text/event-stream"),
        (GEMINI_ARRAY, "application/json; charset=UTF-8"),
        (GEMINI_IMAGE, "application/json; charset=UTF-8"),
        (OLLAMA_LAST, "application/json; charset=utf-8"),
        (OLLAMA_NDJSON, "application/x-ndjson"),
        (OLLAMA_LONG, "application/x-ndjson"),
        (OLLAMA_RUNNING, "application/x-ndjson"),
    ],
    ids=[
        "gemini-json",
        "gemini-sse",
        "gemini-array",
        "gemini-large",
        "ollama-json",
        "ollama-ndjson",
        "ollama-long",
        "ollama-running",
    ],
)
async def test_gemini_and_ollama_usage_is_charged(body: bytes, content_type: str) -> None:
    # Gemini / Vertex AI report usageMetadata (thinking tokens billed as output), Ollama's
    # own API prompt_eval_count / eval_count: neither was read, so every such request was
    # charged its hold (default_hold, 0.01) whatever it used, and counted no tokens for tpm.
    assert await charged_for(body, content_type, "aiohttp") == FULL_COST


async def test_a_gemini_request_is_priced_as_the_model_version_its_answer_names() -> None:
    # Gemini names the model in the path, not the body: the answer's modelVersion prices it.
    async with upstream(answering(GEMINI_JSON, "application/json")) as primary:
        gateway = Gateway(
            host_app, config=gateway_config({"primary": primary.url}, store=None, limit="1000")
        )
        try:
            async with client_for(gateway) as client:
                response = await client.post(
                    "/v1/models/gemini-x:generateContent", content=b'{"contents":[]}'
                )
            assert response.status_code == 200
            assert await status_of(gateway) == (FULL_COST, 0)
        finally:
            await gateway.aclose()


async def test_bedrock_converse_usage_is_charged_with_its_cache_tokens() -> None:
    # AWS Bedrock's Converse API (reachable with a Bedrock API key as a bearer token) spells
    # usage inputTokens / outputTokens: it was not read, and every answer was charged its
    # hold. Its inputTokens leaves out the cached prompt, as Anthropic's input_tokens does.
    body = (
        b'{"output":{"message":{"role":"assistant","content":[{"text":"hi"}]}},'
        b'"stopReason":"end_turn","usage":{"inputTokens":10,"outputTokens":20000,'
        b'"cacheReadInputTokens":20000,"cacheWriteInputTokens":100000,"totalTokens":140010}}'
    )
    assert await charged_for(body, "application/json", "aiohttp") == FULL_COST + Decimal("120")


async def test_a_json_array_of_past_requests_usage_is_not_charged() -> None:
    # Only Gemini's stream is read from a JSON array (its usageMetadata): a listing of
    # records that each carry a `usage` is no usage of the request that fetched it.
    listing = b'[{"id":"r1","usage":{"prompt_tokens":10,"completion_tokens":20000}}]'
    assert await charged_for(listing, "application/json", "aiohttp") == Decimal("0.01")


async def test_groq_stream_usage_in_x_groq_is_charged() -> None:
    # Groq's OpenAI-shaped stream reports usage in its last chunk's `x_groq`, not `usage`:
    # a streamed Groq answer was charged its hold whatever it used.
    last = (
        b'{"id":"c1","object":"chat.completion.chunk","model":"gpt-test","choices":[{"index":0,'
        b'"delta":{},"finish_reason":"stop"}],"x_groq":{"id":"req_1","usage":{"queue_time":0.01,'
        b'"prompt_tokens":10,"completion_tokens":20000,"total_tokens":20010}}}'
    )
    body = b"data: " + last + b"\n\ndata: [DONE]\n\n"
    assert await charged_for(body, "text/event-stream", "aiohttp") == FULL_COST
