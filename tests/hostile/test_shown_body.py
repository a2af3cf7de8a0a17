"""`fallback-mw request --show-body` shows the answer's body as its client reads it. An
upstream names the charset it likes: for JSON (RFC 8259 §11: the parameter "has no
effect on compliant recipients") and for an event stream (always UTF-8, WHATWG HTML) the
SDKs read UTF-8 whatever it says, so the body shown must be those bytes as UTF-8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fallback_mw import Gateway
from tests.helpers import client_for
from tests.test_request_cli import request_cli, write_config
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

CONTENT = "+ADw-b+AD4- as sent"  # `<b> as sent` read as UTF-7, the same bytes in UTF-8
ANSWER = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "gpt-test",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": CONTENT},
                "finish_reason": "stop",
            }
        ],
    }
).encode()


@pytest.mark.parametrize("charset", ["utf-7", "cp500"])
async def test_a_json_answer_is_shown_as_the_sdk_reads_it_whatever_charset_it_names(
    tmp_path: Path, charset: str
) -> None:
    """An answer `application/json; charset=utf-7` whose message is `+ADw-b+AD4- as sent`:
    the openai SDK reads those characters, `request --show-body` showed `<b> as sent`
    (decoded as UTF-7, which no JSON reader does), a body no client got; with
    `charset=cp500` (EBCDIC) it showed a body of other letters altogether, not JSON."""
    import openai

    answer = status_handler(200, ANSWER, **{"content-type": f"application/json; charset={charset}"})
    async with upstream(answer) as up:
        gateway = Gateway(
            host_app,
            config={
                "upstreams": {"primary": {"url": up.url}},
                "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
            },
        )
        try:
            async with client_for(gateway) as http:
                sdk = openai.AsyncOpenAI(
                    base_url="http://gw/v1", api_key="unused", http_client=http, max_retries=0
                )
                read = await sdk.chat.completions.create(model="gpt-test", messages=[])
        finally:
            await gateway.aclose()
        config = str(write_config(tmp_path, up.url, "http://127.0.0.1:9"))
        status, out, err = await request_cli(
            "--config", config, "--path", "/v1/chat/completions", "--show-body", "--json"
        )
    assert read.choices[0].message.content == CONTENT
    assert status == 0, err
    shown = json.loads(json.loads(out)["client"]["body"])
    assert shown["choices"][0]["message"]["content"] == CONTENT


async def test_an_event_stream_is_shown_as_utf8_whatever_charset_it_names(tmp_path: Path) -> None:
    """An event stream is always UTF-8 to its reader (WHATWG HTML's EventSource, the SDKs'
    stream decoders): `text/event-stream; charset=utf-7` was shown decoded as UTF-7."""
    body = f"data: {CONTENT}\n\n".encode()
    answer = status_handler(200, body, **{"content-type": "text/event-stream; charset=utf-7"})
    async with upstream(answer) as up:
        config = str(write_config(tmp_path, up.url, "http://127.0.0.1:9"))
        status, out, err = await request_cli(
            "--config", config, "--path", "/v1/chat", "--show-body", "--json"
        )
    assert status == 0, err
    assert json.loads(out)["client"]["body"] == body.decode()
