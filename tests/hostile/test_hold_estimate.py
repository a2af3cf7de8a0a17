"""A caller's body crafted to get a tiny hold for a huge generation: the hold prices every
completion the upstream will generate and bill, not one."""

from __future__ import annotations

import codecs
import gzip
import json
import re
import zlib
from collections.abc import Callable
from decimal import Decimal

import pytest
from aiohttp import web
from pydantic import TypeAdapter

from fallback_mw import Gateway
from tests.helpers import client_for
from tests.test_budget_guard import gateway_config, json_handler, status_of
from tests.upstreams import host_app, upstream

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "copies",
    [
        {"n": 128},  # chat / completions: 128 choices, each up to max_tokens, all billed
        {"n": "128"},  # read as a lenient upstream reads it
        {"best_of": 20, "n": 1},  # legacy completions: 20 generated server-side, billed
        {"prompt": ["a"] * 64, "n": 2},  # a batch of 64 prompts, two completions each
    ],
    ids=["n", "n-string", "best_of", "prompt-batch"],
)
async def test_a_request_for_many_completions_is_held_for_all_of_them(
    copies: dict[str, object],
) -> None:
    # 1,000 output tokens at 2000/Mtok is 2.00 a completion; the budget has 30. One
    # completion's hold (2.00) fitted, so 15 such requests in flight could each generate
    # 128 completions (256.00 each, 3,840 against a limit of 30) before any settled.
    body = json.dumps({"model": "gpt-test", "max_tokens": 1000, **copies}).encode()
    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="30")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=body)
                assert response.status_code == 402
                assert response.json()["error"]["code"] == "budget_exceeded"
                # One completion of the same size is held and served as before.
                one = json.dumps({"model": "gpt-test", "max_tokens": 1000, "n": 1})
                assert (await client.post("/v1/chat", content=one)).status_code == 200
            assert await status_of(gateway) == (Decimal(2) + Decimal("0.013"), 0)
        finally:
            await gateway.aclose()
    assert len(primary.received) == 1  # the refused request reached no upstream


@pytest.mark.parametrize(
    "spelling",
    ["+1000", "1_000", "1000.0", "0000000000000000001000", " +1_000.00 "],
)
@pytest.mark.parametrize("key", ["max_tokens", "n"])
async def test_an_integer_string_a_lax_upstream_reads_is_held_as_that_integer(
    spelling: str, key: str
) -> None:
    # pydantic's lax mode (vLLM's request models, the SDKs') reads each spelling as 1,000;
    # the hold read them as "limits nothing" and took default_hold (0.01): a caller held
    # 0.01 for a generation of 2.00 (or 1,000 completions) against a limit of 1.
    assert TypeAdapter(int).validate_python(spelling) == 1000
    fields: dict[str, object] = {"model": "gpt-test", "max_tokens": 1000}
    fields[key] = spelling
    if key == "n":
        fields["max_tokens"] = 1  # 1,000 completions of 1 token: 2.00 as well
    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=json.dumps(fields).encode())
                assert response.status_code == 402, response.text
                assert response.json()["error"]["code"] == "budget_exceeded"
            assert await status_of(gateway) == (Decimal(0), Decimal(0))
        finally:
            await gateway.aclose()
    assert len(primary.received) == 0


