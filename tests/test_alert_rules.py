"""The shipped Prometheus rules (docs/alerts/): valid, unit-tested by promtool with series
that must fire and series that must not, every alert covered, and written on the metric
names and labels the gateway really exports through OpenTelemetry's Prometheus exporter.

promtool comes from Debian's `prometheus` package (scripts/test.sh installs it when
missing). Outside CI a missing promtool skips these tests; under CI=true it fails them."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import IN_CI

ALERTS_DIR = Path(__file__).resolve().parent.parent / "docs" / "alerts"
RULES = ALERTS_DIR / "fallback_mw.rules.yml"
RULE_TESTS = ALERTS_DIR / "fallback_mw.rules.test.yml"


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool not found (Debian package `prometheus`; scripts/test.sh installs it)"
        if IN_CI:
            pytest.fail(message + " (CI=true: a missing promtool is a failure)")
        pytest.skip(message)
    return path


def _alerts(rules: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for group in rules["groups"] for r in group["rules"] if "alert" in r]


def _load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def _run(promtool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_rules_are_valid(promtool: str) -> None:
    result = _run(promtool, "check", "rules", RULES.name, cwd=ALERTS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    count = len(_alerts(_load(RULES)))
    assert f"SUCCESS: {count} rules found" in result.stdout


def test_rule_unit_tests_pass(promtool: str) -> None:
    result = _run(promtool, "test", "rules", RULE_TESTS.name, cwd=ALERTS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    names = {a["alert"] for a in _alerts(_load(RULES))}
    assert len(names) >= 7
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in _load(RULE_TESTS)["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert names - firing == set(), "alerts without a test where they must fire"
    assert names - quiet == set(), "alerts without a test where they must stay quiet"
    assert (firing | quiet) - names == set(), "tests of alerts the rules file does not have"


@pytest.mark.parametrize(
    ("mutation", "expr"),
    [
        ("never fires", "vector(0) > 1"),
        (
            "fires for every series",
            "count by (gateway_route_id, gateway_upstream, gateway_candidate) "
            '({__name__=~"gateway_.+"})',
        ),
    ],
)
def test_the_unit_tests_catch_a_broken_rule(
    promtool: str, tmp_path: Path, mutation: str, expr: str
) -> None:
    """Negative control: each alert in turn replaced by one that never fires, then by one
    that fires for everything: promtool's tests must fail every time."""
    rules = _load(RULES)
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    for name in [a["alert"] for a in _alerts(rules)]:
        mutated = _load(RULES)
        for alert in _alerts(mutated):
            if alert["alert"] == name:
                alert["expr"] = expr
        (tmp_path / RULES.name).write_text(yaml.safe_dump(mutated))
        result = _run(promtool, "test", "rules", RULE_TESTS.name, cwd=tmp_path)
        assert result.returncode != 0, f"{name} ({mutation}): promtool tests still pass"


def test_error_outcomes_match_the_game_day_definition() -> None:
    """The rules and `fallback-mw gameday` count the same outcomes as customer-visible."""
    from fallback_mw.cli.game_day.observe import CALLER_OUTCOMES

    quiet = {"served", *CALLER_OUTCOMES}
    matchers = re.findall(r'gateway_outcome!~"([^"]+)"', RULES.read_text())
    assert matchers
    for matcher in matchers:
        assert set(matcher.split("|")) == quiet


def test_every_error_count_includes_upstream_5xx_relayed_as_served() -> None:
    """An upstream's 500 relayed as it is (a status outside failover_status), or its 503
    as the last answer under `on_exhausted = "last_response"`, is booked `served`: an
    observability team read a route answering 3 % server errors as healthy, because every
    rule counted customer-visible errors by the outcome alone (the trace's request span
    already said ERROR). Each place the rules count the error outcomes also counts the
    `served` series whose status is a 5xx, over the same window and with the same other
    matchers (`gameday`'s error_rate does the same: test_gameday.py)."""
    text = RULES.read_text()
    errors = re.findall(r'gateway_outcome!~"', text)
    both = re.findall(
        r'(rate|increase)\(gateway_requests_total\{([^}]*)gateway_outcome!~"[^"]+"\}'
        r"\[(\w+)\]\)\s*or \1\(gateway_requests_total\{\2gateway_outcome=\"served\", "
        r'http_response_status_code=~"5\.\."\}\[\3\]\)',
        text,
    )
    assert errors and len(both) == len(errors), (len(both), len(errors))


# --- the names the gateway really exports ------------------------------------------------

_SELECTOR = re.compile(r"\b([a-z_][a-z0-9_]*)\s*\{([^}]*)\}")
_BARE_METRIC = re.compile(r"\b(gateway_[a-z0-9_]+)\b(?!\s*[=!{])")
_GROUPING = re.compile(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)")


def _exported_families() -> dict[str, set[str]]:
    """Metric name -> label names, from a real routed request (failing primary, backup
    answers, breaker opens, the Redis state unreachable) exported by OpenTelemetry's
    Prometheus exporter."""
    families: dict[str, set[str]] = {}
    for sample in _exported_samples():
        families.setdefault(sample.name, set()).update(sample.labels)
    return families


