"""What the host server itself says to every caller about its software (docs/security.md,
"What a host app must set itself"): the gateway drops an upstream's `server` and the
banners behind it (`x-powered-by`, `via`), and `serve` sends no `server` of its own; a
host running `Gateway` on its own server turns that server's off with the setting the page
names. Each server runs as its own process, as a user runs it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.test_host_servers import (
    SERVERS,
    require_server,
    server_process,
    wait_for,
    write_app,
)
from tests.helpers import free_port, log_text
from tests.upstreams import status_handler, upstream

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

BANNERS = {"server": "nginx/1.25.3", "x-powered-by": "Express", "via": "1.1 cache.corp:3128"}

# The setting docs/security.md names for each server.
OPTIONS = {
    "uvicorn": ["--no-server-header"],
    "hypercorn": ["--config", "hypercorn.toml"],
    "daphne": ["--no-server-name"],
}


@pytest.mark.parametrize("name", list(OPTIONS))
async def test_no_software_banner_reaches_a_caller_with_the_documented_setting(
    tmp_path: Path, name: str
) -> None:
    require_server(SERVERS[name][0])
    write_app(tmp_path, "gateway")
    (tmp_path / "hypercorn.toml").write_text("include_server_header = false\n")
    port = free_port()
    async with upstream(status_handler(200, b"{}", **BANNERS)) as up:
        with server_process(tmp_path, name, up.url, port, OPTIONS[name]) as log:
            await wait_for(port, log)
            async with httpx.AsyncClient(timeout=30) as client:
                routed = await client.get(f"http://127.0.0.1:{port}/v1/chat")
                local = await client.request("PROPFIND", f"http://127.0.0.1:{port}/v1/chat")
    output = log_text(log)
    assert (routed.status_code, local.status_code) == (200, 405), output
    for answer in (routed, local):
        for field in BANNERS:
            assert field not in answer.headers, (name, field, answer.headers)
