"""The compiled wheel as a platform team ships it (scripts/build_hook.py,
FALLBACK_MW_COMPILE=1): built once per session from a copy of the tree, with this
environment's mypyc and C compiler, then installed in a new virtual environment outside the
checkout. There `--version` says the core is compiled and whole, `fallback_mw.gateway` is an
extension module, and `fallback-mw serve` routes a request, and fails one over, to local
upstreams. pip asks the package index for the dependencies, as tests/test_fresh_install.py."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port, log_text, serve_process, wait_listening
from tests.test_compile_hazards import compile_script
from tests.test_packaging import build, copy_tree, shipped_sources
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.e2e

SUFFIX = str(sysconfig.get_config_var("EXT_SUFFIX"))
KEY = "compiled-wheel-secret-81d3"


@pytest.fixture(scope="session")
def compiled_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build per session: mypyc takes minutes (the whole file took 15 min at load 10)."""
    where = tmp_path_factory.mktemp("compiled-wheel")
    tree = copy_tree(where, gitignore=True)
    return build(tree, "wheel", where / "dist", {"FALLBACK_MW_COMPILE": "1"}, timeout=1800)


@pytest.fixture(scope="session")
def installed(compiled_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment holding the compiled wheel with the serve extra; its bin."""
    home = tmp_path_factory.mktemp("compiled-env") / "env"
    venv.create(home, with_pip=True)
    install = subprocess.run(
        [home / "bin" / "python", "-m", "pip", "install", "--quiet", f"{compiled_wheel}[serve]"],
        cwd=home,
        env=outside(home),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    return home / "bin"


def outside(home: Path) -> dict[str, str]:
    """Nothing of this checkout or its .venv reaches the new environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{home / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.slow  # the compiled core's build: minutes
def test_the_compiled_wheel_holds_the_extensions_and_every_source(compiled_wheel: Path) -> None:
    modules = compile_script().MODULES
    assert not compiled_wheel.name.endswith("-py3-none-any.whl"), compiled_wheel.name
    assert f"-cp{sys.version_info[0]}{sys.version_info[1]}-" in compiled_wheel.name
    with zipfile.ZipFile(compiled_wheel) as archive:
        names = set(archive.namelist())
        (tag,) = [n for n in names if n.endswith(".dist-info/WHEEL")]
        assert "Root-Is-Purelib: false" in archive.read(tag).decode()
    package = {n for n in names if ".dist-info/" not in n}
    extensions = {f"fallback_mw/{m.removesuffix('.py')}{SUFFIX}" for m in modules}
    (runtime,) = [n for n in package if "/" not in n and n.endswith(f"__mypyc{SUFFIX}")]
    # Every .py (what is not compiled runs interpreted), an extension beside each compiled
    # one, mypyc's runtime beside the package, and the build's record.
    assert package == (
        shipped_sources()
        | extensions
        | {runtime, "fallback_mw/py.typed", "fallback_mw/compiled_core.txt"}
    )


def run_in(installed: Path, argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, env=outside(installed.parent), capture_output=True, text=True, timeout=60
    )


@pytest.mark.slow  # the compiled core's build: minutes
def test_the_compiled_wheel_installed_elsewhere_says_it_is_compiled(
    installed: Path, tmp_path: Path
) -> None:
    count = len(compile_script().MODULES)
    version = run_in(installed, [str(installed / "fallback-mw"), "--version"], tmp_path)
    assert version.stdout == f"fallback-mw 0.1.0 (compiled core: {count} of {count} modules)\n", (
        version.stderr
    )
    probe = textwrap.dedent(
        """
        import fallback_mw.gateway as gateway
        print(type(gateway.__loader__).__name__)
        print(gateway.__file__)
        """
    )
    imported = run_in(installed, [str(installed / "python"), "-c", probe], tmp_path)
    loader, where = imported.stdout.split()
    assert loader == "ExtensionFileLoader", imported.stderr
    assert where.endswith(SUFFIX) and Path(where).is_relative_to(installed.parent), where


@pytest.mark.slow  # the compiled core's build: minutes
@pytest.mark.anyio
async def test_the_compiled_wheel_installed_elsewhere_serves_and_fails_over(
    installed: Path, tmp_path: Path
) -> None:
    env = outside(installed.parent)
    count = len(compile_script().MODULES)
    async with (
        upstream(status_handler(200, b"from the primary")) as primary,
        upstream(status_handler(503)) as failing,
    ):
        config = tmp_path / "gateway.toml"
        config.write_text(
            '[gateway]\nallow_hosts = ["127.0.0.1"]\n'
            f'[upstreams.primary]\nurl = "{primary.url}"\nauth_env = "FMW_WHEEL_KEY"\n'
            f'[upstreams.failing]\nurl = "{failing.url}"\nauth_env = "FMW_WHEEL_KEY"\n'
            '[[routes]]\nid = "direct"\nprefix = "/v1/"\nplan = ["primary"]\n'
            '[[routes]]\nid = "over"\nprefix = "/over/"\nplan = ["failing", "primary"]\n'
            "retries = 1\n",
            encoding="utf-8",
        )
        port = free_port()
        log = tmp_path / "serve.log"
        with serve_process(
            config,
            port,
            log,
            env={**env, "FMW_WHEEL_KEY": KEY},
            # The installed environment's own command, from outside the checkout.
            executable=[str(installed / "fallback-mw")],
            cwd=tmp_path,
        ) as process:
            await wait_listening(process, port, log)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                routed = await client.get("/v1/models")
                over = await client.get("/over/models")
        assert process.returncode == 0, log_text(log)
    assert routed.status_code == 200 and routed.content == b"from the primary", log_text(log)
    assert routed.headers["x-gateway-provider"] == "primary"
    assert over.status_code == 200 and over.headers["x-gateway-attempts"] == "2", log_text(log)
    assert dict(primary.received[0].headers)["authorization"] == f"Bearer {KEY}"
    compiled = f"fallback-mw 0.1.0 (compiled core: {count} of {count} modules)"
    assert f"INFO fallback_mw starting {compiled}\n" in log_text(log)
