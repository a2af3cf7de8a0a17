"""Upstream host names under a real `fallback-mw serve`: what a name resolves to is read
from a file, through cwrap's nss_wrapper (Debian's `libnss-wrapper`, preloaded into serve
only), so the names go through libc's getaddrinfo exactly as every resolver path of the
gateway calls it: the config check (Python's socket module) and both engines at connect
time, on uvloop (libuv's thread pool). Patching `socket.getaddrinfo` in the test process,
as the in-process tests do, never reaches uvloop's lookups; /etc/hosts is the machine's.
The file is replaced (a new inode) to change an answer, which nss_wrapper reloads."""

from __future__ import annotations

import glob
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager, suppress
from pathlib import Path

import anyio
import httpx
import pytest
from aiohttp import web

from tests.conftest import IN_CI
from tests.helpers import free_port, log_text, serve_process, wait_listening

pytestmark = pytest.mark.e2e

KEY = "names-upstream-key-51c9"


def _library() -> str:
    found = sorted(
        glob.glob("/usr/lib/*/libnss_wrapper.so") + glob.glob("/usr/lib/libnss_wrapper.so")
    )
    if not found:
        message = (
            "libnss_wrapper.so not found "
            "(Debian package `libnss-wrapper`; scripts/test.sh installs it)"
        )
        if IN_CI:
            pytest.fail(message + " (CI=true: a missing nss_wrapper is a failure)")
        pytest.skip(message)
    return found[0]


class Hosts:
    """The hosts file serve resolves from; `set` replaces it whole."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def set(self, *entries: tuple[str, str]) -> None:
        fresh = self.path.with_suffix(".new")
        fresh.write_text("".join(f"{address} {name}\n" for address, name in entries))
        os.replace(fresh, self.path)


@pytest.fixture
def hosts(tmp_path: Path) -> Hosts:
    return Hosts(tmp_path / "hosts")


def _environ(hosts: Hosts, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        LD_PRELOAD=_library(),
        NSS_WRAPPER_HOSTS=str(hosts.path),
        FMW_E2E_NAMES_KEY=KEY,
        OTEL_TRACES_EXPORTER="none",
        OTEL_METRICS_EXPORTER="none",
    )
    env.update(extra)
    return env


def _config(tmp_path: Path, url: str, allow: list[str], engine: str) -> Path:
    path = tmp_path / "gateway.toml"
    listed = ", ".join(f'"{entry}"' for entry in allow)
    path.write_text(
        f'[gateway]\nallow_hosts = [{listed}]\nengine = "{engine}"\n'
        f'[upstreams.primary]\nurl = "{url}"\nauth_env = "FMW_E2E_NAMES_KEY"\n'
        "connect_timeout_ms = 3000\n"
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    return path


class Listener:
    def __init__(self) -> None:
        self.count = 0


@asynccontextmanager
async def listening(host: str, port: int, text: str) -> AsyncIterator[Listener]:
    state = Listener()

    async def answer(request: web.Request) -> web.StreamResponse:
        state.count += 1
        return web.Response(text=text)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    try:
        yield state
    finally:
        await runner.cleanup()


@contextmanager
def silent(address: str, port: int) -> Iterator[None]:
    """A listener whose full accept queue drops further SYNs unanswered (a dropping
    firewall); waits until a probe's connect goes unanswered."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with ExitStack() as stack:
        listener = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
        listener.bind((address, port))
        listener.listen(0)
        for _ in range(50):
            filler = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            filler.setblocking(False)
            with suppress(BlockingIOError):
                filler.connect((address, port))
            probe = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            probe.settimeout(0.3)
            try:
                probe.connect((address, port))
            except TimeoutError:
                yield
                return
        pytest.fail(f"could not make {address}:{port} silent")


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_a_name_rebound_after_start_is_checked_at_connect_time(
    tmp_path: Path, hosts: Hosts, engine: str
) -> None:
    """DNS rebinding: allowed at load (127.0.0.2, the one address listed), an internal
    address (127.0.0.1, not listed) when the request comes. Nothing reaches the internal
    service; answered the allowed address again, the name is served from it."""
    port, gateway = free_port(), free_port()
    hosts.set(("127.0.0.2", "api.rebind.test"))
    config = _config(tmp_path, f"http://api.rebind.test:{port}", ["127.0.0.2"], engine)
    log = tmp_path / "serve.log"
    async with (
        listening("127.0.0.2", port, "allowed") as allowed,
        listening("127.0.0.1", port, "internal") as internal,
    ):
        with serve_process(config, gateway, log, env=_environ(hosts)) as process:
            await wait_listening(process, gateway, log)
            hosts.set(("127.0.0.1", "api.rebind.test"))
            async with httpx.AsyncClient(timeout=15) as client:
                refused = await client.get(f"http://127.0.0.1:{gateway}/v1/x")
                hosts.set(("127.0.0.2", "api.rebind.test"))
                served = await client.get(f"http://127.0.0.1:{gateway}/v1/x")
    assert refused.status_code == 502, refused.text
    assert refused.json()["error"]["code"] == "upstream_failed"
    assert internal.count == 0 and "internal" not in refused.text
    assert served.status_code == 200 and served.text == "allowed", log_text(log)
    assert allowed.count == 1


