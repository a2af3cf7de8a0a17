"""The risks of issue 23, decided (docs/security.md lists each): metadata and translation
ranges refused whatever the allowlist, IPv4-carrying IPv6 addresses judged by their IPv4
address, no hedge of a POST with an Idempotency-Key unless the route allows it, and a
streamed body over `replay_buffer` sent with its length."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from fallback_mw import Gateway
from fallback_mw.config import ConfigError, load_config
from fallback_mw.security.addresses import (
    Allowlist,
    UnsafeUpstream,
    check_connect_addresses,
    parse_ip,
)
from tests.helpers import gateway_client
from tests.test_hedge import SlowFirst
from tests.upstreams import host_app, serve_asgi, status_handler, upstream

WIDE = ["0.0.0.0/0", "::/0"]


@pytest.mark.parametrize(
    "host",
    [
        "100.100.100.200",  # Alibaba Cloud metadata
        "[64:ff9b:1::a9fe:a9fe]",  # local-use NAT64
        "[2001:0:4136:e378:8000:63bf:3fff:fdd2]",  # Teredo
        "[64:ff9b::a9fe:a9fe]",  # well-known NAT64 of 169.254.169.254
        "[::ffff:169.254.169.254]",
        "[::ffff:0:a9fe:a9fe]",  # IPv4-translated (RFC 2765) 169.254.169.254
        "0.0.0.0",  # "this network": a connect reaches the gateway host's own services
        "0.1.2.3",
        "[::]",
    ],
)
def test_metadata_and_translation_ranges_are_refused_under_the_widest_allowlist(
    host: str,
) -> None:
    data = {
        "gateway": {"allow_hosts": WIDE},
        "upstreams": {"primary": {"url": f"http://{host}/"}},
        "routes": [{"id": "r", "prefix": "/", "plan": ["primary"]}],
    }
    with pytest.raises(ConfigError, match="link-local / metadata"):
        load_config(data, check_env=False)
    with pytest.raises(UnsafeUpstream):
        check_connect_addresses("example.com", [host.strip("[]")], WIDE)


def test_a_listed_localhost_admits_loopback_addresses_only() -> None:
    """`localhost` in allow_hosts admits what it resolves to only when that is loopback (a
    hosts file or a container's resolver that maps it to a private address is refused),
    as a listed public name admits public addresses only. A hand-made mutant that let
    `localhost` admit any address passed every test."""
    kept = check_connect_addresses("localhost", ["10.0.0.5", "127.0.0.1", "::1"], ["localhost"])
    assert kept == ["127.0.0.1", "::1"]
    with pytest.raises(UnsafeUpstream):
        check_connect_addresses("localhost", ["192.168.1.20"], ["localhost"])


@pytest.mark.parametrize(
    "address", ["::ffff:127.0.0.1", "64:ff9b::a00:5", "::ffff:10.0.0.5", "::ffff:0:a00:5"]
)
def test_an_ipv6_address_carrying_ipv4_is_judged_by_the_ipv4_address(address: str) -> None:
    parsed = parse_ip(address)
    assert parsed is not None
    assert not Allowlist(["::/0"]).allows_address(parsed)  # ::/0 does not open IPv4
    assert Allowlist(["0.0.0.0/0"]).allows_address(parsed)


def hedged_config(primary: str, backup: str, **route: Any) -> dict[str, Any]:
    return {
        "upstreams": {"primary": {"url": primary}, "backup": {"url": backup}},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 2,
                    "backoff_ms": 0, "hedge_after_ms": 60, "replayable_methods": ["POST"],
                    **route}],
    }  # fmt: skip


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("key", "allowed", "arrivals"),
    [(True, False, 1), (True, True, 2), (False, False, 2)],
    ids=["keyed-post-not-hedged", "keyed-post-hedged-when-allowed", "plain-post-hedged"],
)
async def test_a_post_with_an_idempotency_key_is_not_hedged_unless_allowed(
    key: bool, allowed: bool, arrivals: int
) -> None:
    slow = SlowFirst(hang=0.6)
    headers = {"idempotency-key": "order-1"} if key else {}
    async with upstream(slow) as primary, upstream(status_handler(200, b"b")) as backup:
        conf = hedged_config(primary.url, backup.url, hedge_idempotent_posts=allowed)
        async with gateway_client(conf) as client:
            response = await client.post("/v1/x", content=b"{}", headers=headers)
    assert response.status_code == 200
    assert len(slow.arrivals) == arrivals
    if key:
        assert all(dict(r.headers)["idempotency-key"] == "order-1" for r in primary.received)


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_a_chunked_body_over_replay_buffer_goes_out_with_its_length(engine: str) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(8):
            yield b"x" * 1000

    async with upstream(status_handler(200, b"ok")) as primary:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine, "replay_buffer": 1024},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.post("/v1/x", content=chunks())
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    headers = dict(primary.received[0].headers)
    assert headers["content-length"] == "8000"
    assert "transfer-encoding" not in headers
    assert primary.received[0].body == b"x" * 8000