def _exported_samples() -> list[Any]:
    """The samples of that export (prometheus_client `Sample`s)."""
    import anyio
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import CollectorRegistry

    from fallback_mw.telemetry import Telemetry
    from tests.helpers import gateway_client
    from tests.upstreams import free_port, status_handler, upstream

    registry = CollectorRegistry()
    reader = PrometheusMetricReader(registry=registry)  # type: ignore[no-untyped-call]
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)

    async def drive() -> None:
        async with (
            upstream(status_handler(503)) as primary,
            upstream(status_handler(200, b"ok")) as backup,
        ):
            conf = {
                # A Redis state nothing answers: served on local state, and counted.
                "gateway": {
                    "breaker": {"min_calls": 1},
                    "state": f"redis://127.0.0.1:{free_port()}/0",
                },
                "upstreams": {"primary": {"url": primary.url}, "backup": {"url": backup.url}},
                "routes": [
                    {"id": "chat", "prefix": "/api/", "plan": ["primary", "backup"], "retries": 1}
                ],
            }
            telemetry = Telemetry(meter_provider=provider)
            async with gateway_client(conf, telemetry=telemetry) as client:
                for _ in range(3):
                    response = await client.get("/api/x")
                    assert response.status_code == 200

    try:
        anyio.run(drive)
        return [sample for family in registry.collect() for sample in family.samples]
    finally:
        provider.shutdown()


def test_rules_use_the_exported_names_and_labels() -> None:
    families = _exported_families()
    # The naming the rules rely on (dots -> underscores, `_total`, `_seconds`).
    for name in (
        "gateway_requests_total",
        "gateway_attempts_total",
        "gateway_fallbacks_total",
        "gateway_request_duration_seconds_bucket",
        "gateway_breaker_state",
        "gateway_health_local_fallbacks_total",
    ):
        assert name in families, sorted(families)
    all_labels = set().union(*families.values())
    text = "\n".join(a["expr"] for a in _alerts(_load(RULES)))
    used_metrics: set[str] = set()
    for metric, matchers in _SELECTOR.findall(text):
        if metric in ("by", "on", "without", "ignoring"):
            continue
        used_metrics.add(metric)
        assert metric in families, f"{metric} is not exported"
        for label in re.findall(r"([a-z_][a-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers):
            if label != "__name__":
                assert label in families[metric], f"{metric} has no label {label}"
    for grouping in _GROUPING.findall(text):
        for label in filter(None, (part.strip() for part in grouping.split(","))):
            assert label in all_labels, f"no exported series has the label {label}"
    for token in _BARE_METRIC.findall(text):
        if token in families:
            used_metrics.add(token)
        else:
            assert token in all_labels, f"{token} is neither an exported metric nor a label"
    assert {"gateway_breaker_state", "gateway_requests_total"} <= used_metrics


def test_every_exported_series_carries_the_scope_name_and_version() -> None:
    """docs/telemetry.md: every series carries otel_scope_name="fallback_mw" and the scope
    version. The health state's and the route store's meters were made without a version:
    gateway_health_local_fallbacks_total went out with otel_scope_version="", so a query
    joining on the version (a rollout's dashboard) lost it."""
    from importlib.metadata import version

    samples = [s for s in _exported_samples() if s.name.startswith("gateway_")]
    names = {s.name for s in samples}
    assert "gateway_health_local_fallbacks_total" in names, sorted(names)
    for sample in samples:
        assert sample.labels.get("otel_scope_name") == "fallback_mw", sample
        assert sample.labels.get("otel_scope_version") == version("fallback_mw"), sample


def test_requests_just_under_the_latency_threshold_do_not_fire_it(
    promtool: str, tmp_path: Path
) -> None:
    """FallbackMwLatencyP99Abort compares `histogram_quantile(0.99, ...)` with 6 s; the
    quantile is interpolated inside the bucket it falls in. On the buckets the gateway
    really exports, a route whose every request takes 5.5 s (p99 5.5 s, under the
    criterion) must not fire it. With no bucket boundary at 6 s the 0.99 quantile of the
    (5, 10] bucket read 9.95 s and the abort fired on a healthy slow route."""
    threshold = 6.0
    rule = next(a for a in _alerts(_load(RULES)) if a["alert"] == "FallbackMwLatencyP99Abort")
    assert re.search(r"\)\s*>\s*6\s*$", rule["expr"].strip()), rule["expr"]
    buckets = sorted(
        {
            float(sample.labels["le"])
            for sample in _exported_samples()
            if sample.name == "gateway_request_duration_seconds_bucket"
        }
    )
    assert buckets and buckets[-1] == float("inf")
    took = threshold - 0.5
    series = [
        {
            "series": "gateway_request_duration_seconds_bucket"
            f'{{gateway_route_id="slow", gateway_outcome="served", le="{le:g}"}}'.replace(
                'le="inf"', 'le="+Inf"'
            ),
            "values": "0+10x40" if le >= took else "0x40",
        }
        for le in buckets
    ]
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": "5m", "alertname": "FallbackMwLatencyP99Abort", "exp_alerts": []}
                ],
            }
        ],
    }
    (tmp_path / "latency.test.yml").write_text(yaml.safe_dump(tests))
    result = _run(promtool, "test", "rules", "latency.test.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
