"""What a provider answers about its own origin must not land on the gateway's: cookies,
HSTS, alternative services, an order to clear site data, network-error reporting. Relayed,
they applied to the origin the caller reached (the gateway's, which a host app shares), and
they came from an upstream holding the operator's key, not from the operator."""

from __future__ import annotations

import pytest
from aiohttp import web
from multidict import CIMultiDict

from tests.helpers import gateway_client
from tests.upstreams import upstream

SECRET = "sk-operator-0123456789abcdef"

# What OpenAI's API answers beside every response (Cloudflare's cookies, HSTS with
# includeSubDomains and preload, QUIC on :443), and what any upstream can add.
ORIGIN_STATE = [
    ("Set-Cookie", "__cf_bm=abc; path=/; HttpOnly; Secure; SameSite=None"),
    ("Set-Cookie", "session=fixed-by-the-upstream; Path=/; HttpOnly"),
    ("Set-Cookie2", 'legacy="1"; Version="1"'),
    ("Strict-Transport-Security", "max-age=31536000; includeSubDomains; preload"),
    ("Alt-Svc", 'h3=":443"; ma=86400'),
    ("Clear-Site-Data", '"cookies", "storage"'),
    ("NEL", '{"report_to": "cf-nel", "max_age": 604800}'),
    ("Report-To", '{"group": "cf-nel", "endpoints": [{"url": "https://a.nel.example/"}]}'),
    ("Reporting-Endpoints", 'default="https://reports.example/"'),
]
# What describes the answer itself, and is relayed whoever answered.
ANSWER_FIELDS = {
    "link": '<https://api.example/v1/files?after=f-2>; rel="next"',
    "x-request-id": "req-1",
    "cache-control": "no-store",
}


async def provider(request: web.Request) -> web.StreamResponse:
    headers = CIMultiDict(ORIGIN_STATE)
    headers.extend(ANSWER_FIELDS)
    return web.Response(text="{}", headers=headers)


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_what_a_keyed_upstream_says_about_its_origin_never_reaches_the_caller(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The caller's `cookie` never reaches an upstream (SPEC §4), so a cookie an upstream
    # sets can never come back to it: relayed, it could only overwrite the host app's own
    # (a session fixed by the provider). HSTS with includeSubDomains pinned the gateway's
    # host and every subdomain to https for a year; `alt-svc` sent browsers to QUIC on
    # another port of the gateway's host; `clear-site-data` logged every user of the host
    # app out; NEL reported every failed request to the host, URL included, to the
    # provider's collector. An upstream the gateway sent no key to is relayed as it
    # answered (as for the account ids and cross-origin fields).
    monkeypatch.setenv("PROVIDER_KEY", SECRET)
    async with upstream(provider) as keyed, upstream(provider) as keyless:
        conf = {
            "gateway": {"engine": engine},
            "upstreams": {
                "keyed": {"url": keyed.url, "auth_env": "PROVIDER_KEY"},
                "keyless": {"url": keyless.url},
            },
            "routes": [
                {"id": "a", "prefix": "/a/", "plan": ["keyed"]},
                {"id": "b", "prefix": "/b/", "plan": ["keyless"]},
            ],
        }
        async with gateway_client(conf) as client:
            injected = await client.get("/a/v1/files")
            bare = await client.get("/b/v1/files")
    assert injected.status_code == bare.status_code == 200
    fields = "\n".join(f"{k}: {v}" for k, v in injected.headers.multi_items())
    for name, _ in ORIGIN_STATE:
        assert name.lower() not in injected.headers, fields
    for name, value in ANSWER_FIELDS.items():
        assert injected.headers.get_list(name) == [value], fields
        assert bare.headers.get_list(name) == [value]
    relayed = [(k.lower(), v) for k, v in bare.headers.multi_items()]
    for name, value in ORIGIN_STATE:
        assert (name.lower(), value) in relayed, relayed