@pytest.mark.parametrize(
    "encode",
    [
        lambda text: codecs.BOM_UTF8 + text.encode(),
        lambda text: text.encode("utf-16"),  # with its BOM
        lambda text: text.encode("utf-16-be"),
        lambda text: text.encode("utf-32"),
    ],
    ids=["utf-8-bom", "utf-16", "utf-16-be", "utf-32"],
)
async def test_a_json_body_with_a_byte_order_mark_or_in_utf16_is_held_as_json(
    encode: Callable[[str], bytes],
) -> None:
    # Starlette / FastAPI (vLLM) read a request as `json.loads` reads bytes, which takes a
    # byte-order mark and UTF-16 / UTF-32: the upstream generated max_tokens while the hold
    # read "not JSON" and took default_hold (0.01 for 2.00 against a limit of 1).
    body = encode(json.dumps({"model": "gpt-test", "max_tokens": 1000}))
    assert json.loads(body)["max_tokens"] == 1000  # what the upstream reads
    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post(
                    "/v1/chat", content=body, headers={"content-type": "application/json"}
                )
                assert response.status_code == 402, response.text
            assert await status_of(gateway) == (Decimal(0), Decimal(0))
        finally:
            await gateway.aclose()
    assert len(primary.received) == 0


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
async def test_a_compressed_json_body_is_held_as_the_upstream_decodes_it(coding: str) -> None:
    # aiohttp's server (and Express's body-parser) decode a request's Content-Encoding
    # before reading the JSON: the upstream generated max_tokens while the hold read the
    # coded bytes as "not JSON" and took default_hold (0.01 for 2.00 against a limit of 1).
    def encode(data: bytes) -> bytes:
        return gzip.compress(data) if coding == "gzip" else zlib.compress(data)

    async def reads(request: web.Request) -> web.StreamResponse:
        return web.json_response({"read": json.loads(await request.read())})

    large = json.dumps({"model": "gpt-test", "max_tokens": 1000}).encode()
    small = json.dumps({"model": "gpt-test", "max_tokens": 100}).encode()
    headers = {"content-type": "application/json", "content-encoding": coding}
    async with upstream(reads) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=encode(large), headers=headers)
                assert response.status_code == 402, response.text
                assert primary.count == 0
                response = await client.post("/v1/chat", content=encode(small), headers=headers)
                assert response.status_code == 200, response.text
                assert response.json()["read"]["max_tokens"] == 100  # what the upstream read
            # No usage reported: charged the hold, priced from the decoded body (0.20 for
            # 100 output tokens, and its input), not default_hold.
            spent, held = await status_of(gateway)
            assert (spent > Decimal("0.2"), held) == (True, Decimal(0))
        finally:
            await gateway.aclose()


@pytest.mark.parametrize(
    "fields",
    [
        {"model": "gpt-test", "Max_Tokens": 1000},
        {
            "model": "gpt-test",
            "MAX_TOKENS": 1,
            "max_tokens": 1,
            "max_tokens ": 0,
            "Max_tokens": 1000,
        },
        {"model": "gpt-test", "max_token\u017f": 1000},  # Go folds U+017F to "s"
        {"model": "gpt-test", "max_tokens": 1, "N": 1000},
        {"Model": "gpt-test", "max_tokens": 1000},
    ],
    ids=["limit", "limit-spelt-twice", "long-s", "n", "model"],
)
async def test_a_key_in_another_case_is_held_as_a_case_insensitive_upstream_reads_it(
    fields: dict[str, object],
) -> None:
    # Go's encoding/json (Ollama, LocalAI) and ASP.NET read JSON keys in any case: such an
    # upstream generated `Max_Tokens` (or ran `Model`) while the hold saw no limit (or no
    # priced model) and took default_hold (0.01 for 2.00 against a limit of 1).
    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=json.dumps(fields).encode())
                assert response.status_code == 402, response.text
            assert await status_of(gateway) == (Decimal(0), Decimal(0))
        finally:
            await gateway.aclose()
    assert len(primary.received) == 0


@pytest.mark.parametrize("model", ["GPT-TEST", "Gpt-Test-2024-07-18"])
async def test_a_model_named_in_another_case_is_priced_as_that_model(model: str) -> None:
    # Ollama looks a model up in any case and echoes the caller's spelling in its answer:
    # "GPT-TEST" ran gpt-test, but the hold found no price (default_hold, 0.01, for a 2.00
    # generation against a limit of 1) and so did the settlement (charged the hold).
    async def echo(request: web.Request) -> web.StreamResponse:
        sent = await request.json()
        usage = {"prompt_tokens": 10, "completion_tokens": 400}
        return web.json_response({"model": sent["model"], "usage": usage})

    async with upstream(echo) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                big = {"model": model, "max_tokens": 1000, "messages": []}
                response = await client.post("/v1/chat", json=big)
                assert response.status_code == 402, response.text
                small = {"model": model, "max_tokens": 400, "messages": []}
                response = await client.post("/v1/chat", json=small)
                assert response.status_code == 200, response.text
            # 10 input tokens at 1000/Mtok, 400 output at 2000/Mtok: 0.81, not the 0.01 hold.
            assert await status_of(gateway) == (Decimal("0.81"), Decimal(0))
        finally:
            await gateway.aclose()
    assert len(primary.received) == 1


