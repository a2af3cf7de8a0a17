"""The package as a downstream project type-checks against it: `mypy --strict` on a
small app that embeds the gateway (the PEP 561 `py.typed` marker, the public names)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

DOWNSTREAM = """
from starlette.applications import Starlette
from starlette.middleware import Middleware

from fallback_mw import ConfigError, Gateway, GatewayConfig, load_config

config: GatewayConfig = load_config("gateway.toml")
app = Starlette()
app.add_middleware(Gateway, config=config)
other = Starlette(middleware=[Middleware(Gateway, config="gateway.toml")])
problem: str | None = Gateway(app, config=config).config_error
error: type[Exception] = ConfigError
"""


@pytest.mark.slow
def test_a_misspelled_public_name_fails_a_downstream_type_check(tmp_path: Path) -> None:
    """`from fallback_mw import Gatway` (or `fallback_mw.load_confg`) passed `mypy --strict`
    in the app importing it and failed only at run time: the package's lazy `__getattr__`
    (PEP 562), which returns Any, was visible to type checkers and made every name exist.
    The public names still type-check; a misspelled one is an error naming the right one."""
    good = tmp_path / "good.py"
    good.write_text(DOWNSTREAM)
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import fallback_mw\nfrom fallback_mw import Gatway\n\nfallback_mw.load_confg('x')\n"
    )
    # In its own process: mypy raises the interpreter's recursion limit for good.
    mypy = [sys.executable, "-m", "mypy", "--strict", "--no-incremental"]
    mypy += ["--follow-imports=silent", "--no-error-summary"]
    run = subprocess.run([*mypy, str(good)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    run = subprocess.run([*mypy, str(bad)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    out = run.stdout
    assert 'has no attribute "Gatway"; maybe "Gateway"?' in out, out
    assert 'has no attribute "load_confg"; maybe "load_config"?' in out, out
