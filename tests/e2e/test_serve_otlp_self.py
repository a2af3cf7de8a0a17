"""An OTLP endpoint that is the gateway's own address (`OTEL_EXPORTER_OTLP_ENDPOINT`
copied from the gateway's URL, or the OTLP default port given to `serve --port 4318`): each
export was a request the gateway routed upstream (`/v1/traces` under a `/v1/` route), with
the OTLP headers it carries, and made spans to export again, for ever. Refused at start."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fallback_mw.cli.otel_env import TelemetrySetupError, check_workers
from tests.helpers import free_port
from tests.test_security import fake_dns

pytestmark = pytest.mark.e2e

COLLECTOR_KEY = "hny-team-key-93ac11"
__all__ = ["fake_dns"]  # the fixture, shared with tests/test_security.py


def test_serve_refuses_an_otlp_endpoint_that_is_its_own_address(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.primary]\nurl = "http://127.0.0.1:9"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    env = dict(
        os.environ,
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://localhost:{port}",
        OTEL_EXPORTER_OTLP_HEADERS=f"x-honeycomb-team={COLLECTOR_KEY}",
    )
    command = [sys.executable, "-m", "fallback_mw", "serve", "--config", str(config)]
    try:
        done = subprocess.run(
            [*command, "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=20,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("serve started, exporting its telemetry to itself")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "OTEL_EXPORTER_OTLP_ENDPOINT" in lines[0], done.stderr
    assert "gateway itself" in lines[0] and COLLECTOR_KEY not in done.stderr


@pytest.mark.parametrize(
    ("environ", "host", "port"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:8000"}, "127.0.0.1", 8000),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://localhost:8000/"}, "0.0.0.0", 8000),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1]:8000"}, "::", 8000),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:8000/v1/traces"}, "", 8000),
        ({"OTEL_METRICS_EXPORTER": "otlp"}, "127.0.0.1", 4318),  # the OTLP default address
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1"}, "127.0.0.1", 80),
    ],
)
def test_an_otlp_endpoint_on_the_gateways_address_is_refused(
    environ: dict[str, str], host: str, port: int
) -> None:
    with pytest.raises(TelemetrySetupError, match="the gateway itself"):
        check_workers(1, environ, gateway_port=port, gateway_host=host)


@pytest.mark.parametrize(
    ("endpoint", "host"),
    [
        ("http://127.1:8000", "0.0.0.0"),  # the resolver's short form of 127.0.0.1
        ("http://127.1:8000", "127.0.0.1"),
        ("http://2130706433:8000", "127.0.0.1"),  # 127.0.0.1 as one integer
        ("http://0x7f000001:8000", "0.0.0.0"),
        ("http://[::ffff:127.0.0.1]:8000", "127.0.0.1"),  # IPv4-mapped: an IPv4 connect
        ("http://[::ffff:127.0.0.1]:8000", "0.0.0.0"),
    ],
)
def test_an_otlp_endpoint_on_the_gateways_address_in_another_spelling_is_refused(
    endpoint: str, host: str
) -> None:
    """Each of these connects to the gateway's socket (getaddrinfo reads 127.1, 2130706433
    and 0x7f000001 as 127.0.0.1; a connect to ::ffff:127.0.0.1 is an IPv4 one), as the
    metadata check already reads them (`parse_ip`): serve started and exported to itself."""
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    with pytest.raises(TelemetrySetupError, match="the gateway itself"):
        check_workers(1, environ, gateway_port=8000, gateway_host=host)


@pytest.mark.parametrize(
    ("environ", "host", "port"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, "127.0.0.1", 8000),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector.internal:8000"}, "0.0.0.0", 8000),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.2:8000"}, "127.0.0.1", 8000),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:8000"}, "127.0.0.1", 0),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:8000", "OTEL_SDK_DISABLED": "true"},
            "127.0.0.1",
            8000,
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:8000",
                "OTEL_TRACES_EXPORTER": "none",
                "OTEL_METRICS_EXPORTER": "prometheus",
                "OTEL_EXPORTER_PROMETHEUS_PORT": "9464",
            },
            "127.0.0.1",
            8000,
        ),
    ],
)
def test_an_otlp_endpoint_elsewhere_is_accepted(
    environ: dict[str, str], host: str, port: int
) -> None:
    check_workers(1, environ, gateway_port=port, gateway_host=host)


@pytest.mark.parametrize(
    "endpoint",
    ["not a url", "http://[::1", "ftp://collector:4318", "http://:4318", "http://collector:99999"],
)
def test_an_otlp_endpoint_that_is_no_http_url_is_refused_at_start(endpoint: str) -> None:
    """serve started and every export logged 'Failed to export spans batch code: None,
    reason: Failed to parse: ...' (once a minute for metrics, a batch for spans): the
    telemetry went nowhere from the first request, and nothing said so at start."""
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    with pytest.raises(TelemetrySetupError, match="OTEL_EXPORTER_OTLP_ENDPOINT") as caught:
        check_workers(1, environ, gateway_port=8000, gateway_host="127.0.0.1")
    assert endpoint not in str(caught.value)
    # With --port 0 (the port not known yet) it is refused all the same.
    with pytest.raises(TelemetrySetupError):
        check_workers(1, environ, gateway_port=0, gateway_host="127.0.0.1")


def test_a_grpc_endpoint_without_a_scheme_is_accepted() -> None:
    environ = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "otel:4317"}
    check_workers(1, environ, gateway_port=8000, gateway_host="127.0.0.1")


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://169.254.169.254:4318",
        "http://169.254.169.254./v1",
        "http://2852039166:4318",  # the same address spelled as one integer
        "http://[fe80::1]:4318",
        "http://[::ffff:169.254.169.254]:4318",
        "http://[fd00:ec2::254]:4318",  # AWS's IPv6 metadata address
        "http://0:4318",  # 0.0.0.0: this host's services
    ],
)
def test_an_otlp_endpoint_on_a_link_local_or_metadata_address_is_refused(endpoint: str) -> None:
    """Upstreams on link-local and metadata addresses are refused in every spelling (SPEC
    §3); the OTLP exporter sent there all the same, with the OTLP headers' credentials
    (`OTEL_EXPORTER_OTLP_HEADERS`) on every export: a cloud's metadata service reached from
    the gateway's host by whoever could set one variable."""
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_HEADERS": f"x-honeycomb-team={COLLECTOR_KEY}",
    }
    with pytest.raises(TelemetrySetupError, match="no upstream may have") as caught:
        check_workers(1, environ, gateway_port=8000, gateway_host="127.0.0.1")
    assert endpoint not in str(caught.value) and COLLECTOR_KEY not in str(caught.value)
    grpc = {**environ, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    with pytest.raises(TelemetrySetupError, match="no upstream may have"):
        check_workers(1, grpc, gateway_port=8000, gateway_host="127.0.0.1")


def _own_lan_address(family: socket.AddressFamily, probe: str) -> str:
    """A non-loopback address of this host: the source the kernel picks for a route out
    (a UDP connect sends nothing), confirmed by binding a socket to it (only this host's
    addresses can be bound). Skips where the host has none of that family."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as udp:
            udp.connect((probe, 9))
            address = str(udp.getsockname()[0])
        with socket.socket(family, socket.SOCK_STREAM) as tcp:
            tcp.bind((address, 0))
    except OSError:
        pytest.skip(f"no route out of this host for {family.name}")
    if ipaddress.ip_address(address).is_loopback or ipaddress.ip_address(address).is_link_local:
        pytest.skip("the route out leaves from loopback or link-local")
    return address


@pytest.mark.parametrize(
    ("family", "probe", "wildcard"),
    [
        (socket.AF_INET, "198.51.100.1", "0.0.0.0"),
        (socket.AF_INET6, "2001:db8::1", "::"),
    ],
)
def test_an_otlp_endpoint_at_the_hosts_own_lan_address_is_refused_under_a_wildcard_bind(
    family: socket.AddressFamily, probe: str, wildcard: str
) -> None:
    """`serve --host 0.0.0.0 --port 8000` with the collector named by this machine's own
    LAN address on port 8000: the gateway's socket listens there too, and every export was
    a request it routed upstream. Only loopback addresses were known to be the gateway's."""
    address = _own_lan_address(family, probe)
    netloc = f"[{address}]" if ":" in address else address
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{netloc}:8000"}
    with pytest.raises(TelemetrySetupError, match="the gateway itself") as caught:
        check_workers(1, environ, gateway_port=8000, gateway_host=wildcard)
    assert address not in str(caught.value)
    # Bound to that address itself: refused as before; on another port, or bound to
    # loopback alone, the collector is elsewhere.
    with pytest.raises(TelemetrySetupError, match="the gateway itself"):
        check_workers(1, environ, gateway_port=8000, gateway_host=address)
    check_workers(1, environ, gateway_port=8001, gateway_host=wildcard)
    loopback = "127.0.0.1" if family == socket.AF_INET else "::1"
    check_workers(1, environ, gateway_port=8000, gateway_host=loopback)


@pytest.mark.parametrize("endpoint", ["http://198.51.100.7:8000", "http://[2001:db8::7]:8000"])
def test_an_otlp_endpoint_at_another_machines_address_is_accepted_under_a_wildcard_bind(
    endpoint: str,
) -> None:
    """Not an address of this host (documentation ranges, routed elsewhere): the collector
    may listen on the gateway's port number there."""
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    check_workers(1, environ, gateway_port=8000, gateway_host="0.0.0.0")
    check_workers(1, environ, gateway_port=8000, gateway_host="::")


@pytest.mark.parametrize("address", ["169.254.169.254", "fd00:ec2::254", "169.254.170.2"])
def test_an_otlp_host_name_resolving_to_a_metadata_address_is_refused(
    address: str, fake_dns: dict[str, Any]
) -> None:
    """The literal was refused, a name for it was not: the exporter resolved it at each
    export and sent the OTLP headers' credentials to the cloud's metadata service. The name
    is resolved at start, through the resolver the exporter itself calls (the `fake_dns`
    seam: names ending in `.test` answer what the test says; no hosts file is written)."""
    fake_dns["answers"]["collector.metadata.test"] = address
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector.metadata.test:4318",
        "OTEL_EXPORTER_OTLP_HEADERS": f"x-honeycomb-team={COLLECTOR_KEY}",
    }
    with pytest.raises(TelemetrySetupError, match="no upstream may have") as caught:
        check_workers(1, environ, gateway_port=8000, gateway_host="127.0.0.1")
    message = str(caught.value)
    assert "collector.metadata.test" not in message and COLLECTOR_KEY not in message
    assert fake_dns["lookups"] == ["collector.metadata.test"]
    grpc = {**environ, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    with pytest.raises(TelemetrySetupError, match="no upstream may have"):
        check_workers(1, grpc, gateway_port=8000, gateway_host="127.0.0.1")


def test_an_otlp_host_name_resolving_to_a_collector_is_accepted(fake_dns: dict[str, Any]) -> None:
    fake_dns["answers"]["collector.office.test"] = "10.20.30.40"
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector.office.test:8000"}
    check_workers(1, environ, gateway_port=8000, gateway_host="0.0.0.0")
    assert fake_dns["lookups"] == ["collector.office.test"]


def test_this_hosts_own_name_on_the_gateways_port_is_refused() -> None:
    """A real name through the real resolver: this machine's host name, which resolves to
    one of its own addresses (loopback in /etc/hosts, or a LAN address), on the port serve
    listens on: the exports came back to the gateway."""
    name = socket.gethostname()
    try:
        infos = socket.getaddrinfo(name, 8000, proto=socket.IPPROTO_TCP)
    except OSError:
        pytest.skip("this host's name does not resolve here")
    families = {info[0] for info in infos}
    wildcard = "::" if socket.AF_INET not in families else "0.0.0.0"
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{name}:8000"}
    with pytest.raises(TelemetrySetupError, match="the gateway itself") as caught:
        check_workers(1, environ, gateway_port=8000, gateway_host=wildcard)
    assert name not in str(caught.value)
    check_workers(1, environ, gateway_port=8001, gateway_host=wildcard)


def test_a_resolver_that_never_answers_holds_the_start_only_a_moment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The name is looked up with a bound (`RESOLVE_WITHIN`): a resolver that never answers
    costs the start that long, and the endpoint is then taken as it is (the exporter
    resolves it again at each export)."""
    from fallback_mw.cli import host_addresses

    asked, released = threading.Event(), threading.Event()
    real = socket.getaddrinfo

    def hanging(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "slow.resolver.test":
            asked.set()
            released.wait(30)
            raise socket.gaierror(socket.EAI_AGAIN, "released")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    monkeypatch.setattr(host_addresses, "RESOLVE_WITHIN", 0.2)
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://slow.resolver.test:4318"}
    started = time.monotonic()
    try:
        check_workers(1, environ, gateway_port=4318, gateway_host="0.0.0.0")
    finally:
        released.set()
    assert asked.is_set() and time.monotonic() - started < 10
