"""`serve`'s OTLP/HTTP exporters with a credential provider: the session the SDK's
`OTEL_PYTHON_EXPORTER_OTLP_HTTP[_TRACES|_METRICS]_CREDENTIAL_PROVIDER` names, an entry
point of the `opentelemetry_otlp_credential_provider` group (a cloud's authorized session).
A provider that is not installed, fails or gives no session is refused in one line naming
the variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from fallback_mw.cli.otel_setup import TelemetrySetupError, configure_opentelemetry

GENERAL = "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER"
TRACES = "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER"


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set OTEL_* variables for one test, starting from none (the SDK reads os.environ)."""
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)

    def set_env(**values: str) -> None:
        for key, value in values.items():
            monkeypatch.setenv(key, value)

    return set_env


def providers(tmp_path: Path, **factories: str) -> Path:
    """A directory to put on sys.path holding an installed distribution whose
    credential-provider entry points are `factories` (name: the factory's Python body,
    returning the session)."""
    tmp_path.mkdir(exist_ok=True)
    module = ["import requests", ""]
    for name, body in factories.items():
        module += [f"def {name}():", *(f"    {line}" for line in body.splitlines()), ""]
    (tmp_path / "fmw_test_providers.py").write_text("\n".join(module), encoding="utf-8")
    info = tmp_path / "fmw_test_providers-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fmw-test-providers\nVersion: 1.0\n", encoding="utf-8"
    )
    (info / "entry_points.txt").write_text(
        "[opentelemetry_otlp_credential_provider]\n"
        + "".join(f"{name} = fmw_test_providers:{name}\n" for name in factories),
        encoding="utf-8",
    )
    return tmp_path


@pytest.mark.parametrize("variable", [GENERAL, TRACES])
def test_a_provider_that_is_not_installed_is_refused_naming_the_variable(
    otel_env: Any, variable: str
) -> None:
    """It was "unexpected internal error (RuntimeError); please report it": the SDK's
    RuntimeError, which serve took for a bug of its own."""
    otel_env(
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
        **{variable: "not-installed"},
    )
    with pytest.raises(TelemetrySetupError) as refused:
        configure_opentelemetry(set_global=False)
    message = str(refused.value)
    assert message.startswith(f"{variable}: "), message
    assert "'not-installed'" in message and "opentelemetry_otlp_credential_provider" in message
    assert f"unset {variable}" in message


def test_serve_refuses_a_provider_that_fails_or_gives_no_session_in_one_line(
    tmp_path: Path,
) -> None:
    """A provider that raised (its cloud's credentials missing) or gave something else than
    a requests.Session stopped serve with "unexpected internal error"; the error's own words
    (they may quote a credential's path or value) are not shown."""
    path = providers(
        tmp_path / "site",
        broken="raise OSError('no credentials in /secret/key-7f3a')",
        wrong="return object()",
    )
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.primary]\nurl = "http://127.0.0.1:9"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    for name, said in [("broken", "failed making its session (OSError)"), ("wrong", "object")]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")])),
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
            **{GENERAL: name},
        )
        served = subprocess.run(
            [sys.executable, "-m", "fallback_mw", "serve", "--config", str(config), "--port", "0"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert served.returncode == 2, served.stderr
        (line,) = served.stderr.strip().splitlines()
        assert line.startswith(f"fallback-mw: error: {GENERAL}: "), line
        assert said in line and "internal error" not in line and "key-7f3a" not in line