async def test_a_model_rewrite_leaves_no_other_spelling_of_the_model_key() -> None:
    # Go's encoding/json reads "Model" as "model" and keeps the last: a caller's "Model"
    # after "model" beat the candidate's rewrite, running a model the route never sends.
    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="30")
        conf["upstreams"]["primary"]["model"] = "gpt-test"
        gateway = Gateway(host_app, config=conf)
        try:
            body = {"model": "x", "Model": "dearest-model", "MODEL": "y", "max_tokens": 1}
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=json.dumps(body).encode())
                assert response.status_code == 200, response.text
        finally:
            await gateway.aclose()
    sent = json.loads(primary.received[0].body)
    assert sent == {"max_tokens": 1, "model": "gpt-test"}


@pytest.mark.parametrize("where", ["unread-field", "limit"])
async def test_a_body_with_an_integer_of_thousands_of_digits_is_held_as_json(where: str) -> None:
    # Python alone refuses an integer of over 4,300 digits: the hold read such a body as
    # "not JSON" and took default_hold (0.01 for 3.26 against a limit of 3), while Go's
    # encoding/json (Ollama, LocalAI) skips the number in a field it does not read and
    # Node's JSON.parse reads it as a float: either generated max_tokens.
    huge = "9" * 5000
    if where == "limit":  # the limit itself: read as the largest, as 10^40 is
        text = '{"model":"gpt-test","max_tokens":' + huge + "}"
    else:
        text = '{"model":"gpt-test","max_tokens":1000,"user_tag":' + huge + "}"
    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="3")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post(
                    "/v1/chat", content=text.encode(), headers={"content-type": "application/json"}
                )
                assert response.status_code == 402, response.text
                assert response.json()["error"]["code"] == "budget_exceeded"
                assert primary.count == 0
                if where == "unread-field":  # one that fits is sent as it came
                    fits = text.replace("1000", "100").encode()
                    response = await client.post("/v1/chat", content=fits)
                    assert response.status_code == 200, response.text
                    assert primary.received[0].body == fits
            spent, held = await status_of(gateway)
            # Charged the hold priced from the body (0.20 for 100 output tokens, 1.26 for
            # its 5,000 bytes), not default_hold.
            assert (spent > Decimal("1.4") or where == "limit", held) == (True, Decimal(0))
        finally:
            await gateway.aclose()


@pytest.mark.parametrize("charset", ["utf-7", '"UTF-7"', "utf-7-imap"])
async def test_a_body_declared_in_utf7_is_refused_on_a_budgeted_route(charset: str) -> None:
    # Express's body-parser decodes a JSON body by any `utf-*` charset it declares: in
    # UTF-7 `max+AF8-tokens` is `max_tokens`, so such an upstream generated 1,000 tokens
    # while the hold read an unknown key and took default_hold (0.01 for 2.00 against 1).
    body = b'{"model":"gpt-test","max+AF8-tokens":1000}'
    assert json.loads(body.decode("utf-7"))["max_tokens"] == 1000  # what Express reads
    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                declared = {"content-type": f"application/json; charset={charset}"}
                response = await client.post("/v1/chat", content=body, headers=declared)
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["code"] == "bad_request"
                assert "UTF-7" in error["message"] and "UTF-8" in error["message"]
                # The same body in UTF-8 (a `+` in its text) is served, and so is a UTF-7
                # body with nothing UTF-7 reads differently.
                plain = b'{"model":"gpt-test","max_tokens":1,"user":"a+b&c"}'
                utf8 = {"content-type": "application/json; charset=utf-8"}
                assert (await client.post("/v1/chat", content=plain, headers=utf8)).is_success
                ascii_only = b'{"model":"gpt-test","max_tokens":1}'
                response = await client.post("/v1/chat", content=ascii_only, headers=declared)
                assert response.status_code == 200, response.text
            assert primary.count == 2
        finally:
            await gateway.aclose()


