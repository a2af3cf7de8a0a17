"""What an outside caller learns from the gateway's answers (no config, no store, only a
caller's access). The contract names what a caller gets (SPEC §5, §12: the route id, the
configured upstream names, the rule and the configuration key that would change it); the
deployment behind it (the software and hosts behind an upstream, its internal addresses)
is the operator's to know, not every caller's."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from tests.helpers import gateway_client
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.anyio


# What an upstream says about the software and the proxies behind it (OWASP's list of
# fields to remove, and RFC 9110 §7.6.3: an intermediary at a network's edge should not
# forward the names and ports of the hosts behind it in `Via`).
DEPLOYMENT_FIELDS = {
    "X-Powered-By": "Express",
    "X-AspNet-Version": "4.0.30319",
    "X-AspNetMvc-Version": "5.2",
    "Via": "1.1 squid.internal.corp:3128 (squid/5.7), 1.1 10.20.0.7",
}


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "no-key"])
async def test_the_software_and_proxies_behind_an_upstream_are_not_relayed(keyed: bool) -> None:
    # The gateway already drops the upstream's `server` (it named the provider's software
    # to every caller); its `x-powered-by` and kin, and a `via` naming the proxies and
    # internal hosts it passed through, went to every caller as they came.
    fields = {
        **DEPLOYMENT_FIELDS,
        "Server": "nginx/1.25.3 (lb-internal-7)",
        "X-Request-Id": "req-1",
        "X-RateLimit-Remaining": "9",
    }
    env = {"VENDOR_KEY": "key-vendor-0001"} if keyed else {}
    key = {"auth_env": "VENDOR_KEY"} if keyed else {}
    async with upstream(status_handler(200, b'{"ok": true}', **fields)) as vendor:
        conf: dict[str, Any] = {
            "upstreams": {"vendor": {"url": vendor.url, **key}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["vendor"]}],
        }
        async with gateway_client(conf, environ=env) as client:
            answers = [await client.request(m, "/v1/chat") for m in ("GET", "HEAD")]
    for answer in answers:
        assert answer.status_code == 200, answer.text
        for name in (*DEPLOYMENT_FIELDS, "Server"):  # in process: no server adds its own
            assert name not in answer.headers, (name, answer.headers)
        # What describes the answer, and what SDKs pace by, is still relayed.
        assert answer.headers["x-request-id"] == "req-1"
        assert answer.headers["x-ratelimit-remaining"] == "9"


async def test_an_accepted_jobs_location_does_not_name_the_internal_upstream() -> None:
    # An asynchronous job API answers 202 Accepted with a Location to poll, built from the
    # Host the gateway sent (the upstream's own, SPEC §4); a 201 names what it created in
    # Content-Location too. The 3xx / 201 Location was already rewritten to the gateway's
    # path (nginx's proxy_redirect); these went to the caller naming the internal
    # upstream's address and port (and, followed, around the gateway and its key).
    async def jobs(request: web.Request) -> web.StreamResponse:
        own = f"http://{request.host}"
        if request.path == "/v1/jobs":
            return web.Response(status=202, headers={"location": f"{own}/v1/jobs/7"})
        return web.Response(
            status=201,
            headers={"location": f"{own}/v1/files/9", "content-location": f"{own}/v1/files/9"},
        )

    async with upstream(jobs) as internal:
        conf: dict[str, Any] = {
            "upstreams": {"internal": {"url": internal.url}},
            "routes": [{"id": "jobs", "prefix": "/v1/", "plan": ["internal"]}],
        }
        async with gateway_client(conf) as client:
            accepted = await client.post("/v1/jobs")
            created = await client.post("/v1/files")
    assert (accepted.status_code, accepted.headers["location"]) == (202, "/v1/jobs/7")
    assert created.status_code == 201
    assert created.headers["location"] == created.headers["content-location"] == "/v1/files/9"
    address = internal.url.removeprefix("http://")
    for answer in (accepted, created):
        assert address not in repr(answer.headers.raw), answer.headers


async def test_a_malformed_url_in_a_location_is_relayed_as_it_came() -> None:
    # `http://[x` is no URL (urllib refuses it): there is nothing to rewrite. The rewrite
    # raised out of the relay: the caller got a bare 500, the server's log a traceback.
    location = "http://[x/v1/a"
    async with upstream(status_handler(302, b"{}", location=location)) as internal:
        conf: dict[str, Any] = {
            "upstreams": {"internal": {"url": internal.url}},
            "routes": [{"id": "items", "prefix": "/v1/", "plan": ["internal"]}],
        }
        async with gateway_client(conf) as client:
            answer = await client.get("/v1/items")
    assert (answer.status_code, answer.headers["location"]) == (302, location)


async def test_a_paginated_lists_link_does_not_name_the_internal_upstream() -> None:
    # A paginated API names its next page in `Link` (RFC 8288), built from the Host the
    # gateway sent, as a Location is: every page of a list told the caller the internal
    # upstream's address and port. Its targets are the gateway's paths now; a target
    # elsewhere, and every parameter, as it came.
    async def pages(request: web.Request) -> web.StreamResponse:
        own = f"http://{request.host}"
        link = (
            f'<{own}/api/v1/items?page=2>; rel="next", <{own}/api/v1/items?page=9>; '
            'rel="last", <https://docs.example/pagination>; rel="help"'
        )
        return web.json_response({"items": []}, headers={"link": link})

    async with upstream(pages) as internal:
        conf: dict[str, Any] = {
            "upstreams": {"internal": {"url": f"{internal.url}/api"}},
            "routes": [{"id": "items", "prefix": "/v1/", "plan": ["internal"]}],
        }
        async with gateway_client(conf) as client:
            listed = await client.get("/v1/items")
    assert listed.status_code == 200
    assert listed.headers["link"] == (
        '</v1/items?page=2>; rel="next", </v1/items?page=9>; rel="last", '
        '<https://docs.example/pagination>; rel="help"'
    )
    assert internal.url.removeprefix("http://") not in repr(listed.headers.raw)


async def test_a_malformed_url_in_a_link_is_relayed_as_it_came() -> None:
    link = '<http://[x/v1/b>; rel="next"'
    async with upstream(status_handler(200, b"{}", link=link)) as internal:
        conf: dict[str, Any] = {
            "upstreams": {"internal": {"url": internal.url}},
            "routes": [{"id": "items", "prefix": "/v1/", "plan": ["internal"]}],
        }
        async with gateway_client(conf) as client:
            answer = await client.get("/v1/items")
    assert (answer.status_code, answer.headers["link"]) == (200, link)


async def test_a_location_with_dot_segments_is_rewritten_where_it_resolves() -> None:
    # `http://internal/api/../admin` names the internal host's `/admin`, outside the
    # upstream's `/api`: its path only began with `/api/`. It was rewritten to `/../admin`
    # (`/v1/../../admin` and the like), which the caller's client resolves to the
    # gateway's own `/admin`: another route, another upstream and its key, or the host
    # app, where the upstream named none of them. `%2e` is a dot and `\` a slash to a
    # browser's URL parser (WHATWG), as to most servers. Dot segments are resolved first:
    # what resolves outside the upstream's path is relayed as it came, what stays inside
    # is the gateway's path.
    targets = {
        "/out-dots": "{own}/api/../admin",
        "/out-encoded": "{own}/api/v1/%2E%2e/%2e%2E/admin",
        "/out-backslash": "{own}/api/v1\\..\\..\\admin",
        "/out-path": "/api/v1/x/../../../admin",
        "/in": "{own}/api/v1/x/./../items",
    }

    async def moved(request: web.Request) -> web.StreamResponse:
        target = targets[request.path.removeprefix("/api/v1")]
        return web.Response(
            status=302, headers={"location": target.format(own=f"http://{request.host}")}
        )

    async with upstream(moved) as internal:
        conf: dict[str, Any] = {
            "upstreams": {"internal": {"url": f"{internal.url}/api"}},
            "routes": [{"id": "items", "prefix": "/v1/", "plan": ["internal"]}],
        }
        async with gateway_client(conf) as client:
            answers = {path: await client.get(f"/v1{path}") for path in targets}
    own = internal.url
    for path, target in targets.items():
        location = answers[path].headers["location"]
        expected = "/v1/items" if path == "/in" else target.format(own=own)
        assert (answers[path].status_code, location) == (302, expected), path


async def test_a_link_of_thousands_of_other_hosts_costs_no_address_parse_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A hostile upstream's `Link` of thousands of targets on other hosts (`<//a>, ...`:
    # 58 KiB, within the 64 KiB field the engines relay) had each target's origin and
    # the upstream URL's own worked out again (an IP-literal parse each): a third of a
    # second of the event loop per answer, every other route's requests waiting behind
    # it. A target whose scheme or explicit port is not the upstream's is no origin of
    # its own; the upstream's is worked out once.
    import fallback_mw.layers.walker.own_urls as own_urls

    link = ", ".join(["<//a>", "<https://b:1/x>", "<http://c:1>"] * 1500)
    calls = 0
    real_origin = own_urls.origin

    def counted(url: str) -> tuple[str, str, int, str]:
        nonlocal calls
        calls += 1
        return real_origin(url)

    monkeypatch.setattr(own_urls, "origin", counted)
    async with upstream(status_handler(200, b"{}", link=link)) as internal:
        conf: dict[str, Any] = {
            "upstreams": {"internal": {"url": f"{internal.url}/api"}},
            "routes": [{"id": "items", "prefix": "/v1/", "plan": ["internal"]}],
        }
        async with gateway_client(conf) as client:
            answer = await client.get("/v1/items")
    assert (answer.status_code, answer.headers["link"]) == (200, link)
    assert calls == 1, calls  # the upstream URL's own origin, once
