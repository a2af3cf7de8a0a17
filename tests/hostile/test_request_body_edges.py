"""The request body's two limits at their edges, through the gateway: a body of exactly
`replay_buffer` bytes is buffered and may be replayed (one more streams to one attempt),
and a declared Content-Length of exactly `max_request_body` is read and sent (one more is
the caller's 413 before any upstream). Hand-made mutants that moved either comparison by
one passed every test."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import gateway_client
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.anyio

LIMIT = 2048
BUFFER = 1024


def config(primary: str, backup: str) -> dict[str, Any]:
    return {
        "gateway": {"replay_buffer": BUFFER, "max_request_body": LIMIT},
        "upstreams": {"primary": {"url": primary}, "backup": {"url": backup}},
        "routes": [
            {
                "id": "r",
                "prefix": "/v1/",
                "plan": ["primary", "backup"],
                "retries": 1,
                "replayable_methods": ["GET", "PUT"],
            }
        ],
    }


@pytest.mark.parametrize(("size", "fails_over"), [(BUFFER, True), (BUFFER + 1, False)])
async def test_a_body_of_exactly_replay_buffer_bytes_is_replayed_one_more_is_not(
    size: int, fails_over: bool
) -> None:
    async with (
        upstream(status_handler(503)) as p,
        upstream(status_handler(200, b"ok")) as b,
        gateway_client(config(p.url, b.url)) as client,
    ):
        response = await client.put("/v1/x", content=b"x" * size)
    assert p.count == 1 and p.received[0].body == b"x" * size
    if fails_over:
        assert (response.status_code, b.count) == (200, 1)
        assert b.received[0].body == b"x" * size
    else:
        assert (response.status_code, b.count) == (502, 0)


@pytest.mark.parametrize(("size", "refused"), [(LIMIT, False), (LIMIT + 1, True)])
async def test_a_declared_length_of_exactly_max_request_body_is_sent_one_more_is_413(
    size: int, refused: bool
) -> None:
    async with (
        upstream(status_handler(200, b"ok")) as p,
        upstream(status_handler(200)) as b,
        gateway_client(config(p.url, b.url)) as client,
    ):
        response = await client.put("/v1/x", content=b"y" * size)
    if refused:
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
        assert p.count == 0
    else:
        assert response.status_code == 200
        assert p.count == 1 and p.received[0].body == b"y" * size
