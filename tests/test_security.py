"""The SSRF guard: metadata / link-local addresses in every spelling are always refused, at
load, at store write and at connect time; connect-time checks resolve once and connect to
the checked address."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from fallback_mw import Gateway
from fallback_mw.config import ConfigError, load_config
from fallback_mw.security.addresses import (
    UnsafeUpstream,
    check_connect_addresses,
    check_upstream_host,
    parse_ip,
)
from fallback_mw.upstream import UpstreamClient, UpstreamError, UpstreamRequest, make_client
from fallback_mw.upstream.base import Timeouts
from tests.helpers import client_for
from tests.test_cli_admin import host_app
from tests.upstreams import status_handler, upstream

PERMISSIVE = ("0.0.0.0/0", "::/0")
METADATA_SPELLINGS = [
    "169.254.169.254",
    "2852039166",  # decimal
    "0xa9fea9fe",  # hex
    "0xA9.0xFE.0xA9.0xFE",
    "0251.0376.0251.0376",  # octal
    "169.254.43518",  # short dotted form
    "::ffff:169.254.169.254",  # IPv4-mapped
    "::ffff:a9fe:a9fe",
    "[::ffff:169.254.169.254]",
    "fd00:ec2::254",  # AWS IMDS over IPv6
    "fe80::1",
    "169.254.0.1",
]


@pytest.mark.parametrize("host", METADATA_SPELLINGS)
def test_metadata_addresses_are_refused_whatever_the_allowlist(host: str) -> None:
    with pytest.raises(UnsafeUpstream, match=r"link-local / metadata"):
        check_upstream_host(host, (*PERMISSIVE, host))
    with pytest.raises(UnsafeUpstream):
        # getaddrinfo hands back the canonical form of whatever spelling it was given.
        check_connect_addresses(host, [str(parse_ip(host))], (*PERMISSIVE, host))


@pytest.mark.parametrize(
    "url", ["http://2852039166/", "http://[::ffff:169.254.169.254]:80/", "http://0xa9fea9fe"]
)
def test_config_load_refuses_metadata_upstreams(url: str) -> None:
    config = {
        "gateway": {"allow_hosts": list(PERMISSIVE)},
        "upstreams": {"meta": {"url": url}},
        "routes": [{"id": "r", "prefix": "/r/", "plan": ["meta"]}],
    }
    with pytest.raises(ConfigError, match=r"upstream 'meta'.*metadata"):
        load_config(config, environ={})


@pytest.fixture
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Names ending in `.test` resolve to whatever the test says, counting lookups; every
    other name resolves normally. Patches the one function every resolver path uses."""
    real = socket.getaddrinfo
    state: dict[str, Any] = {"answers": {}, "lookups": []}

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if isinstance(name, str) and name.endswith(".test"):
            state["lookups"].append(name)
            address = state["answers"][name]
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sockaddr = (address, int(port or 0))
            return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", sockaddr)]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield state


def request(url: str) -> UpstreamRequest:
    return UpstreamRequest(
        method="GET", url=url, headers=[], body=b"", timeouts=Timeouts(1.0, 2.0, 2.0)
    )


async def send(client: UpstreamClient, url: str) -> int:
    try:
        response = await client.send(request(url))
        status = response.status
        async for _ in response.iter_chunks():
            pass
        await response.aclose()
        return status
    finally:
        await client.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_public_name_resolving_to_loopback_is_refused_at_connect_time(
    engine: str, fake_dns: dict[str, Any]
) -> None:
    async with upstream(status_handler(200)) as server:
        port = server.url.rsplit(":", 1)[1]
        fake_dns["answers"]["myhost.test"] = "127.0.0.1"
        client = make_client(engine, allow_hosts=("myhost.test",))
        with pytest.raises(UpstreamError) as caught:
            await send(client, f"http://myhost.test:{port}/v1")
    assert caught.value.kind == "unsafe_address"
    assert "myhost.test" in str(caught.value)
    assert server.count == 0  # nothing reached the loopback service
    assert fake_dns["lookups"] == ["myhost.test"]


def test_a_listed_name_resolving_to_a_private_address_says_what_to_add(
    fake_dns: dict[str, Any],
) -> None:
    """A platform team lists its internal proxy by name: the refusal said the host was
    "not in allow_hosts" when it was listed; it says why, and what to add."""
    fake_dns["answers"]["llm-proxy.test"] = "10.1.2.3"
    conf: dict[str, Any] = {
        "gateway": {"allow_hosts": ["llm-proxy.test"]},
        "upstreams": {"p": {"url": "http://llm-proxy.test:8000"}},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["p"]}],
    }
    with pytest.raises(ConfigError) as caught:
        load_config(conf, environ={})
    message = str(caught.value)
    assert "not in allow_hosts" not in message
    assert "is in allow_hosts, but resolves only to non-public" in message
    assert "add the address or its network" in message
    assert "10.1.2.3" not in message  # a refusal also answers callers (503 config_error)
    conf["gateway"]["allow_hosts"] = ["llm-proxy.test", "10.0.0.0/8"]
    load_config(conf, environ={})


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize("address", ["169.254.169.254", "fd00:ec2::254", "::ffff:169.254.169.254"])
async def test_a_name_resolving_to_a_metadata_address_at_connect_time_is_refused(
    engine: str, address: str, fake_dns: dict[str, Any]
) -> None:
    fake_dns["answers"]["metadata.test"] = address
    client = make_client(engine, allow_hosts=(*PERMISSIVE, "metadata.test"))
    with pytest.raises(UpstreamError) as caught:
        await send(client, "http://metadata.test:80/latest/meta-data/")
    assert caught.value.kind == "unsafe_address"


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_connect_goes_to_the_checked_address_after_one_lookup(
    engine: str, fake_dns: dict[str, Any]
) -> None:
    async with upstream(status_handler(204)) as server:
        port = server.url.rsplit(":", 1)[1]
        fake_dns["answers"]["gw-upstream.test"] = "127.0.0.1"
        client = make_client(engine, allow_hosts=("127.0.0.0/8",))
        assert await send(client, f"http://gw-upstream.test:{port}/ok") == 204
    assert server.count == 1
    assert fake_dns["lookups"] == ["gw-upstream.test"]  # resolved once, no second lookup
    assert dict(server.received[0].headers)["host"] == f"gw-upstream.test:{port}"


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize("host", ["2852039166", "0xa9fea9fe", "[::ffff:169.254.169.254]"])
async def test_metadata_literals_are_refused_at_connect_time(engine: str, host: str) -> None:
    client = make_client(engine, allow_hosts=PERMISSIVE)
    with pytest.raises(UpstreamError) as caught:
        await send(client, f"http://{host}:80/latest/meta-data/")
    assert caught.value.kind == "unsafe_address"


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_dns_rebinding_after_load_is_caught_by_the_gateway(
    engine: str, fake_dns: dict[str, Any]
) -> None:
    async with upstream(status_handler(200, b"internal")) as internal:
        port = internal.url.rsplit(":", 1)[1]
        fake_dns["answers"]["api.example.test"] = "93.184.216.34"  # public at load time
        config = {
            "gateway": {"allow_hosts": ["api.example.test"], "engine": engine},
            "upstreams": {"primary": {"url": f"http://api.example.test:{port}"}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=config, environ={})
        fake_dns["answers"]["api.example.test"] = "127.0.0.1"  # ... loopback at connect time
        try:
            async with client_for(gateway) as client:
                response = await client.get("/v1/x")
        finally:
            await gateway.aclose()
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_failed"
    assert internal.count == 0
    assert "127.0.0.1" not in response.text and "internal" not in response.text
