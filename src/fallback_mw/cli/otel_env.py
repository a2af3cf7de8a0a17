"""What the standard `OTEL_*` variables ask `fallback-mw serve` for, read and checked before
anything is started (cli/otel_setup.py builds the SDK from it): the exporters per signal,
the OTLP protocol and headers, the Prometheus `/metrics` address and its ports under
`serve --workers N`. A refusal is a `TelemetrySetupError` naming the variable and the fix,
never a variable's value beyond exporter names."""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Mapping

_KNOWN_EXPORTERS = {
    "traces": frozenset({"console", "otlp", "none"}),
    "metrics": frozenset({"console", "otlp", "prometheus", "none"}),
}
PROMETHEUS_HOST = "localhost"  # the OpenTelemetry specification's defaults
PROMETHEUS_PORT = 9464


class TelemetrySetupError(RuntimeError):
    """The OTEL_* variables ask for something this installation cannot do. The message
    names the variable and the fix; it never contains a variable's value beyond exporter
    names."""


def exporters(environ: Mapping[str, str], signal: str) -> tuple[str, ...]:
    variable = f"OTEL_{signal.upper()}_EXPORTER"
    raw = environ.get(variable)
    if raw is None:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get(
            f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"
        )
        return ("otlp",) if endpoint else ()
    names = tuple(dict.fromkeys(n.strip().lower() for n in raw.split(",") if n.strip()))
    known = _KNOWN_EXPORTERS[signal]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise TelemetrySetupError(
            f"{variable}: unsupported exporter {', '.join(sorted(unknown))} "
            f"(supported: {', '.join(sorted(known))})"
        )
    return tuple(n for n in names if n != "none")


def protocol(environ: Mapping[str, str], signal: str) -> str:
    chosen = (
        environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if chosen not in ("http/protobuf", "grpc"):
        raise TelemetrySetupError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: {chosen!r} is not supported (use http/protobuf or grpc)"
        )
    return chosen


# Not in the `otel` extra: the extra would not install it.
_OUTSIDE_THE_EXTRA = frozenset({"opentelemetry-exporter-otlp-proto-grpc"})


def missing(package: str) -> TelemetrySetupError:
    fix = package if package in _OUTSIDE_THE_EXTRA else "'fallback_mw[otel]'"
    return TelemetrySetupError(
        f"OpenTelemetry export was requested but {package} is not installed: pip install {fix}"
    )


def prometheus_address(environ: Mapping[str, str], offset: int = 0) -> tuple[str, int]:
    """(host, port) of the `/metrics` endpoint: `OTEL_EXPORTER_PROMETHEUS_HOST` /
    `OTEL_EXPORTER_PROMETHEUS_PORT`, default localhost:9464; `offset` added to the port
    (the worker's slot under `serve --workers N`: worker i serves on PORT + i)."""
    host = environ.get("OTEL_EXPORTER_PROMETHEUS_HOST", "").strip() or PROMETHEUS_HOST
    raw = environ.get("OTEL_EXPORTER_PROMETHEUS_PORT", "").strip()
    if not raw:
        port = PROMETHEUS_PORT
    elif not raw.isdigit() or not 0 < int(raw) < 65536:
        raise TelemetrySetupError(
            f"OTEL_EXPORTER_PROMETHEUS_PORT: {raw[:16]!r} is not a port number (1-65535)"
        )
    else:
        port = int(raw)
    if port + offset > 65535:
        raise TelemetrySetupError(
            f"OTEL_EXPORTER_PROMETHEUS_PORT: {port} + {offset} (one port per worker) "
            "is past 65535; choose a lower port"
        )
    return host, port + offset


def check_workers(
    workers: int,
    environ: Mapping[str, str] | None = None,
    *,
    gateway_port: int = 0,
    gateway_host: str = "",
) -> None:
    """`serve --workers N` with the Prometheus exporter: each worker serves its own counts
    on its own port, PORT .. PORT + N - 1 (docs/telemetry.md); refused up front when that
    range would run past 65535, or hold `gateway_port` (serve's own, when known) on an
    address that may be the gateway's (`gateway_host`; two different IP literals, neither
    a wildcard, cannot clash): a worker's `/metrics` server bound it before the gateway's
    sockets listened, and took the gateway's connections."""
    environ = os.environ if environ is None else environ
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return
    check_otlp_endpoints(environ, gateway_host, gateway_port)
    if "prometheus" not in exporters(environ, "metrics"):
        return
    host, last = prometheus_address(environ, workers - 1)
    first = last - (workers - 1)
    if first <= gateway_port <= last and _may_be_one_address(host, gateway_host):
        whose = (
            f"worker {gateway_port - first}'s, PORT + {gateway_port - first}"
            if workers > 1
            else "PORT"
        )
        raise TelemetrySetupError(
            f"OTEL_EXPORTER_PROMETHEUS_PORT: /metrics would be served on port {gateway_port}, "
            f"the gateway's own (--port; {whose}); choose a metrics port outside "
            f"{gateway_port - workers + 1}..{gateway_port}"
        )


# Where the OTLP exporters send with no endpoint variable set, by protocol.
_OTLP_DEFAULT = {"http/protobuf": "http://localhost:4318", "grpc": "http://localhost:4317"}


