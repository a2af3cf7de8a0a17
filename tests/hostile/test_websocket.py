"""WebSockets: `serve` refuses a handshake cleanly (no 500), and the Gateway hands
websocket scopes to the host app untouched, even under a route prefix."""

from __future__ import annotations

from pathlib import Path

import pytest
import websockets
from websockets.exceptions import InvalidStatus

from fallback_mw import Gateway
from fallback_mw.request.types import Receive, Scope, Send
from tests.helpers import free_port, log_text, serve_process, wait_listening
from tests.upstreams import serve_asgi_ws

pytestmark = pytest.mark.anyio


async def test_serve_refuses_a_websocket_handshake_without_a_500(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.primary]\nurl = "http://127.0.0.1:9"\n\n'
        '[[routes]]\nid = "r"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    port = free_port()
    log = tmp_path / "serve.log"
    statuses: list[int] = []
    with serve_process(config, port, log) as process:
        await wait_listening(process, port, log)
        for path in ("/ws", "/v1/ws"):
            with pytest.raises(InvalidStatus) as caught:
                async with websockets.connect(f"ws://127.0.0.1:{port}{path}", open_timeout=10):
                    pass
            statuses.append(caught.value.response.status_code)
    assert statuses == [403, 403]
    output = log_text(log)
    assert "Traceback" not in output
    assert "ASGI callable returned without" not in output


async def echo_host(scope: Scope, receive: Receive, send: Send) -> None:
    assert scope["type"] == "websocket"
    message = await receive()
    assert message["type"] == "websocket.connect"
    await send({"type": "websocket.accept"})
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return
        await send({"type": "websocket.send", "text": "echo:" + message.get("text", "")})


async def test_the_gateway_passes_websocket_scopes_to_the_host_app_untouched() -> None:
    conf = {
        "upstreams": {"primary": {"url": "http://127.0.0.1:9"}},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
    }
    gateway = Gateway(echo_host, config=conf)
    try:
        async with (
            serve_asgi_ws(gateway) as base,
            websockets.connect(base.replace("http", "ws") + "/v1/ws") as socket,
        ):
            await socket.send("hi")
            assert await socket.recv() == "echo:hi"
    finally:
        await gateway.aclose()
