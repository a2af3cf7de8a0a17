"""The floor: the fewest lines of ASGI that forward a request, on the same server (uvicorn,
httptools, uvloop) and the same upstream engine (one pooled aiohttp session, the connector
limits `fallback-mw serve` uses) as the gateway. Nothing a gateway decides is done here:
no routing, header hygiene, credentials, failover, budget, telemetry or limits.

    FLOOR_UPSTREAM=http://127.0.0.1:9000 uvicorn floor:app --app-dir benchmarks ...
"""

import os

import aiohttp

UPSTREAM = os.environ["FLOOR_UPSTREAM"]
HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding"}
session = None


async def app(scope, receive, send):  # type: ignore[no-untyped-def]
    global session
    if session is None:
        connector = aiohttp.TCPConnector(limit=512, limit_per_host=0)
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    headers = {"content-type": "application/json"} if body else None
    async with session.request(
        scope["method"], UPSTREAM + scope["path"], data=body or None, headers=headers
    ) as response:
        forwarded = [(k.lower(), v) for k, v in response.raw_headers if k.lower() not in HOP_BY_HOP]
        await send({"type": "http.response.start", "status": response.status, "headers": forwarded})
        async for chunk in response.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