@pytest.mark.parametrize("coding", [None, "gzip"])
async def test_a_body_nested_too_deep_to_estimate_is_refused_on_a_budgeted_route(
    coding: str | None,
) -> None:
    # Python's parser stops near 1,000 levels (3.11; 1,500 on 3.12, 10,000 on 3.13): the
    # hold read such a body as "not JSON" and took default_hold (0.01 for 2.00 against a
    # limit of 1), while Node's JSON.parse and Go's encoding/json (to 10,000 levels) read
    # it and generated max_tokens.
    def nested(depth: int) -> bytes:
        junk = b"[" * depth + b"]" * depth
        return b'{"model":"gpt-test","max_tokens":1000,"x":' + junk + b"}"

    headers = {"content-type": "application/json"}
    if coding is not None:
        headers["content-encoding"] = coding

    def encode(data: bytes) -> bytes:
        return data if coding is None else gzip.compress(data)

    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                deep = encode(nested(100_000))  # Python 3.13's parser reads about 10,000 levels
                response = await client.post("/v1/chat", content=deep, headers=headers)
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["code"] == "bad_request"
                assert "nested deeper" in error["message"]
                # Nested as deep as a real request is, it is estimated as before.
                response = await client.post(
                    "/v1/chat", content=encode(nested(50)), headers=headers
                )
                assert response.json()["error"]["code"] == "budget_exceeded"
            assert primary.count == 0
        finally:
            await gateway.aclose()


def parsed_depth() -> int:
    """How deeply json.loads nests arrays here, found by trying (the test's own measure)."""
    low, high = 1, 100_000
    while low < high:
        middle = (low + high + 1) // 2
        try:
            json.loads("[" * middle + "]" * middle)
        except RecursionError:
            high = middle - 1
        else:
            low = middle
    return low


async def test_the_too_deep_refusal_states_the_depth_this_python_reads() -> None:
    """The refusal said "about 1,000 levels", true on Python 3.11 only: 3.12's parser reads
    about 1,500, 3.13's about 10,000. The number it states is this interpreter's (within
    rounding and the frames the gateway's own calls take), and a body nested a tenth less
    deeply than it says is read and estimated, not refused."""

    def nested(depth: int) -> bytes:
        junk = b"[" * depth + b"]" * depth
        return b'{"model":"gpt-test","max_tokens":1000,"x":' + junk + b"}"

    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                deep = await client.post("/v1/chat", content=nested(200_000))
                message = deep.json()["error"]["message"]
                found = re.search(r"about ([0-9,]+) levels", message)
                assert found is not None, message
                stated = int(found.group(1).replace(",", ""))
                measured = parsed_depth()
                assert abs(stated - measured) <= measured // 10, (stated, measured)
                within = await client.post("/v1/chat", content=nested(stated * 9 // 10))
        finally:
            await gateway.aclose()
    assert deep.status_code == 400
    assert within.json()["error"]["code"] == "budget_exceeded", within.text
    assert primary.count == 0


@pytest.mark.parametrize("form", ["gzip", "deflate", "huge-integer"])
async def test_a_compressed_or_huge_integer_body_counts_its_output_limit_against_tpm(
    form: str,
) -> None:
    # The tpm estimate read only the body as sent: gzip (or an integer of thousands of
    # digits) hid max_tokens=100000 and counted a few bytes' worth against tpm = 2000,
    # so the candidate was sent what a plain body of the same request is refused there for
    # (the budget's hold already read such a body as the upstream does).
    plain = json.dumps({"model": "gpt-test", "max_tokens": 100_000}).encode()
    headers = {"content-type": "application/json"}
    if form == "huge-integer":
        body = plain[:-1] + b',"x":' + b"9" * 5000 + b"}"
    else:
        body = gzip.compress(plain) if form == "gzip" else zlib.compress(plain)
        headers["content-encoding"] = form
    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, budget=None)
        conf["upstreams"]["primary"]["tpm"] = 2000
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=body, headers=headers)
                assert response.status_code == 503, response.text
                assert "primary (capacity) skipped" in response.json()["error"]["message"]
                # One within tpm is sent as before.
                small = json.dumps({"model": "gpt-test", "max_tokens": 10}).encode()
                if form != "huge-integer":
                    small = gzip.compress(small) if form == "gzip" else zlib.compress(small)
                response = await client.post("/v1/chat", content=small, headers=headers)
                assert response.status_code == 200, response.text
            assert primary.count == 1
        finally:
            await gateway.aclose()


