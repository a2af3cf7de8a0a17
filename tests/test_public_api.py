"""The package as a downstream project type-checks against it: `mypy --strict` on a
small app that embeds the gateway (the PEP 561 `py.typed` marker, the public names), run
in a directory of its own, as a user's project runs it: with none of this repository's
mypy settings (its pydantic plugin among them)."""

from __future__ import annotations

import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from pydantic import BaseModel

import fallback_mw.config

# mypy reads the package's .py sources, the same in either build; fallback_mw.config (read
# for its models' fields) is not among the compiled modules.
MYPY_ONLY = "mypy --strict on a downstream program; nothing compiled runs"

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


def _mypy(tmp_path: Path, name: str, program: str) -> subprocess.CompletedProcess[str]:
    """`mypy --strict` on `program` as a downstream project runs it: its own directory and
    an empty configuration (no plugin), the installed package found through site-packages."""
    (tmp_path / "mypy.ini").write_text("[mypy]\n")
    (tmp_path / name).write_text(program)
    # In its own process: mypy raises the interpreter's recursion limit for good.
    mypy = [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--strict"]
    mypy += ["--no-incremental", "--follow-imports=silent", "--no-error-summary", name]
    return subprocess.run(mypy, capture_output=True, text=True, timeout=180, cwd=tmp_path)


@pytest.mark.pure_pass_only(reason=MYPY_ONLY)
@pytest.mark.slow
def test_a_misspelled_public_name_fails_a_downstream_type_check(tmp_path: Path) -> None:
    """`from fallback_mw import Gatway` (or `fallback_mw.load_confg`) passed `mypy --strict`
    in the app importing it and failed only at run time: the package's lazy `__getattr__`
    (PEP 562), which returns Any, was visible to type checkers and made every name exist.
    The public names still type-check; a misspelled one is an error naming the right one."""
    run = _mypy(tmp_path, "good.py", DOWNSTREAM)
    assert run.returncode == 0, run.stdout + run.stderr
    bad = "import fallback_mw\nfrom fallback_mw import Gatway\n\nfallback_mw.load_confg('x')\n"
    run = _mypy(tmp_path, "bad.py", bad)
    assert run.returncode == 1, run.stdout + run.stderr
    out = run.stdout
    assert 'has no attribute "Gatway"; maybe "Gateway"?' in out, out
    assert 'has no attribute "load_confg"; maybe "load_config"?' in out, out


# A value of each type a configuration model's required field has, as Python source.
_SAMPLES = {str: '"x"', Decimal: "Decimal(1)", tuple[str, ...]: '("x",)'}


def _with_required_arguments(model: type[BaseModel]) -> str:
    arguments = []
    for name, field in model.model_fields.items():
        if field.is_required():
            sample = _SAMPLES.get(field.annotation)
            assert sample is not None, f"add a sample of {field.annotation} to _SAMPLES"
            arguments.append(f"{name}={sample}")
    return f"{model.__name__}({', '.join(arguments)})"


@pytest.mark.pure_pass_only(reason=MYPY_ONLY)
@pytest.mark.slow
def test_configuration_models_built_in_python_type_check_with_their_defaults(
    tmp_path: Path,
) -> None:
    """A platform team building the configuration in Python (`UpstreamConfig(url=...)`,
    `RouteConfig(id=..., prefix=..., plan=...)`) got `Missing named argument
    "connect_timeout_ms" for "UpstreamConfig"` from `mypy --strict` for every field whose
    default was written `Field(3000, ge=1)`: type checkers read a field specifier's
    default from its `default=` keyword only (PEP 681), so without pydantic's own mypy
    plugin each such field looked required, 60 errors for a two-upstream configuration.
    Every configuration model, given its required fields alone, type-checks."""
    models = [
        value
        for value in vars(fallback_mw.config).values()
        if isinstance(value, type) and issubclass(value, BaseModel)
    ]
    assert len(models) >= 8, models
    names = ", ".join(sorted(model.__name__ for model in models))
    program = "from decimal import Decimal\n\n"
    program += f"from fallback_mw.config import {names}\n\n"
    program += "".join(f"{_with_required_arguments(model)}\n" for model in models)
    program += (
        "\nconfig = GatewayConfig(\n"
        '    gateway=GatewaySettings(allow_hosts=("127.0.0.1",), breaker=BreakerConfig()),\n'
        '    upstreams={"primary": UpstreamConfig(url="http://127.0.0.1:9001")},\n'
        '    routes=(RouteConfig(id="chat", prefix="/v1/", plan=("primary",)),),\n'
        '    budgets={"acme": BudgetConfig(limit=Decimal("10"))},\n'
        ")\n"
        "deadline: int = config.gateway.deadline_ms\n"
    )
    run = _mypy(tmp_path, "built.py", program)
    assert run.returncode == 0, program + run.stdout + run.stderr


def test_each_public_name_is_listed_once() -> None:
    """`dir(fallback_mw)` (help(), an IDE's completion, `inspect.getmembers`) listed each
    public name twice once it had been used: the lazy names were listed beside the
    module's globals they had become. Each is listed once, used or not."""
    import fallback_mw

    assert fallback_mw.Gateway is not None  # used: now a global of the module too
    listed = dir(fallback_mw)
    assert len(listed) == len(set(listed)), sorted(n for n in listed if listed.count(n) > 1)
    assert set(fallback_mw.__all__) <= set(listed)
