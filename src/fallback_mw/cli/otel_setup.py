"""Configure the OpenTelemetry SDK from the standard `OTEL_*` variables (for `serve`).

The library itself only uses `opentelemetry-api`; a host app configures its own SDK.
`fallback-mw serve` calls `configure_opentelemetry()`, which needs the `otel` extra
(`pip install 'fallback_mw[otel]'`): the SDK is imported only when an exporter is asked for.

Variables read here: `OTEL_SDK_DISABLED`, `OTEL_TRACES_EXPORTER`, `OTEL_METRICS_EXPORTER`
(comma-separated; `console`, `otlp`, `none`, and for metrics `prometheus`: a pull endpoint,
`/metrics` on `OTEL_EXPORTER_PROMETHEUS_HOST`:`OTEL_EXPORTER_PROMETHEUS_PORT`, default
localhost:9464 as the OpenTelemetry specification says), `OTEL_EXPORTER_OTLP_PROTOCOL` /
`OTEL_EXPORTER_OTLP_{TRACES,METRICS}_PROTOCOL` (`http/protobuf`, or `grpc` when that
exporter package is installed). Without any `*_EXPORTER` variable, `otlp` is used when an
OTLP endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT` or a signal-specific one) and nothing
otherwise, so a plain `serve` does not spam connection errors. Everything else — service
name and resource (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`), sampler
(`OTEL_TRACES_SAMPLER`), endpoints, headers, timeouts, batch and export intervals,
propagators (`OTEL_PROPAGATORS`) — is read by the SDK itself, as its documentation says.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

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


@dataclass
class OtelHandle:
    """What was configured; `shutdown()` flushes and stops the exporters (idempotent)."""

    traces: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    tracer_provider: Any = None  # opentelemetry.sdk.trace.TracerProvider, when traces
    meter_provider: Any = None  # opentelemetry.sdk.metrics.MeterProvider, when metrics
    # With OTEL_METRICS_EXPORTER=prometheus: where `/metrics` is served, (host, port).
    prometheus_address: tuple[str, int] | None = None
    _providers: list[Any] = field(default_factory=list)
    _servers: list[Any] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return bool(self._providers)

    def shutdown(self) -> None:
        providers, self._providers = self._providers, []
        for provider in providers:
            # Flushing at exit must not mask the real exit status.
            with contextlib.suppress(Exception):
                provider.shutdown()
        servers, self._servers = self._servers, []
        for server in servers:
            with contextlib.suppress(Exception):
                server.shutdown()
                server.server_close()


def _exporters(environ: Mapping[str, str], signal: str) -> tuple[str, ...]:
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


def _protocol(environ: Mapping[str, str], signal: str) -> str:
    protocol = (
        environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol not in ("http/protobuf", "grpc"):
        raise TelemetrySetupError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not supported "
            "(use http/protobuf or grpc)"
        )
    return protocol


# Not in the `otel` extra: the extra would not install it.
_OUTSIDE_THE_EXTRA = frozenset({"opentelemetry-exporter-otlp-proto-grpc"})


def _missing(package: str) -> TelemetrySetupError:
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
    disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    if disabled or "prometheus" not in _exporters(environ, "metrics"):
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


def _may_be_one_address(one: str, other: str) -> bool:
    """Whether two bind hosts may share a listening address: the same text, a wildcard
    (`0.0.0.0`, `::`, empty), or a name (`localhost`: it may resolve to the other); False
    only for two different IP literals."""
    import ipaddress

    try:
        first, second = (
            ipaddress.ip_address(one.strip("[]")),
            ipaddress.ip_address(other.strip("[]")),
        )
    except ValueError:
        return True
    return first == second or first.is_unspecified or second.is_unspecified


def _prometheus_reader(handle: OtelHandle, environ: Mapping[str, str], offset: int) -> Any:
    """OpenTelemetry's PrometheusMetricReader on a registry of its own, served as
    `/metrics` by prometheus_client's HTTP server in a daemon thread (on the configured
    port + `offset`)."""
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
    except ImportError as exc:
        raise _missing("opentelemetry-exporter-prometheus") from exc
    host, port = prometheus_address(environ, offset)
    registry = CollectorRegistry()
    try:
        reader = PrometheusMetricReader(registry=registry)
    except TypeError:  # an exporter older than its `registry` argument: the global one
        registry = REGISTRY
        reader = PrometheusMetricReader()
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise TelemetrySetupError(
            f"OTEL_EXPORTER_PROMETHEUS_HOST/_PORT: cannot serve /metrics on {host}:{port} "
            f"({exc.strerror or type(exc).__name__})"
        ) from None
    handle._servers.append(server)
    bound = server.server_address
    handle.prometheus_address = (host, int(bound[1]))
    return reader


# Per signal: the SDK module with its console exporter, the OTLP exporter module (under
# opentelemetry.exporter.otlp.proto.{http,grpc}) and the class names' middle word.
_EXPORTERS = {
    "traces": ("opentelemetry.sdk.trace.export", "trace_exporter", "Span"),
    "metrics": ("opentelemetry.sdk.metrics.export", "metric_exporter", "Metric"),
}


def _exporter(signal: str, name: str, environ: Mapping[str, str], out: TextIO) -> Any:
    """The span ("traces") or metric ("metrics") exporter `name` (console or otlp)."""
    sdk_module, otlp_module, kind = _EXPORTERS[signal]
    if name == "console":
        console = importlib.import_module(sdk_module)
        return getattr(console, f"Console{kind}Exporter")(out=out)
    transport = "grpc" if _protocol(environ, signal) == "grpc" else "http"
    # The http exporter comes with the `otel` extra; grpc is optional, not part of it.
    try:
        found = importlib.import_module(
            f"opentelemetry.exporter.otlp.proto.{transport}.{otlp_module}"
        )
    except ImportError as exc:
        raise _missing(f"opentelemetry-exporter-otlp-proto-{transport}") from exc
    _check_otlp_headers(environ, signal)
    return getattr(found, f"OTLP{kind}Exporter")()


class _HeaderComplaints(logging.Filter):
    """Counts (and drops) the SDK's "Header format invalid!" warnings: they quote the
    variable's value, the collector's API key with it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        self.count += 1
        return False


