"""`replay_with_idempotency_key` (SPEC §11): a buffered POST carrying an Idempotency-Key
is replayable on a route that says so; the same key goes with every attempt."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import gateway_client
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.anyio

ENV = {"PRIMARY_KEY": "sk-primary-0001", "BACKUP_KEY": "sk-backup-0002"}
BODY = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}'


def config(primary: str, backup: str, **route: Any) -> dict[str, Any]:
    return {
        "gateway": {"replay_buffer": 4096},
        "upstreams": {
            "primary": {"url": primary, "auth_env": "PRIMARY_KEY"},
            "backup": {"url": backup, "auth_env": "BACKUP_KEY"},
        },
        "routes": [
            {"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1, **route}
        ],
    }


@pytest.mark.parametrize(
    ("flag", "headers", "body", "fails_over"),
    [
        (True, {"idempotency-key": "k-123"}, BODY, True),
        (True, {}, BODY, False),  # no key: a POST is not replayable
        (True, {"idempotency-key": "  "}, BODY, False),  # an empty key is no key
        (False, {"idempotency-key": "k-123"}, BODY, False),  # the route did not opt in
        (True, {"idempotency-key": "k-123"}, b"x" * 5000, False),  # over replay_buffer
    ],
)
async def test_a_post_with_an_idempotency_key_fails_over_only_when_the_route_says_so(
    flag: bool, headers: dict[str, str], body: bytes, fails_over: bool
) -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(200, b"ok")) as b:
        conf = config(p.url, b.url, replay_with_idempotency_key=flag)
        async with gateway_client(conf, environ=ENV) as client:
            response = await client.post("/v1/chat/completions", content=body, headers=headers)
    assert p.count == 1
    if fails_over:
        assert response.status_code == 200
        assert response.headers["x-gateway-provider"] == "backup"
        assert b.count == 1 and b.received[0].body == body
        # The same key reaches every attempt, so the upstreams can deduplicate on it.
        keys = [dict(r.headers).get("idempotency-key") for r in (*p.received, *b.received)]
        assert keys == ["k-123", "k-123"]
    else:
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "upstream_failed"
        assert b.count == 0


async def test_the_key_never_makes_other_methods_replayable() -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        conf = config(p.url, b.url, replay_with_idempotency_key=True)
        async with gateway_client(conf, environ=ENV) as client:
            response = await client.patch("/v1/x", content=BODY, headers={"idempotency-key": "k-1"})
    assert response.status_code == 502
    assert (p.count, b.count) == (1, 0)


@pytest.mark.parametrize(
    ("path", "headers", "body"),
    [
        ("/v1/chat/completions", {"x-http-method-override": "post"}, BODY),
        ("/v1/chat/completions?_method=POST", {}, BODY),
        ("/v1/form", {"content-type": "application/x-www-form-urlencoded"}, b"_method=POST&a=1"),
    ],
    ids=["field", "query", "form"],
)
async def test_an_override_that_names_the_post_itself_keeps_it_replayable(
    path: str, headers: dict[str, str], body: bytes
) -> None:
    """A method override counts only the methods other than the request's own: a keyed
    POST whose override field, `_method` query parameter or form field says POST is the
    same POST, still replayed with its key (a hand-made mutant that counted the request's
    own method made it `method_override`, never failed over)."""
    async with upstream(status_handler(503)) as p, upstream(status_handler(200, b"ok")) as b:
        conf = config(p.url, b.url, replay_with_idempotency_key=True)
        async with gateway_client(conf, environ=ENV) as client:
            response = await client.post(
                path, content=body, headers={"idempotency-key": "k-9", **headers}
            )
    assert response.status_code == 200
    assert response.headers["x-gateway-provider"] == "backup"
    assert (p.count, b.count) == (1, 1) and b.received[0].body == body
