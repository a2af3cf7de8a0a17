"""The wheel in a new virtual environment, as a user who already has the oldest versions it
admits: every base dependency and the serve and redis extras pinned to the lower bound the
wheel's metadata declares (pip keeps an installed version that satisfies a bound, so a user's
older aiohttp or opentelemetry-api is what the gateway runs on). From a directory outside
the checkout: the command, `python -m fallback_mw`, the demo (a failover, the POST rule, a
budget), the Redis breaker state, what importing the package loads, and mypy --strict of a
user's program against the installed, typed package. pip asks the package index (its cache
makes a rerun quick)."""

from __future__ import annotations

import email
import os
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.test_packaging import build, copy_tree

# Optional dependencies a bare `import fallback_mw` (and its public names) must not load.
HEAVY = ("opentelemetry.sdk", "redis", "asyncpg", "httpx", "uvicorn", "django", "starlette")


def lowest(wheel: Path, extras: set[str]) -> list[str]:
    """`name==lower bound` for each requirement of the base install and `extras`."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(archive.read(name))
    pins = []
    for line in meta.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is not None and not any(marker.evaluate({"extra": e}) for e in extras):
            continue
        (bound,) = [s.version for s in requirement.specifier if s.operator == ">="]
        pins.append(f"{requirement.name}=={bound}")
    return pins


def run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # a virtual environment and an install from the index: about 30 s
def test_the_wheel_at_its_lowest_dependencies_outside_the_checkout(
    tmp_path: Path, redis_url: str
) -> None:
    wheel = build(copy_tree(tmp_path, gitignore=True), "wheel", tmp_path / "dist")
    pins = lowest(wheel, {"serve", "redis"})
    assert {pin.split("==")[0] for pin in pins} >= {"aiohttp", "opentelemetry-api", "redis"}
    constraints = tmp_path / "lowest.txt"
    constraints.write_text("\n".join(pins) + "\n")

    home = tmp_path / "env"
    venv.create(home, with_pip=True)
    bin_dir = home / "bin"
    # Nothing of this checkout or its .venv reaches the new environment.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    python = str(bin_dir / "python")

    install = run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "-c",
            str(constraints),
            f"{wheel}[serve,redis]",
        ],
        elsewhere,
        env,
    )
    assert install.returncode == 0, install.stderr[-3000:]

    helped = run([str(bin_dir / "fallback-mw"), "--help"], elsewhere, env)
    assert helped.returncode == 0, helped.stderr
    assert "gameday" in helped.stdout
    version = run([python, "-m", "fallback_mw", "--version"], elsewhere, env)
    assert version.stdout.strip() == "fallback-mw 0.1.0 (pure Python)", version.stderr

    # The demo builds a Gateway (the meters, the aiohttp session) and walks a failover:
    # on the lowest versions every request of it answered 500 (a TypeError in each).
    demo = run([str(bin_dir / "fallback-mw"), "demo"], elsewhere, env)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "=> FAILED OVER to the backup" in demo.stdout
    assert "demo finished" in demo.stdout

    probe = textwrap.dedent(
        f"""
        import sys
        import fallback_mw
        from fallback_mw import Gateway, load_config
        print(fallback_mw.__file__)
        print([m for m in {HEAVY!r} if m in sys.modules])
        """
    )
    imported = run([python, "-c", probe], elsewhere, env)
    where, heavy = imported.stdout.splitlines()
    assert Path(where).is_relative_to(home), where
    assert heavy == "[]"

    # The shared breaker state on the lowest redis: a call answered (redis 5.0.0 lacked
    # Redis.from_pool: every breaker call hung, unanswered).
    shared = textwrap.dedent(
        f"""
        import asyncio
        from fallback_mw.config import BreakerConfig
        from fallback_mw.health.redis import RedisHealth

        async def main():
            health = RedisHealth({redis_url!r}, BreakerConfig())
            try:
                print(await asyncio.wait_for(health.admit("primary"), 20))
            finally:
                await health.aclose()

        asyncio.run(main())
        """
    )
    admitted = run([python, "-c", shared], elsewhere, env)
    assert admitted.stdout.strip() == "True", admitted.stderr[-3000:]

    # py.typed in the installed package: the public names are typed (a misuse is caught,
    # as it would not be if they were Any), and the correct program passes.
    program = elsewhere / "app.py"
    program.write_text(
        textwrap.dedent(
            """
            from fallback_mw import ConfigError, Gateway, GatewayConfig, load_config


            async def host(scope: object, receive: object, send: object) -> None:
                return None


            def make(path: str) -> Gateway:
                try:
                    config: GatewayConfig = load_config(path)
                except ConfigError as exc:
                    raise SystemExit(str(exc)) from exc
                return Gateway(host, config=config)


            deadline: str = load_config("gateway.toml").gateway.deadline_ms
            """
        )
    )
    mypy = [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--config-file"]
    checked = subprocess.run(
        [*mypy, os.devnull, "--python-executable", python, str(program)],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in checked.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, checked.stdout + checked.stderr
    assert 'expression has type "int", variable has type "str"' in errors[0]