def _check_otlp_headers(environ: Mapping[str, str], signal: str) -> None:
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


@contextlib.contextmanager
def _sdk_settings(which: str) -> Iterator[None]:
    """A provider's own OTEL_* settings the SDK refuses (`OTEL_METRICS_EXEMPLAR_FILTER=x`,
    `OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT=abc`): one line with the SDK's words, which name the
    variable and its (limit or filter) value, not "unexpected internal error"."""
    try:
        yield
    except ValueError as exc:
        raise TelemetrySetupError(f"{which}: the OpenTelemetry SDK refused it: {exc}") from None


def _periodic_reader(reader: Any, name: str, environ: Mapping[str, str], out: TextIO) -> Any:
    """A PeriodicExportingMetricReader for exporter `name`; its own settings refused (a
    negative OTEL_METRIC_EXPORT_INTERVAL) in one line, as the providers' are."""
    exporter = _exporter("metrics", name, environ, out)
    with _sdk_settings("OTEL_METRIC_EXPORT_* (the periodic metric reader's)"):
        return reader(exporter)


def configure_opentelemetry(
    *,
    service_name: str = "fallback-mw",
    out: TextIO | None = None,
    set_global: bool = True,
    metrics_port_offset: int = 0,
    worker: int | None = None,
) -> OtelHandle:
    """Install tracer and meter providers as the process-wide OpenTelemetry providers,
    from the `OTEL_*` variables of the process environment (the SDK and its exporters
    read `os.environ` themselves, so this does too).

    Returns an `OtelHandle`; call `shutdown()` on exit to flush (the SDK also flushes at
    interpreter exit). Nothing is installed when no exporter is asked for or
    `OTEL_SDK_DISABLED=true`. Raises `TelemetrySetupError` for an unsupported exporter or
    protocol, or when the SDK (the `otel` extra) is not installed. `console` writes to
    `out` (default: stdout). The Prometheus endpoint listens on its configured port plus
    `metrics_port_offset` (a worker's slot under `serve --workers N`). `worker` is that
    slot in a worker of `serve --workers N`: its `service.instance.id` ends in
    `-worker-SLOT`, so the workers' cumulative counts stay apart where they meet (an OTLP
    collector) also when OTEL_RESOURCE_ATTRIBUTES gives the one id of the pod or host."""
    environ = os.environ
    handle = OtelHandle()
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return handle
    handle.traces = _exporters(environ, "traces")
    handle.metrics = _exporters(environ, "metrics")
    if not handle.traces and not handle.metrics:
        return handle
    stream = out if out is not None else sys.stdout
    try:
        from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
    except ImportError as exc:
        raise _missing("opentelemetry-sdk") from exc

    from opentelemetry import metrics, trace

    attributes: dict[str, str] = {}
    if not environ.get("OTEL_SERVICE_NAME") and "service.name=" not in environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        attributes[SERVICE_NAME] = service_name
    resource = Resource.create(attributes)
    if worker is not None:
        # N processes under one given id export N different cumulative counts of the same
        # series: a collector keeps whichever came last (a counter jumping between the
        # workers' values, read as resets), never their sum.
        # (An SDK that sets no id of its own: a random one, as newer SDKs make.)
        instance = str(resource.attributes.get(SERVICE_INSTANCE_ID) or uuid.uuid4())
        resource = resource.merge(Resource({SERVICE_INSTANCE_ID: f"{instance}-worker-{worker}"}))

    if handle.traces:
        with _sdk_settings("OTEL_SPAN_*, OTEL_ATTRIBUTE_* or OTEL_TRACES_SAMPLER*"):
            # The import too: the SDK reads OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT as it loads.
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

            tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=set_global)
        for name in handle.traces:
            exporter = _exporter("traces", name, environ, stream)
            # Console output is for eyes: show each span as it ends.
            with _sdk_settings("OTEL_BSP_* (the batch span processor's)"):
                processor = (
                    SimpleSpanProcessor(exporter)
                    if name == "console"
                    else BatchSpanProcessor(exporter)
                )
            tracer_provider.add_span_processor(processor)
        handle.tracer_provider = tracer_provider
        handle._providers.append(tracer_provider)
        if set_global:
            trace.set_tracer_provider(tracer_provider)

    if handle.metrics:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers = [
            _prometheus_reader(handle, environ, metrics_port_offset)
            if name == "prometheus"
            else _periodic_reader(PeriodicExportingMetricReader, name, environ, stream)
            for name in handle.metrics
        ]
        with _sdk_settings("OTEL_METRICS_EXEMPLAR_FILTER or OTEL_ATTRIBUTE_*"):
            meter_provider = MeterProvider(
                resource=resource, metric_readers=readers, shutdown_on_exit=set_global
            )
        handle.meter_provider = meter_provider
        handle._providers.append(meter_provider)
        if set_global:
            metrics.set_meter_provider(meter_provider)
    return handle


# The name `fallback-mw serve` looks up.
configure_from_env = configure_opentelemetry

__all__ = [
    "OtelHandle",
    "TelemetrySetupError",
    "check_workers",
    "configure_from_env",
    "configure_opentelemetry",
    "prometheus_address",
]
