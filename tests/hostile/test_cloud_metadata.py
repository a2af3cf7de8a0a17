"""Cloud metadata and credential endpoints outside 169.254.0.0/16: an attacker who gets an
upstream (or its proxy) aimed at one, by a URL, a store record or a DNS answer, gets the
provider key the gateway injects sent there, and the platform's answer back. Each is
refused whatever the allowlist, as 169.254.169.254 is: at load, in the store, as a proxy,
and at connect time on both engines, in every spelling the guard reads."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fallback_mw import Gateway
from fallback_mw.config import ConfigError, RouteConfig, UpstreamConfig, load_config
from fallback_mw.security.addresses import (
    UnsafeUpstream,
    carried_ipv4_network,
    check_connect_addresses,
    parse_ip,
)
from fallback_mw.store.model import StoredRoute
from fallback_mw.store.routes import open_store
from fallback_mw.upstream import UpstreamError, UpstreamRequest, make_client
from fallback_mw.upstream.base import Timeouts
from tests.helpers import client_for
from tests.upstreams import host_app, status_handler, upstream

WIDE = ["0.0.0.0/0", "::/0"]
KEY = "sk-metadata-test-key-0123456789"

# Documented by each vendor (the sources are cited beside the list in security/addresses.py).
METADATA_IPV4 = {
    "168.63.129.16": "Azure WireServer",
    "100.100.100.200": "Alibaba Cloud",
    "192.0.0.192": "Oracle Cloud Classic",
}
METADATA_IPV6 = {
    "fd20:ce::254": "GCP, IPv6-only VMs",
    "fd00:ec2::23": "AWS EKS Pod Identity Agent",
    "fd00:c1::a9fe:a9fe": "Oracle Cloud IMDS",
    "fd00:42::42": "Scaleway",
    "fd00:a9fe:a9fe::1": "Akamai / Linode",
    "fd00:100::100:200": "Alibaba Cloud",
}
LINK_LOCAL = ["fe80::a9fe:a9fe", "fe80::1"]  # OpenStack's IPv6 metadata, any link-local


def _ipv4_spellings(text: str) -> list[str]:
    """The URL hosts the guard reads as this IPv4 address."""
    address = ipaddress.IPv4Address(text)
    number = int(address)
    mapped = ipaddress.IPv6Address(f"::ffff:{text}")
    return [
        text,
        f"{text}.",  # trailing dot: the address to URL parsers
        str(number),  # decimal
        hex(number),  # hex
        f"[::ffff:{text}]",  # IPv4-mapped
        f"[{mapped.exploded}]",
        f"[64:ff9b::{text}]",  # NAT64
        f"[2002:{number >> 16:x}:{number & 0xFFFF:x}::1]",  # 6to4
    ]


def _ipv6_spellings(text: str) -> list[str]:
    address = ipaddress.IPv6Address(text)
    return [f"[{text}]", f"[{address.exploded}]", f"[{text.upper()}]"]


HOSTS = [
    *(host for text in METADATA_IPV4 for host in _ipv4_spellings(text)),
    *(host for text in (*METADATA_IPV6, *LINK_LOCAL) for host in _ipv6_spellings(text)),
]


def _conf(allow_hosts: list[str], url: str, proxy: str | None = None) -> dict[str, Any]:
    upstream: dict[str, Any] = {"url": url}
    if proxy is not None:
        upstream["proxy"] = proxy
    return {
        "gateway": {"allow_hosts": allow_hosts},
        "upstreams": {"u": upstream},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["u"]}],
    }


@pytest.mark.parametrize("host", HOSTS)
def test_a_cloud_metadata_upstream_or_proxy_is_refused_at_load_whatever_the_allowlist(
    host: str,
) -> None:
    """`allow_hosts = ["0.0.0.0/0", "::/0"]` (or the address itself) loaded an upstream at
    Azure's WireServer or GCP's IPv6 metadata server, and the request went there with the
    injected key: only 169.254.0.0/16, fe80::/10, fd00:ec2::254 and 100.100.100.200 were
    refused."""
    # The address itself as the allowlist reads it: an IPv6 spelling of an IPv4 address by
    # that IPv4 address (an entry spelled `::ffff:a.b.c.d` is refused at load).
    address = parse_ip(host)
    carried = carried_ipv4_network(ipaddress.ip_network(address))
    listed = [*WIDE, "api.example.test", str(address if carried is None else carried)]
    with pytest.raises(ConfigError, match=r"upstream 'u': host .* link-local / metadata"):
        load_config(_conf(listed, f"http://{host}/v1"), environ={})
    proxied = _conf(listed, "http://api.example.test", f"http://{host}:3128")
    with pytest.raises(ConfigError, match=r"upstream 'u': proxy host .* link-local / metadata"):
        load_config(proxied, environ={})


@pytest.mark.anyio
@pytest.mark.parametrize("address", [*METADATA_IPV4, *METADATA_IPV6])
async def test_a_store_route_at_a_cloud_metadata_address_is_refused(
    address: str, tmp_path: Path
) -> None:
    """A route written straight into the store (another version of the package, a script)
    is checked as the file's is: nothing served from it, nothing sent."""
    host = address if ":" not in address else f"[{address}]"
    store = f"sqlite:///{tmp_path / 'routes.db'}"
    opened = open_store(store)
    try:
        upstream = UpstreamConfig(url=f"http://{host}", auth_env="FMW_T_KEY")
        route = RouteConfig(id="r", prefix="/v1/", plan=["p"])
        await opened.insert_route(StoredRoute(route=route, upstreams={"p": upstream}))
    finally:
        await opened.aclose()
    conf = {"gateway": {"allow_hosts": WIDE, "store": store}}
    gateway = Gateway(host_app, config=conf, environ={"FMW_T_KEY": KEY})
    try:
        async with client_for(gateway) as client:
            response = await client.get("/v1/x")
    finally:
        await gateway.aclose()
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "config_error"
    assert "route 'r': upstream 'p': host" in error["message"]
    assert "link-local / metadata" in error["message"]


