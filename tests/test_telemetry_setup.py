"""`otel_setup`: the SDK configured from the standard OTEL_* variables (console, otlp)."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from fallback_mw.cli.otel_setup import TelemetrySetupError, configure_opentelemetry
from fallback_mw.config import RouteConfig
from fallback_mw.request.context import AttemptRecord, RequestContext
from fallback_mw.telemetry import Telemetry
from tests.upstreams import upstream

ROOT = Path(__file__).resolve().parents[1]


def run_one_request(telemetry: Telemetry) -> None:
    context = RequestContext(
        route=RouteConfig(id="chat", prefix="/v1/", plan=("primary", "backup"), retries=1),
        upstreams={},
        tenant="acme",
        session=None,
        method="GET",
        path="/v1/models",
        query=b"",
        deadline=time.monotonic() + 5,
        candidates=["primary", "backup"],
    )
    telemetry.request_started(context)
    record = AttemptRecord(candidate="primary", number=1, server_address="127.0.0.1")
    context.attempts.append(record)
    telemetry.attempt_started(context, record)
    record.status = 200
    telemetry.attempt_finished(context, record)
    context.chosen, context.status, context.outcome = "primary", 200, "served"
    telemetry.request_finished(context)


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set OTEL_* variables for one test, starting from none (the SDK reads os.environ)."""
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)

    def set_env(**values: str) -> None:
        for key in list(os.environ):
            if key.startswith("OTEL_"):
                monkeypatch.delenv(key)
        for key, value in values.items():
            monkeypatch.setenv(key, value)

    return set_env


