"""A caller that reads its answer slowly, under each server (docs/operations.md, 'Under
each server'): the gateway streams chunk by chunk and waits on the server's `send`, so
under a server that waits for the client the upstream is read no faster than the caller
reads; daphne's `send` never waits, so daphne holds the rest of the answer in memory
(up to max_response_body). Each server as its own process; a missing one is skipped
outside CI."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import anyio
import pytest
from aiohttp import web

from tests.e2e.test_host_servers import require_server, server_process, wait_for, write_app
from tests.helpers import free_port
from tests.upstreams import upstream

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

ANSWER = 40 * 1024 * 1024  # more than every socket buffer on the way can hold


class Counted:
    """An upstream streaming ANSWER bytes in 64 KiB writes; `finished` once all are out."""

    def __init__(self) -> None:
        self.finished = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "application/octet-stream"})
        await response.prepare(request)
        chunk = b"x" * 65536
        for _ in range(ANSWER // len(chunk)):
            await response.write(chunk)
        self.finished.set()
        return response


@pytest.mark.parametrize(
    ("name", "held"),
    [("uvicorn", False), ("hypercorn", False), ("granian", False), ("daphne", True)],
)
async def test_a_caller_that_reads_nothing_holds_the_upstream_back(
    tmp_path: Path, name: str, held: bool
) -> None:
    require_server(name)
    write_app(tmp_path, "gateway")
    source = tmp_path / "app.py"
    source.write_text(
        source.read_text().replace(
            '"upstreams"', '"gateway": {"max_response_body": 100 * 1024 * 1024},\n    "upstreams"'
        )
    )
    counted = Counted()
    port = free_port()
    options = ["-v", "0"] if name == "daphne" else []
    async with upstream(counted.handle) as up:
        with server_process(tmp_path, name, up.url, port, options) as log:
            await wait_for(port, log)
            client = socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", port))
            try:
                client.sendall(b"GET /v1/chat HTTP/1.1\r\nhost: gw\r\n\r\n")
                with anyio.move_on_after(5):
                    await counted.finished.wait()  # the caller reads nothing meanwhile
            finally:
                client.close()
    assert counted.finished.is_set() is held, (
        f"{name}: the upstream {'sent' if counted.finished.is_set() else 'did not send'} "
        "the whole answer while the caller read nothing"
    )