@pytest.fixture
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Names ending in `.test` resolve to the address the test gives them (the one
    function both engines' resolvers call); every other name resolves normally."""
    real = socket.getaddrinfo
    answers: dict[str, str] = {}

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if isinstance(name, str) and name.endswith(".test"):
            address = answers[name]
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sockaddr: tuple[Any, ...] = (address, int(port or 0))
            if family == socket.AF_INET6:
                sockaddr = (*sockaddr, 0, 0)
            return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", sockaddr)]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield answers


async def _refusal(engine: str, allow_hosts: tuple[str, ...], url: str) -> UpstreamError:
    client = make_client(engine, allow_hosts=allow_hosts)
    request = UpstreamRequest(
        method="GET",
        url=url,
        headers=[("authorization", f"Bearer {KEY}")],
        body=b"",
        timeouts=Timeouts(0.5, 1.0, 1.0),
    )
    try:
        with pytest.raises(UpstreamError) as caught:
            response = await client.send(request)
            await response.aclose()
    finally:
        await client.aclose()
    return caught.value


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize("address", [*METADATA_IPV4, *METADATA_IPV6])
async def test_a_cloud_metadata_address_is_refused_at_connect_time(
    engine: str, address: str, fake_dns: dict[str, str]
) -> None:
    """A listed name that resolves to a metadata address when the gateway connects (DNS
    rebinding after load), and the literal itself: refused before any connection, as
    `unsafe_address`, whatever the allowlist."""
    fake_dns["metadata.test"] = address
    allow = (*WIDE, "metadata.test", address)
    caught = await _refusal(engine, allow, "http://metadata.test/latest/meta-data/")
    assert caught.kind == "unsafe_address", caught
    host = address if ":" not in address else f"[{address}]"
    caught = await _refusal(engine, allow, f"http://{host}/latest/meta-data/")
    assert caught.kind == "unsafe_address", caught


# --- a client made without an allowlist -------------------------------------------------


async def _send(engine: str, url: str, proxy: str | None = None) -> UpstreamError | int:
    """Send through `make_client(engine)` with no allowlist: the error, or the status."""
    client = make_client(engine)
    request = UpstreamRequest(
        method="GET",
        url=url,
        headers=[("authorization", f"Bearer {KEY}")],
        body=b"",
        timeouts=Timeouts(0.5, 1.0, 1.0),
        proxy=proxy,
    )
    try:
        response = await client.send(request)
        status = response.status
        async for _ in response.iter_chunks():
            pass
        await response.aclose()
        return status
    except UpstreamError as exc:
        return exc
    finally:
        await client.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize("address", ["169.254.169.254", "fd00:ec2::254", "168.63.129.16"])
async def test_a_client_made_without_an_allowlist_still_refuses_metadata_addresses(
    engine: str, address: str, fake_dns: dict[str, str]
) -> None:
    """`make_client(engine)` (the Python API; `allow_hosts` defaults to none) turned the
    connect-time guard off, the metadata refusal with it: a name resolving to the metadata
    service, the literal, or an egress proxy there, got the request and its key. No
    allowlist means any address but the always-refused ones, never those."""
    fake_dns["metadata.test"] = address
    fake_dns["api.example.test"] = "93.184.216.34"
    host = address if ":" not in address else f"[{address}]"
    for url, proxy in [
        ("http://metadata.test/latest/meta-data/", None),
        (f"http://{host}/latest/meta-data/", None),
        ("http://api.example.test/v1/x", f"http://{host}:80"),
        ("http://api.example.test/v1/x", "http://metadata.test:80"),
    ]:
        outcome = await _send(engine, url, proxy)
        assert isinstance(outcome, UpstreamError), (url, proxy, outcome)
        assert outcome.kind == "unsafe_address", (url, proxy, outcome)


def test_no_allowlist_keeps_every_address_but_the_always_refused() -> None:
    """The rule both engines' connect-time guard applies with no allowlist (no socket
    needed: scripts/mutants.py runs this against a mutant that drops it)."""
    addresses = ["169.254.169.254", "127.0.0.1", "fd20:ce::254", "::ffff:a9fe:a9fe", "::1"]
    assert check_connect_addresses("h.test", addresses, ()) == ["127.0.0.1", "::1"]
    for refused in ("169.254.169.254", "fd00:ec2::254", "168.63.129.16", "fe80::1%2"):
        with pytest.raises(UnsafeUpstream, match="link-local / metadata"):
            check_connect_addresses("h.test", [refused], ())


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_a_client_made_without_an_allowlist_reaches_any_other_address(
    engine: str,
) -> None:
    """The other half of "no allowlist": loopback and the rest are reached as before (the
    `blackhole` fault's own client is made so)."""
    async with upstream(status_handler(204)) as server:
        assert await _send(engine, f"{server.url}/ok") == 204
    assert server.count == 1


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_a_gateway_given_its_own_client_still_refuses_a_rebinding_to_metadata(
    engine: str, fake_dns: dict[str, str]
) -> None:
    """`Gateway(app, config=..., client=make_client(engine))`: the name passed the load
    check (a public address then) and, resolving to 169.254.169.254 when the request came,
    got the injected key; the gateway's allowlist was only in the client it did not use."""
    fake_dns["api.example.test"] = "93.184.216.34"  # public at load time
    config = {
        "gateway": {"allow_hosts": ["api.example.test"], "engine": engine},
        "upstreams": {"p": {"url": "http://api.example.test", "auth_env": "FMW_T_KEY"}},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["p"]}],
    }
    gateway = Gateway(
        host_app, config=config, environ={"FMW_T_KEY": KEY}, client=make_client(engine)
    )
    fake_dns["api.example.test"] = "169.254.169.254"  # ... the metadata service when used
    try:
        async with client_for(gateway) as client:
            response = await client.get("/v1/latest/meta-data/")
    finally:
        await gateway.aclose()
    assert response.status_code == 502, response.text
    assert response.json()["error"]["rule"] == "unsafe_address", response.text