def test_nothing_is_configured_without_exporters(otel_env: Any) -> None:
    assert not configure_opentelemetry(set_global=False).enabled
    otel_env(OTEL_SDK_DISABLED="true", OTEL_TRACES_EXPORTER="console")
    assert not configure_opentelemetry(set_global=False).enabled
    otel_env(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    assert not configure_opentelemetry(set_global=False).enabled


def test_unsupported_exporter_and_protocol_are_refused_by_name(otel_env: Any) -> None:
    otel_env(OTEL_TRACES_EXPORTER="zipkin")
    with pytest.raises(TelemetrySetupError, match=r"OTEL_TRACES_EXPORTER: .*zipkin"):
        configure_opentelemetry(set_global=False)
    otel_env(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL="http/json")
    with pytest.raises(TelemetrySetupError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        configure_opentelemetry(set_global=False)


def test_missing_sdk_names_the_extra(otel_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    otel_env(OTEL_TRACES_EXPORTER="console")
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.resources", None)
    with pytest.raises(TelemetrySetupError, match=r"fallback_mw\[otel\]"):
        configure_opentelemetry(set_global=False)


def test_missing_grpc_exporter_names_its_own_package(otel_env: Any) -> None:
    """grpc is not in the `otel` extra: the fix named must install what is missing
    (it said `pip install 'fallback_mw[otel]'`, which installs no grpc exporter)."""
    otel_env(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("the grpc exporter is installed here")
    with pytest.raises(TelemetrySetupError) as raised:
        configure_opentelemetry(set_global=False)
    message = str(raised.value)
    assert "pip install opentelemetry-exporter-otlp-proto-grpc" in message, message
    assert "fallback_mw[otel]" not in message, message


def test_console_exporters_write_spans_and_metrics(otel_env: Any) -> None:
    otel_env(
        OTEL_TRACES_EXPORTER="console",
        OTEL_METRICS_EXPORTER="console",
        OTEL_SERVICE_NAME="gw-test",
    )
    out = io.StringIO()
    handle = configure_opentelemetry(out=out, set_global=False)
    assert handle.traces == ("console",) and handle.metrics == ("console",)
    run_one_request(
        Telemetry(tracer_provider=handle.tracer_provider, meter_provider=handle.meter_provider)
    )
    handle.shutdown()
    handle.shutdown()  # idempotent
    text = out.getvalue()
    assert '"name": "gateway.request"' in text and '"name": "gateway.attempt"' in text
    assert '"service.name": "gw-test"' in text
    assert "gateway.requests" in text and "gateway.request.duration" in text


@pytest.mark.anyio
async def test_otlp_http_exports_to_the_endpoint(otel_env: Any) -> None:
    got: dict[str, list[bytes]] = {}

    async def collector(request: web.Request) -> web.StreamResponse:
        got.setdefault(request.path, []).append(await request.read())
        return web.Response(status=200, body=b"", content_type="application/x-protobuf")

    async with upstream(collector) as endpoint:
        # No *_EXPORTER variable: an OTLP endpoint alone means otlp.
        otel_env(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint.url)
        handle = configure_opentelemetry(set_global=False)
        assert handle.traces == ("otlp",) and handle.metrics == ("otlp",)
        run_one_request(
            Telemetry(tracer_provider=handle.tracer_provider, meter_provider=handle.meter_provider)
        )
        await asyncio.to_thread(handle.shutdown)  # the SDK exports with blocking I/O
    content_types = {dict(r.headers).get("content-type") for r in endpoint.received}
    assert content_types == {"application/x-protobuf"}
    traces = ExportTraceServiceRequest.FromString(got["/v1/traces"][0])
    names = {
        span.name
        for resource in traces.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    }
    assert names == {"gateway.request", "gateway.attempt"}
    exported = [ExportMetricsServiceRequest.FromString(body) for body in got["/v1/metrics"]]
    metric_names = {
        metric.name
        for request in exported
        for resource in request.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }
    assert {"gateway.requests", "gateway.attempts", "gateway.request.duration"} <= metric_names


@pytest.mark.anyio
async def test_otlp_spans_are_grouped_by_resource_without_hashing_it_per_span(
    otel_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The OTLP encoder groups each exported span by its Resource (a dict keyed by it);
    the SDK's `Resource.__hash__` is a `json.dumps` of its attributes: serve's Resource
    keeps its hash, and exports the same resource as before."""
    import opentelemetry.sdk.resources as resources

    bodies: list[bytes] = []

    async def collector(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/traces":
            bodies.append(await request.read())
        return web.Response(status=200, body=b"", content_type="application/x-protobuf")

    async with upstream(collector) as endpoint:
        otel_env(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint.url, OTEL_METRICS_EXPORTER="none")
        handle = configure_opentelemetry(set_global=False)
        dumped: list[object] = []
        real_dumps = resources.dumps

        def counted(*args: Any, **kwargs: Any) -> str:
            dumped.append(args[0])
            return real_dumps(*args, **kwargs)

        monkeypatch.setattr(resources, "dumps", counted)
        telemetry = Telemetry(tracer_provider=handle.tracer_provider)
        for _ in range(3):
            run_one_request(telemetry)
        await asyncio.to_thread(handle.shutdown)
    assert dumped == []  # no json.dumps of the resource for any span
    exported = [ExportTraceServiceRequest.FromString(body) for body in bodies]
    groups = [group for request in exported for group in request.resource_spans]
    assert sum(len(scope.spans) for group in groups for scope in group.scope_spans) == 6
    expected = resources.Resource.create({resources.SERVICE_NAME: "fallback-mw"})
    for group in groups:
        attributes = {a.key: a.value.string_value for a in group.resource.attributes}
        instance = attributes.pop(resources.SERVICE_INSTANCE_ID)
        assert instance == handle.tracer_provider.resource.attributes[resources.SERVICE_INSTANCE_ID]
        assert attributes == {
            key: value
            for key, value in expected.attributes.items()
            if key != resources.SERVICE_INSTANCE_ID
        }


def test_serve_style_global_setup_reaches_a_telemetry_made_before_it(tmp_path: Path) -> None:
    # `serve` builds the Gateway (and its Telemetry) first, then configures the SDK: the
    # API's proxy providers must hand the earlier Telemetry the real SDK.
    script = textwrap.dedent(
        """
        from fallback_mw.telemetry import Telemetry
        from fallback_mw.cli.otel_setup import configure_from_env
        from tests.test_telemetry_setup import run_one_request

        telemetry = Telemetry()
        handle = configure_from_env()
        run_one_request(telemetry)
        handle.shutdown()
        """
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_METRICS_EXPORTER": "console",
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert '"name": "gateway.request"' in result.stdout
    assert "gateway.requests" in result.stdout
    assert '"service.name": "fallback-mw"' in result.stdout


def test_prometheus_serves_metrics_on_the_configured_address(otel_env: Any) -> None:
    import urllib.request

    from tests.upstreams import free_port

    port = free_port()
    otel_env(
        OTEL_METRICS_EXPORTER="prometheus",
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
        OTEL_EXPORTER_PROMETHEUS_PORT=str(port),
    )
    handle = configure_opentelemetry(set_global=False)
    try:
        assert handle.metrics == ("prometheus",)
        assert handle.prometheus_address == ("127.0.0.1", port)
        run_one_request(Telemetry(meter_provider=handle.meter_provider))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        handle.shutdown()
    # The names and labels the shipped alert rules use.
    assert "gateway_requests_total{" in text
    line = next(x for x in text.splitlines() if x.startswith("gateway_requests_total{"))
    for label in ('gateway_route_id="chat"', 'gateway_outcome="served"', 'gateway_fault="false"'):
        assert label in line
    assert "gateway_request_duration_seconds_bucket{" in text
    # Shut down: the port is free again.
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_prometheus_defaults_refusals_and_the_missing_extra(
    otel_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from fallback_mw.cli.otel_setup import check_workers, prometheus_address

    assert prometheus_address({}) == ("localhost", 9464)  # the OTel specification's default
    otel_env(OTEL_TRACES_EXPORTER="prometheus")  # a pull exporter for metrics only
    with pytest.raises(TelemetrySetupError, match=r"OTEL_TRACES_EXPORTER: .*prometheus"):
        configure_opentelemetry(set_global=False)
    otel_env(OTEL_METRICS_EXPORTER="prometheus", OTEL_EXPORTER_PROMETHEUS_PORT="http")
    with pytest.raises(TelemetrySetupError, match="OTEL_EXPORTER_PROMETHEUS_PORT"):
        configure_opentelemetry(set_global=False)
    # A busy port is one line naming the variables, not a traceback.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        otel_env(
            OTEL_METRICS_EXPORTER="prometheus",
            OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
            OTEL_EXPORTER_PROMETHEUS_PORT=str(busy.getsockname()[1]),
        )
        with pytest.raises(TelemetrySetupError, match=r"cannot serve /metrics on 127\.0\.0\.1"):
            configure_opentelemetry(set_global=False)
    # One port per worker: `serve --workers N` serves PORT .. PORT + N - 1, refused up
    # front only when that range runs past 65535.
    assert prometheus_address({"OTEL_EXPORTER_PROMETHEUS_PORT": "9000"}, 3) == ("localhost", 9003)
    check_workers(1)
    check_workers(2, {"OTEL_METRICS_EXPORTER": "prometheus"})
    check_workers(
        2, {"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "65534"}
    )
    with pytest.raises(TelemetrySetupError, match="one port per worker"):
        check_workers(
            3, {"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "65534"}
        )
    # Nor may a worker's port be the gateway's own (--port 0: any port, no clash).
    prometheus = {"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "9000"}
    check_workers(2, prometheus, gateway_port=9002)
    check_workers(1, prometheus, gateway_port=8999)
    check_workers(1, {**prometheus, "OTEL_SDK_DISABLED": "true"}, gateway_port=9000)
    with pytest.raises(TelemetrySetupError, match=r"port 9001, the gateway's own .*worker 1's"):
        check_workers(2, prometheus, gateway_port=9001)
    # The same port on another address is no clash (the metrics on 10.0.0.5:9001, the
    # gateway on 127.0.0.1:9001); a wildcard or a name on either side may be one.
    on = {**prometheus, "OTEL_EXPORTER_PROMETHEUS_HOST": "10.0.0.5"}
    check_workers(2, on, gateway_port=9001, gateway_host="127.0.0.1")
    for gateway_host in ("10.0.0.5", "0.0.0.0", "::", "localhost", ""):
        with pytest.raises(TelemetrySetupError, match="the gateway's own"):
            check_workers(2, on, gateway_port=9001, gateway_host=gateway_host)
    with pytest.raises(TelemetrySetupError, match="the gateway's own"):
        check_workers(
            2, {**prometheus, "OTEL_EXPORTER_PROMETHEUS_HOST": "0.0.0.0"},
            gateway_port=9001, gateway_host="127.0.0.1",
        )  # fmt: skip
    with pytest.raises(TelemetrySetupError, match=r"port 9000, the gateway's own \(--port; PORT\)"):
        check_workers(1, prometheus, gateway_port=9000)
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.prometheus", None)
    with pytest.raises(TelemetrySetupError, match=r"exporter-prometheus.*fallback_mw\[otel\]"):
        configure_opentelemetry(set_global=False)


def test_the_documented_host_app_recipe_serves_the_gateway_metrics() -> None:
    # docs/telemetry.md's two-line recipe for a host app, run as written (on a free port),
    # then one request through the gateway's telemetry and a scrape of /metrics.
    from tests.upstreams import free_port

    text = (ROOT / "docs" / "telemetry.md").read_text(encoding="utf-8")
    recipe = next(
        block
        for block in text.split("```python\n")[1:]
        if "PrometheusMetricReader()" in block.split("```")[0]
    ).split("```")[0]
    assert "start_http_server(9464)" in recipe
    port = free_port()
    script = recipe.replace("9464", str(port)) + textwrap.dedent(
        f"""
        import urllib.request
        from fallback_mw.telemetry import Telemetry
        from tests.test_telemetry_setup import run_one_request

        run_one_request(Telemetry())
        with urllib.request.urlopen("http://127.0.0.1:{port}/metrics", timeout=10) as response:
            print(response.read().decode())
        """
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "gateway_requests_total{" in result.stdout
    assert 'gateway_route_id="chat"' in result.stdout


def test_serve_workers_whose_metrics_ports_run_past_65535_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[gateway]\nstate = "redis://127.0.0.1:6379/0"\n\n'
        '[upstreams.primary]\nurl = "http://127.0.0.1:9"\n\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_EXPORTER_PROMETHEUS_PORT": "65535",  # worker 1 would need 65536
    }
    result = subprocess.run(
        [sys.executable, "-m", "fallback_mw", "serve", "--config", str(config), "--workers", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "OTEL_EXPORTER_PROMETHEUS_PORT: 65535 + 1 (one port per worker)" in line


def test_a_propagator_not_installed_is_one_line_from_serve_and_no_other_verb_breaks(
    tmp_path: Path,
) -> None:
    # A Zipkin shop's `OTEL_PROPAGATORS=b3` (its package not installed) or a typo
    # (`tracecontext,bagage`): OpenTelemetry's API raises at the import of
    # `opentelemetry.propagate`, and every `fallback-mw` command — `--version`,
    # `routes list` — died in a 25-line traceback. The commands that need no gateway work;
    # `serve` refuses in one line naming the variable and the fix, exit 2.
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.primary]\nurl = "http://127.0.0.1:9"\n\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "OTEL_PROPAGATORS": "tracecontext,bagage",
    }

    def fallback_mw(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fallback_mw", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    version = fallback_mw("--version")
    assert version.returncode == 0 and version.stdout.startswith("fallback-mw "), version.stderr
    listed = fallback_mw("routes", "list", "--store", f"sqlite:///{tmp_path / 'g.db'}")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    served = fallback_mw("serve", "--config", str(config), "--port", "0")
    assert served.returncode == 2, served.stderr
    (line,) = served.stderr.strip().splitlines()
    assert line.startswith("fallback-mw: error: ") and "OTEL_PROPAGATORS" in line
    assert "bagage" in line and "opentelemetry-propagator-b3" in line


def test_a_propagator_not_installed_is_one_line_from_demo() -> None:
    # `demo` builds a Gateway too: under `OTEL_PROPAGATORS=b3` (not installed) its server's
    # startup failed with the gateway's refusal, and the demo ended in a 50-line traceback
    # ("Task exception was never retrieved", SystemExit(3)) instead of serve's one line.
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "OTEL_PROPAGATORS": "tracecontext,bagage",
    }
    result = subprocess.run(
        [sys.executable, "-m", "fallback_mw", "demo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("fallback-mw: error: ") and "OTEL_PROPAGATORS" in line
    assert "bagage" in line
    assert result.stdout == ""


def test_a_span_limit_the_sdk_refuses_as_it_loads_is_one_line_from_serve(tmp_path: Path) -> None:
    # OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT=-1 is read as the SDK's trace module is imported,
    # before any provider is built: serve ended in "unexpected internal error (ValueError);
    # please report it", a typo read as our bug.
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.primary]\nurl = "http://127.0.0.1:9"\n\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "-1",
    }
    served = subprocess.run(
        [sys.executable, "-m", "fallback_mw", "serve", "--config", str(config), "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert served.returncode == 2, served.stderr
    (line,) = served.stderr.strip().splitlines()
    assert line.startswith("fallback-mw: error: ") and "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT" in line
    assert "internal error" not in line


def test_otlp_headers_in_the_http_spelling_are_refused_without_echoing_the_key(
    otel_env: Any, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    # `OTEL_EXPORTER_OTLP_HEADERS="Authorization: Bearer KEY"` (the HTTP spelling, not the
    # name=value the variable takes): the SDK logged "Header format invalid! ...:
    # Authorization: Bearer KEY" once per exporter, the collector's key in serve's stderr,
    # and exported without the header (every export then refused by the collector).
    secret = "sk-collector-7d1f0c"
    for spelling in (f"Authorization: Bearer {secret}", f"api-key={secret};team=x"):
        otel_env(
            OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_EXPORTER_OTLP_HEADERS=spelling
        )
        with caplog.at_level(logging.DEBUG), pytest.raises(TelemetrySetupError) as refused:
            configure_opentelemetry(set_global=False)
        message = str(refused.value)
        assert message.startswith("OTEL_EXPORTER_OTLP_HEADERS: ") and "name=value" in message
        assert secret not in message
        assert secret not in caplog.text and secret not in "".join(capsys.readouterr())
    # The signal's own variable is the one its exporter reads: a good one there is enough.
    otel_env(
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="none",
        OTEL_EXPORTER_OTLP_TRACES_HEADERS=f"authorization=Bearer%20{secret}",
        OTEL_EXPORTER_OTLP_HEADERS="broken:",
    )
    handle = configure_opentelemetry(set_global=False)
    assert handle.traces == ("otlp",)
    handle.shutdown()


OTLP_TRACES = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
OTLP_METRICS = {
    "OTEL_METRICS_EXPORTER": "otlp",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
}


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"OTEL_METRICS_EXEMPLAR_FILTER": "bogus", "OTEL_METRICS_EXPORTER": "console"}, "bogus"),
        (
            {"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "abc", "OTEL_TRACES_EXPORTER": "console"},
            "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
        ),
        # The span processor's and the metric reader's own settings, read when an OTLP
        # exporter is set: a bare ValueError ("unexpected internal error") as well.
        (
            {"OTEL_BSP_MAX_QUEUE_SIZE": "-5", **OTLP_TRACES},
            "OTEL_BSP_",
        ),
        (
            {"OTEL_BSP_SCHEDULE_DELAY": "-1", **OTLP_TRACES},
            "OTEL_BSP_",
        ),
        (
            {"OTEL_METRIC_EXPORT_INTERVAL": "-5", **OTLP_METRICS},
            "OTEL_METRIC_EXPORT_",
        ),
    ],
)
def test_an_sdk_setting_the_sdk_refuses_is_one_line_not_an_internal_error(
    otel_env: Any, variables: dict[str, str], named: str
) -> None:
    # The providers' own settings raised a bare ValueError, which serve reported as
    # "unexpected internal error (ValueError); please report it": a typo read as our bug.
    otel_env(**variables)
    with pytest.raises(TelemetrySetupError) as refused:
        configure_opentelemetry(set_global=False)
    assert named in str(refused.value) and "OpenTelemetry SDK refused" in str(refused.value)