@pytest.mark.parametrize("stray", [b"\xff", b"\xe9"], ids=["ff", "latin1"])
async def test_a_body_with_bytes_that_are_not_utf8_is_held_as_a_go_or_node_upstream_reads_it(
    stray: bytes,
) -> None:
    # Go's encoding/json (Ollama, LocalAI) and Express read bytes that are not UTF-8 in a
    # string as U+FFFD and run the request; `json.loads` refuses the body, so the hold
    # read "not JSON" and took default_hold (0.01 for 2.00 against a limit of 1).
    def body(limit: int) -> bytes:
        return b'{"model":"gpt-test","max_tokens":%d,"user":"a%sb"}' % (limit, stray)

    assert json.loads(body(1000).decode("utf-8", "replace"))["max_tokens"] == 1000
    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                headers = {"content-type": "application/json"}
                response = await client.post("/v1/chat", content=body(1000), headers=headers)
                assert response.status_code == 402, response.text
                assert primary.count == 0
                response = await client.post("/v1/chat", content=body(10), headers=headers)
                assert response.status_code == 200, response.text
                assert primary.received[0].body == body(10)  # sent as it came
            spent, held = await status_of(gateway)
            assert (spent > Decimal("0.02"), held) == (True, Decimal(0))  # not default_hold
        finally:
            await gateway.aclose()


@pytest.mark.parametrize(
    "after",
    [b"garbage", b'\n{"model":"gpt-test","max_tokens":1}\n', b"]"],
    ids=["garbage", "jsonl", "bracket"],
)
async def test_a_body_with_data_after_its_object_is_held_as_a_go_decoder_reads_it(
    after: bytes,
) -> None:
    # Go's json.Decoder reads a request's first JSON value and leaves the rest (gin's
    # ShouldBindJSON: Ollama, many Go gateways): such an upstream generated max_tokens
    # while `json.loads` refused the body ("Extra data") and the hold took default_hold
    # (0.01 for 2.00 against a limit of 1).
    def body(limit: int) -> bytes:
        return b'{"model":"gpt-test","max_tokens":%d}' % limit + after

    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                headers = {"content-type": "application/json"}
                response = await client.post("/v1/chat", content=body(1000), headers=headers)
                assert response.status_code == 402, response.text
                assert primary.count == 0
                response = await client.post("/v1/chat", content=body(10), headers=headers)
                assert response.status_code == 200, response.text
                assert primary.received[0].body == body(10)  # sent as it came
            spent, held = await status_of(gateway)
            assert (spent > Decimal("0.02"), held) == (True, Decimal(0))  # not default_hold
        finally:
            await gateway.aclose()


@pytest.mark.parametrize(
    "config",
    [
        {"generationConfig": {"maxOutputTokens": 1000, "candidateCount": 8}},
        {"generation_config": {"max_output_tokens": 1000, "candidate_count": 8}},
    ],
    ids=["camelCase", "snake_case"],
)
async def test_a_gemini_request_is_held_for_its_path_model_and_generation_config(
    config: dict[str, object],
) -> None:
    # Gemini names the model in the path and its output limit in generationConfig: every
    # generateContent call was held default_hold (0.01), so a budget of 10 let requests
    # that may generate 8 candidates of 1,000 tokens (16.00 each) run side by side.
    body = json.dumps({"contents": [{"parts": [{"text": "hi"}]}], **config}).encode()
    async with upstream(json_handler({"candidates": []})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="10")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                path = "/v1/models/gpt-test:generateContent"
                response = await client.post(path, content=body)
                assert response.status_code == 402
                assert (
                    "more than budget 'acme''s whole limit" in response.json()["error"]["message"]
                )
                # One candidate (2.00 and the prompt) fits, and is held as such.
                one = body.replace(b"8", b"1")
                assert (await client.post(path, content=one)).status_code == 200
        finally:
            await gateway.aclose()
    assert len(primary.received) == 1  # the refused request reached no upstream
