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

import atexit
import contextlib
import importlib
import inspect
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from fallback_mw.cli.console_stream import ConsoleStream
from fallback_mw.cli.otel_env import (
    TelemetrySetupError,
    check_otlp_headers,
    check_workers,
    exporters,
    missing,
    prometheus_address,
    protocol,
)
from fallback_mw.cli.otel_log_filter import hide_url_secrets
from fallback_mw.cli.serve_options import host_port

_log = logging.getLogger("fallback_mw.telemetry")

# At exit, how long console telemetry pending for a slow stdout may take to be written.
CONSOLE_FLUSH_SECONDS = 2.0
# At exit, how long the exporters may take to send what they hold.
TELEMETRY_FLUSH_SECONDS = 3.0
# After this long of it, a line says the stop waits for the exporters.
FLUSH_NOTICE_SECONDS = 0.5


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
    # stdout as the console exporters write to it, when no `out` was given.
    _console: ConsoleStream | None = None

    @property
    def enabled(self) -> bool:
        return bool(self._providers)

    def shutdown(self) -> None:
        providers, self._providers = self._providers, []
        # Each provider flushes in a thread of its own, all of them within one bound: an
        # OTLP endpoint that accepts and never answers held the stop for each exporter's
        # export timeout in turn (10 s each by default), past a supervisor's stop grace.
        deadline = time.monotonic() + TELEMETRY_FLUSH_SECONDS
        flushes = [
            threading.Thread(
                target=_flush, args=(provider,), name="fallback-mw telemetry flush", daemon=True
            )
            for provider in providers
        ]
        for flush in flushes:
            flush.start()
        # A second stop during the wait (Ctrl-C: KeyboardInterrupt; a worker's or serve's
        # SIGTERM handler: SystemExit) stops at once, as uvicorn's own second Ctrl-C does:
        # what is held is dropped, not flushed again by the SDK's exit hook ("shutdown can
        # only be called once"), and the stop is raised again once the rest is closed.
        stop: KeyboardInterrupt | SystemExit | None = None
        try:
            _join(flushes, min(deadline, time.monotonic() + FLUSH_NOTICE_SECONDS))
            if any(flush.is_alive() for flush in flushes) and time.monotonic() < deadline:
                # A stop that lasts: why it does, and how to end it now.
                _log.info(
                    "telemetry export still running: waiting up to %g s for it "
                    "(Ctrl-C again to drop what the exporters hold)",
                    TELEMETRY_FLUSH_SECONDS,
                )
                _join(flushes, deadline)
        except (KeyboardInterrupt, SystemExit) as exc:
            stop = exc
        cut = stop is not None
        if cut:
            _log.warning(
                "telemetry export cut short by a second Ctrl-C (or stop signal): the spans "
                "and metrics the exporters still held are dropped"
            )
            for provider in providers:  # dropped: not flushed again at the interpreter's exit
                hook = getattr(provider, "_atexit_handler", None)
                if hook is not None:
                    atexit.unregister(hook)
        elif any(flush.is_alive() for flush in flushes):
            _log.warning(
                "telemetry export did not finish within %g s of the stop (is the OTLP "
                "endpoint answering?): the spans and metrics the exporters still held are "
                "dropped",
                TELEMETRY_FLUSH_SECONDS,
            )
        console, self._console = self._console, None
        if console is not None:
            console.close(0.0 if cut else CONSOLE_FLUSH_SECONDS)
        servers, self._servers = self._servers, []
        for server in servers:
            with contextlib.suppress(Exception):
                server.shutdown()
                server.server_close()
        if stop is not None:
            raise stop


def _join(flushes: list[threading.Thread], until: float) -> None:
    for flush in flushes:
        flush.join(max(0.0, until - time.monotonic()))


def _flush(provider: Any) -> None:
    # Flushing at exit must not mask the real exit status.
    with contextlib.suppress(Exception):
        if "timeout_millis" in inspect.signature(provider.shutdown).parameters:
            # The meter provider's own bound (the tracer provider takes none), inside the
            # wait for it: it ends, and unregisters its exit hook, before the wait does
            # (that hook found it still flushing: "shutdown can only be called once").
            provider.shutdown(timeout_millis=(TELEMETRY_FLUSH_SECONDS - 0.5) * 1000)
        else:
            provider.shutdown()


