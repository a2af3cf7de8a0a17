"""The relay (layers/walker/stream.commit) owns the upstream response from the commit on:
however the relay ends, served or cut by an exception (the server's `send` failing, the
request cancelled), the response is closed and the usage the body reported is read. The
walker closes a response an exception passed through too, which hides the relay's own
close from every test through the gateway: this calls the relay itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fallback_mw.config import RouteConfig, UpstreamConfig
from fallback_mw.layers.walker.stream import commit
from fallback_mw.request.context import RequestContext

pytestmark = pytest.mark.anyio

BODY = b'{"id":"x","usage":{"prompt_tokens":3,"completion_tokens":4}}'


class Answer:
    """An upstream's 200 with a JSON body reporting its usage; `then` is raised once the
    whole body was read (None: the body ends)."""

    def __init__(self, then: BaseException | None) -> None:
        self.status = 200
        self.headers = [(b"content-type", b"application/json")]
        self.then = then
        self.closed = 0

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        yield BODY
        if self.then is not None:
            raise self.then

    async def aclose(self) -> None:
        self.closed += 1


def new_context() -> RequestContext:
    route = RouteConfig(id="chat", prefix="/v1/", plan=("primary",))
    return RequestContext(
        route=route, upstreams={"primary": UpstreamConfig(url="http://127.0.0.1:9")},
        tenant="t", session=None, method="POST", path="/v1/chat", query=b"",
        deadline=time.monotonic() + 5,
    )  # fmt: skip


@pytest.mark.parametrize("ending", ["served", "send_fails", "cancelled"])
async def test_the_relay_closes_the_answer_and_reads_its_usage_however_it_ends(
    ending: str,
) -> None:
    answer = Answer(asyncio.CancelledError() if ending == "cancelled" else None)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        if ending == "send_fails" and not message.get("more_body", True):
            raise RuntimeError("the server failed")  # not a client gone (an OSError)
        sent.append(message)

    context = new_context()
    if ending == "served":
        assert await commit(send, context, "primary", answer, max_response_body=1 << 20) is None
        assert context.completed
    else:
        with pytest.raises(RuntimeError if ending == "send_fails" else asyncio.CancelledError):
            await commit(send, context, "primary", answer, max_response_body=1 << 20)
        assert not context.completed
    assert [m["type"] for m in sent][:2] == ["http.response.start", "http.response.body"]
    assert answer.closed == 1
    assert (context.usage.input_tokens, context.usage.output_tokens) == (3, 4)
