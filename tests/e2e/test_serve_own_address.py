"""An upstream (or an egress proxy) whose URL is `serve`'s own address: each request the
gateway routed there came back in as a new request for the same route and went out again.
One caller's request became an endless chain of them (about 2,000 a second) that went on
after the caller had its 504, until the process was stopped. Refused at start, in every
spelling that reaches the listening socket (`[::1]`, `[::ffff:127.0.0.1]`, `localhost`
when serve binds `::`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fallback_mw.cli.own_address import reaches_listener
from tests.helpers import free_port, log_text, serve_process, wait_listening

pytestmark = pytest.mark.e2e


def _config(tmp_path: Path, url: str, *, proxy: str | None = None) -> Path:
    path = tmp_path / "gateway.toml"
    proxy_line = f'proxy = "{proxy}"\n' if proxy else ""
    path.write_text(
        '[gateway]\nallow_hosts = ["127.0.0.1", "::1", "localhost"]\n'
        f'[upstreams.primary]\nurl = "{url}"\n{proxy_line}'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    return path


def _serve(config: Path, host: str, port: int) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    command = [sys.executable, "-m", "fallback_mw", "serve", "--config", str(config)]
    try:
        return subprocess.run(
            [*command, "--host", host, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve started on {host}:{port}, its upstream being itself")


@pytest.mark.parametrize(
    ("host", "spelling"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("::", "[::1]"),
        ("::", "[::ffff:127.0.0.1]"),  # an IPv4 connect, which `::` takes (dual stack)
        ("::", "localhost"),
        ("0.0.0.0", "localhost"),
        ("::1", "[::1]"),
    ],
)
def test_serve_refuses_an_upstream_that_is_its_own_address(
    tmp_path: Path, host: str, spelling: str
) -> None:
    port = free_port()
    done = _serve(_config(tmp_path, f"http://{spelling}:{port}"), host, port)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "upstream 'primary'" in lines[0] and "the gateway's own address" in lines[0]


def test_serve_refuses_an_egress_proxy_that_is_its_own_address(tmp_path: Path) -> None:
    port = free_port()
    config = _config(tmp_path, "http://127.0.0.1:9", proxy=f"http://127.0.0.1:{port}")
    done = _serve(config, "127.0.0.1", port)
    assert done.returncode == 2, done.stderr
    assert "its proxy" in done.stderr and "the gateway's own address" in done.stderr


def _add_route(store: str, upstream: str) -> None:
    added = subprocess.run(
        [
            *(sys.executable, "-m", "fallback_mw", "routes", "add", "--store", store),
            *("--id", "loop", "--prefix", "/loop/", "--upstream", upstream),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert added.returncode == 0, added.stderr


@pytest.mark.anyio
async def test_serve_starts_with_a_store_route_to_its_own_address_and_warns(
    tmp_path: Path,
) -> None:
    """A route the store gains while serve runs is never checked against serve's address
    (the admin command does not know it): its requests come back in and the walker's Via
    check answers them 508 loop_detected. The same row refused the next start, every
    route down after a restart or a deploy for one row the running gateway had served
    beside the others: serve now starts, says so, and the row answers as it did."""
    import httpx

    port = free_port()
    store = f"sqlite:///{tmp_path / 'routes.db'}"
    _add_route(store, f"http://127.0.0.1:{port}")
    config = tmp_path / "gateway.toml"
    config.write_text(f'[gateway]\nstore = "{store}"\n', encoding="utf-8")
    log = tmp_path / "serve.log"
    env = dict(os.environ, OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    with serve_process(config, port, log, env=env) as process:
        await wait_listening(process, port, log)
        async with httpx.AsyncClient(timeout=30) as client:
            answer = await client.get(f"http://127.0.0.1:{port}/loop/x")
        assert answer.status_code == 508, answer.text
        assert answer.json()["error"]["code"] == "loop_detected"
        text = log_text(log)
        assert "warning: upstream 'loop-primary'" in text and "own address" in text, text
        assert "508 loop_detected" in text, text


@pytest.mark.anyio
async def test_serve_starts_when_the_upstream_only_looks_like_its_address(
    tmp_path: Path,
) -> None:
    """127.0.0.1 does not reach a socket bound to ::1 (nor another port, another loopback
    address): serve starts and answers."""
    port = free_port()
    config = _config(tmp_path, f"http://127.0.0.1:{port}")
    log = tmp_path / "serve.log"
    with serve_process(config, port, log, options=("--host", "::1")) as process:
        # serve_process passes --host 127.0.0.1 first; the later --host wins.
        await _wait_listening_v6(process, port, log)
        assert "the gateway's own address" not in log_text(log)


async def _wait_listening_v6(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    import anyio

    for _ in range(1200):
        if process.poll() is not None:
            pytest.fail(f"serve exited early ({process.returncode}): {log_text(log)}")
        try:
            stream = await anyio.connect_tcp("::1", port)
        except OSError:
            await anyio.sleep(0.05)
            continue
        await stream.aclose()
        return
    pytest.fail(f"serve did not listen on [::1]:{port}: {log_text(log)}")


@pytest.mark.parametrize(
    ("url", "host", "port", "reaches"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1", 8000, True),
        ("http://127.0.0.1:8000/v1", "0.0.0.0", 8000, True),
        ("http://[::1]:8000", "::", 8000, True),
        ("http://[::ffff:127.0.0.1]:8000", "::", 8000, True),
        ("http://[::ffff:127.0.0.1]:8000", "127.0.0.1", 8000, True),
        ("http://localhost:8000", "localhost", 8000, True),
        ("http://127.0.0.1:80", "127.0.0.1", 80, True),  # the scheme's default port
        ("http://127.0.0.1", "127.0.0.1", 80, True),
        ("https://127.0.0.1", "0.0.0.0", 443, True),
        ("http://127.0.0.1:8001", "127.0.0.1", 8000, False),  # another port
        ("http://127.0.0.2:8000", "127.0.0.1", 8000, False),  # another address
        ("http://127.0.0.1:8000", "::1", 8000, False),  # an IPv4 connect never reaches ::1
        ("http://[::1]:8000", "0.0.0.0", 8000, False),  # nor an IPv6 one 0.0.0.0
        ("http://192.0.2.10:8000", "0.0.0.0", 8000, False),  # not this machine's
    ],
)
def test_which_urls_reach_the_listening_socket(
    url: str, host: str, port: int, reaches: bool
) -> None:
    assert reaches_listener(url, host, port) is reaches


@pytest.mark.parametrize(
    ("url", "reaches"),
    [
        ("http://127.0.0.1:8000", False),  # an IPv4 connect never reaches an IPv6-only `::`
        ("http://[::ffff:127.0.0.1]:8000", False),  # nor in its IPv4-mapped spelling
        ("http://[::1]:8000", True),
    ],
)
def test_an_ipv6_only_wildcard_takes_no_ipv4_connection(
    monkeypatch: pytest.MonkeyPatch, url: str, reaches: bool
) -> None:
    """With net.ipv6.bindv6only=1 (or where IPv6 sockets are IPv6-only by default), serve's
    `::` socket takes IPv6 connections only: an IPv4 upstream on its port (another
    service, on 127.0.0.1) was refused as serve's own address, and serve did not start."""
    from fallback_mw.cli import host_addresses

    monkeypatch.setattr(host_addresses, "dual_stack", lambda: False)
    assert reaches_listener(url, "::", 8000) is reaches


def test_the_wildcard_is_dual_stack_as_the_system_binds_it() -> None:
    from fallback_mw.cli.host_addresses import dual_stack

    setting = Path("/proc/sys/net/ipv6/bindv6only")
    if not setting.exists():
        pytest.skip("no /proc/sys/net/ipv6/bindv6only here")
    assert dual_stack() is (setting.read_text().strip() == "0")