def _prometheus_reader(handle: OtelHandle, environ: Mapping[str, str], offset: int) -> Any:
    """OpenTelemetry's PrometheusMetricReader on a registry of its own, served as
    `/metrics` by cli/metrics_server.py in a daemon thread (on the configured port +
    `offset`)."""
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import REGISTRY, CollectorRegistry
    except ImportError as exc:
        raise missing("opentelemetry-exporter-prometheus") from exc
    host, port = prometheus_address(environ, offset)
    registry = CollectorRegistry()
    try:
        reader = PrometheusMetricReader(registry=registry)
    except TypeError:  # an exporter older than its `registry` argument: the global one
        registry = REGISTRY
        reader = PrometheusMetricReader()
    try:
        from fallback_mw.cli.metrics_server import start_metrics_server

        server = start_metrics_server(host, port, registry)
    except OSError as exc:
        raise TelemetrySetupError(
            "OTEL_EXPORTER_PROMETHEUS_HOST/_PORT: cannot serve /metrics on "
            f"{host_port(host, port)} ({exc.strerror or type(exc).__name__})"
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


def _exporter(
    signal: str, name: str, environ: Mapping[str, str], out: TextIO | ConsoleStream
) -> Any:
    """The span ("traces") or metric ("metrics") exporter `name` (console or otlp)."""
    sdk_module, otlp_module, kind = _EXPORTERS[signal]
    if name == "console":
        console = importlib.import_module(sdk_module)
        return getattr(console, f"Console{kind}Exporter")(out=out)
    transport = "grpc" if protocol(environ, signal) == "grpc" else "http"
    # The http exporter comes with the `otel` extra; grpc is optional, not part of it.
    try:
        found = importlib.import_module(
            f"opentelemetry.exporter.otlp.proto.{transport}.{otlp_module}"
        )
    except ImportError as exc:
        raise missing(f"opentelemetry-exporter-otlp-proto-{transport}") from exc
    check_otlp_headers(environ, signal)
    exporter_class = getattr(found, f"OTLP{kind}Exporter")
    if transport == "grpc":
        return exporter_class()
    from fallback_mw.cli import otel_session

    if signal == "traces":  # spans encoded in place, a third of the SDK encoder's time
        from fallback_mw.cli.otlp_spans import use_in_place

        use_in_place(found)
    # A collector's answer read up to a bound, not into memory whole (cli/otel_session.py).
    variable = otel_session.provider_variable(environ, signal)
    if variable is not None:  # a credential provider's session, loaded as the SDK would
        return exporter_class(session=otel_session.provider_session(variable, environ[variable]))
    return exporter_class(session=otel_session.BoundedAnswerSession())


@contextlib.contextmanager
def _sdk_settings(which: str) -> Iterator[None]:
    """A provider's own OTEL_* settings the SDK refuses (`OTEL_METRICS_EXEMPLAR_FILTER=x`,
    `OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT=abc`): one line with the SDK's words, which name the
    variable and its (limit or filter) value, not "unexpected internal error"."""
    try:
        yield
    except ValueError as exc:
        raise TelemetrySetupError(f"{which}: the OpenTelemetry SDK refused it: {exc}") from None


def _periodic_reader(reader: Any, exporter: Any) -> Any:
    """A PeriodicExportingMetricReader for `exporter`; its own settings refused (a
    negative OTEL_METRIC_EXPORT_INTERVAL) in one line, as the providers' are."""
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
    handle.traces = exporters(environ, "traces")
    handle.metrics = exporters(environ, "metrics")
    if not handle.traces and not handle.metrics:
        return handle
    if out is not None:
        stream: TextIO | ConsoleStream = out
    else:
        # Never written from a request: cli/console_stream.py.
        stream = handle._console = ConsoleStream(sys.stdout)
    try:
        _install(handle, environ, stream, service_name, metrics_port_offset, worker, set_global)
    except BaseException:
        # Refused part-way: what was started stops. A periodic reader no meter provider
        # took ticked for the life of the process, logging "Cannot call collect on a
        # MetricReader until it is registered" at every export interval; a /metrics
        # server held its port; a batch span processor kept its thread.
        handle.shutdown()
        raise
    from opentelemetry import metrics, trace

    # Only a setup that is complete becomes the process's: a refused one sets nothing.
    if set_global and handle.tracer_provider is not None:
        trace.set_tracer_provider(handle.tracer_provider)
    if set_global and handle.meter_provider is not None:
        metrics.set_meter_provider(handle.meter_provider)
    # Once the exporters (and their loggers) are imported: no endpoint query in the log.
    hide_url_secrets()
    return handle


def serve_resource(environ: Mapping[str, str], service_name: str, worker: int | None) -> Any:
    """The `Resource` serve's providers share (cli/otel_resource.py: its hash kept)."""
    try:
        from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource

        from fallback_mw.cli.otel_resource import HashedResource
    except ImportError as exc:
        raise missing("opentelemetry-sdk") from exc

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
    return HashedResource(resource)


def _install(
    handle: OtelHandle,
    environ: Mapping[str, str],
    stream: TextIO | ConsoleStream,
    service_name: str,
    metrics_port_offset: int,
    worker: int | None,
    shutdown_on_exit: bool,
) -> None:
    """The providers `handle` asks for, each in `handle` as soon as it exists (so that a
    refusal after it stops it)."""
    resource = serve_resource(environ, service_name, worker)
    if handle.traces:
        with _sdk_settings("OTEL_SPAN_*, OTEL_ATTRIBUTE_* or OTEL_TRACES_SAMPLER*"):
            # The import too: the SDK reads OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT as it loads.
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

            tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=shutdown_on_exit)
        handle.tracer_provider = tracer_provider
        handle._providers.append(tracer_provider)
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

    if handle.metrics:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        # Whatever may be refused is, before a periodic reader starts its export thread:
        # one stopped unregistered still logs "Cannot call collect" as its thread ends.
        # The exporters; the meter provider's own settings (a provider with no reader:
        # no thread); the /metrics servers. The readers then, one setting for them all.
        pushed = {
            i: _exporter("metrics", name, environ, stream)
            for i, name in enumerate(handle.metrics)
            if name != "prometheus"
        }
        meter_settings = "OTEL_METRICS_EXEMPLAR_FILTER or OTEL_ATTRIBUTE_*"
        with _sdk_settings(meter_settings):
            MeterProvider(resource=resource, shutdown_on_exit=False).shutdown()
        readers = {
            i: _prometheus_reader(handle, environ, metrics_port_offset)
            for i, name in enumerate(handle.metrics)
            if name == "prometheus"
        }
        for i, exporter in pushed.items():
            readers[i] = _periodic_reader(PeriodicExportingMetricReader, exporter)
        with _sdk_settings(meter_settings):
            meter_provider = MeterProvider(
                resource=resource,
                metric_readers=[readers[i] for i in sorted(readers)],  # in the variable's order
                shutdown_on_exit=shutdown_on_exit,
            )
        handle.meter_provider = meter_provider
        handle._providers.append(meter_provider)


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