def check_otlp_endpoints(environ: Mapping[str, str], gateway_host: str, gateway_port: int) -> None:
    """Refuses an OTLP exporter whose endpoint is the gateway's own address (a loopback
    name or address, or the bind address itself, on `gateway_port`): each export was a
    request the gateway routed upstream (`/v1/traces` under a `/v1/` route, the OTLP
    headers forwarded with it) and made spans to export again, for ever. A host name is
    resolved (`host_addresses.resolved`, within `RESOLVE_WITHIN`) and each of its addresses
    checked as a literal is (SPEC §3, as for an upstream's name); a name that does not
    resolve, or not in time, is taken as it is: the exporter resolves it again at each
    export, and a collector's name may come up after the gateway does."""
    from fallback_mw.cli import host_addresses
    from fallback_mw.security.addresses import IPAddress, is_always_refused

    resolved: dict[str, list[IPAddress]] = {}
    for signal in ("traces", "metrics"):
        if "otlp" not in exporters(environ, signal):
            continue
        for variable in (
            f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ):
            endpoint = environ.get(variable, "").strip()
            if endpoint:
                break
        else:
            endpoint = _OTLP_DEFAULT.get(protocol(environ, signal), "")
            variable = f"OTEL_EXPORTER_OTLP_ENDPOINT (not set: the default {endpoint})"
        grpc = protocol(environ, signal) == "grpc"
        address = _endpoint_address(endpoint, grpc=grpc)
        if address is None:
            # The exporter said it at each export ("Failed to parse ..."), once the gateway
            # served: none of its telemetry went anywhere, and nothing said so at start.
            form = "HOST:PORT or an http(s):// URL" if grpc else "an http:// or https:// URL"
            raise TelemetrySetupError(
                f"{variable}: the OTLP {signal} exporter cannot send to it: not {form} with a "
                "host and a port from 1 to 65535 (its value is not shown); e.g. "
                "http://collector:4318"
            )
        if address[0] not in resolved:  # looked up once for both signals
            resolved[address[0]] = host_addresses.resolved(address[0])
        targets = resolved[address[0]]
        if any(is_always_refused(target) for target in targets):
            raise TelemetrySetupError(
                f"{variable}: the OTLP {signal} exporter would send to an address no "
                "upstream may have (link-local, a cloud's metadata service, or 0.0.0.0/8, "
                "in any spelling or through a name that resolves to one; its value is not "
                "shown): point it at the collector"
            )
        if address[1] == gateway_port and host_addresses.reaches(targets, gateway_host):
            raise TelemetrySetupError(
                f"{variable}: the OTLP {signal} exporter would send to the gateway itself "
                f"(port {gateway_port}, --port): each export a request the gateway routes "
                "upstream, making spans to export again; point it at the collector"
            )


def _endpoint_address(endpoint: str, *, grpc: bool) -> tuple[str, int] | None:
    """(host, port) an endpoint connects to; None when the exporter cannot send to it: no
    http(s) URL (the gRPC exporter also takes HOST:PORT), no host, a port out of range."""
    import re
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(endpoint if "//" in endpoint or not grpc else f"//{endpoint}")
        port = parts.port
    except ValueError:
        return None
    host = parts.hostname
    if parts.scheme not in ("http", "https", *(("",) if grpc else ())) or not host:
        return None
    if not re.fullmatch(r"[a-z0-9._-]+|[0-9a-f:.]+", host) or port == 0:
        return None
    return host, port or (443 if parts.scheme == "https" else 80)


def _may_be_one_address(one: str, other: str) -> bool:
    """Whether two bind hosts may share a listening address: the same text, a wildcard
    (`0.0.0.0`, `::`, empty), or a name (`localhost`: it may resolve to the other); False
    only for two different IP literals."""
    try:
        first, second = (
            ipaddress.ip_address(one.strip("[]")),
            ipaddress.ip_address(other.strip("[]")),
        )
    except ValueError:
        return True
    return first == second or first.is_unspecified or second.is_unspecified


class _HeaderComplaints(logging.Filter):
    """Counts (and drops) the SDK's "Header format invalid!" warnings: they quote the
    variable's value, the collector's API key with it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        self.count += 1
        return False


def check_otlp_headers(environ: Mapping[str, str], signal: str) -> None:
    """Refuses an OTLP headers variable the exporter cannot read whole. The SDK would log
    each unreadable entry with its value (`Authorization: Bearer KEY`, the HTTP spelling,
    is one) to stderr — the collector's key in the gateway's log — and export without it."""
    from opentelemetry.util.re import parse_env_headers

    for variable in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"):
        value = environ.get(variable)
        if value is None:
            continue
        complaints = _HeaderComplaints()
        sdk_logger = logging.getLogger("opentelemetry.util.re")
        sdk_logger.addFilter(complaints)
        try:
            parse_env_headers(value, liberal=True)
        finally:
            sdk_logger.removeFilter(complaints)
        if complaints.count:
            raise TelemetrySetupError(
                f"{variable}: not a comma-separated list of name=value pairs (its value is "
                "not shown): write each header as name=value, URL-encoded, e.g. "
                "authorization=Bearer%20KEY, not the HTTP spelling `Authorization: Bearer KEY`"
            )
        return  # the signal's own variable, when set, is the one the exporter reads