def test_a_name_resolving_to_a_metadata_address_is_refused_at_start(
    tmp_path: Path, hosts: Hosts
) -> None:
    import subprocess
    import sys

    hosts.set(("169.254.169.254", "meta.rebind.test"))
    config = _config(tmp_path, "http://meta.rebind.test:80", ["meta.rebind.test"], "aiohttp")
    done = subprocess.run(
        [sys.executable, "-m", "fallback_mw", "serve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_environ(hosts),
    )
    assert done.returncode == 2, done.stderr
    assert "resolves to a link-local / metadata address" in done.stderr


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_a_name_whose_first_address_is_silent_is_served_from_the_next(
    tmp_path: Path, hosts: Hosts, engine: str
) -> None:
    """`localhost`-style: ::1 first (a firewall drops it), 127.0.0.1 answering. Served
    well inside the 3 s connect timeout (the httpx engine waited all of it per new
    connection, then tried the next address)."""
    port, gateway = free_port(), free_port()
    hosts.set(("::1", "both.rebind.test"), ("127.0.0.1", "both.rebind.test"))
    allow = ["::1", "127.0.0.1"]
    config = _config(tmp_path, f"http://both.rebind.test:{port}", allow, engine)
    log = tmp_path / "serve.log"
    async with listening("127.0.0.1", port, "answered") as answering:
        with (
            silent("::1", port),
            serve_process(config, gateway, log, env=_environ(hosts)) as process,
        ):
            await wait_listening(process, gateway, log)
            async with httpx.AsyncClient(timeout=15) as client:
                started = time.monotonic()
                answer = await client.get(f"http://127.0.0.1:{gateway}/v1/x")
                took = time.monotonic() - started
    assert answer.status_code == 200 and answer.text == "answered", log_text(log)
    assert answering.count == 1
    assert took < 2.0, f"{engine}: {took:.2f} s past a silent first address"


@pytest.mark.anyio
async def test_serve_listens_on_a_name_that_has_only_an_ipv6_address(
    tmp_path: Path, hosts: Hosts
) -> None:
    """`--host NAME` was bound as IPv4 whatever the name: one with only an IPv6 address (an
    IPv6-only host's own name) was `cannot listen on NAME:PORT: Name or service not known`,
    exit 1, though it resolves."""
    port, gateway = free_port(), free_port()
    hosts.set(("::1", "v6only.test"))
    config = _config(tmp_path, f"http://127.0.0.1:{port}", ["127.0.0.1"], "aiohttp")
    log = tmp_path / "serve.log"
    async with listening("127.0.0.1", port, "answered"):
        with serve_process(
            config, gateway, log, env=_environ(hosts), options=("--host", "v6only.test")
        ) as process:
            with anyio.fail_after(60):
                while True:  # bound when it says so, listening once uvicorn has started
                    if process.poll() is not None:
                        pytest.fail(f"serve exited ({process.returncode}): {log_text(log)}")
                    try:
                        stream = await anyio.connect_tcp("::1", gateway)
                    except OSError:
                        await anyio.sleep(0.05)
                        continue
                    await stream.aclose()
                    break
            assert f"serving on http://[::1]:{gateway} " in log_text(log)
            async with httpx.AsyncClient(timeout=15) as client:
                answer = await client.get(f"http://[::1]:{gateway}/v1/x")
    assert answer.status_code == 200 and answer.text == "answered", log_text(log)
