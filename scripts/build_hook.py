"""The wheel's build hook (hatchling's custom hook, pyproject.toml): with FALLBACK_MW_COMPILE
set, the wheel carries the compiled core, scripts/compile.py's mypyc build of the request
path's modules, beside every `.py` (a module not compiled runs interpreted).

    FALLBACK_MW_COMPILE=1 python -m build --wheel      # compiled, or the build fails
    FALLBACK_MW_COMPILE=1 FALLBACK_MW_PGO=1 python -m build --wheel   # + laid out by profile
    FALLBACK_MW_COMPILE=auto pip wheel .               # compiled if it can be, else pure
    python -m build                                    # unset or 0: the pure wheel and sdist

The compiled wheel is tagged for the interpreter and platform that built it
(`cp311-cp311-linux_x86_64`); the pure one is `py3-none-any`, as without this hook. With 1
the build fails in one line when there is no C compiler or Python headers or mypyc
fails: a release must not silently be pure. With `auto` it warns and builds the pure wheel.
Only when compiling does the build ask for mypy (as the dev extra pins it, mypyc is in it),
setuptools (mypyc builds the extensions with it) and the package's own dependencies
(mypyc type-checks the modules against them). The sdist carries this hook and
scripts/compile.py, so `pip install` of the sdist with FALLBACK_MW_COMPILE=1 compiles too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

VARIABLE = "FALLBACK_MW_COMPILE"
PGO_VARIABLE = "FALLBACK_MW_PGO"  # with a compiled build: compile.py --pgo
MODES = {"": "pure", "0": "pure", "1": "compiled", "auto": "auto"}
# mypyc type-checks the compiled modules as `mypy` does in the checkout, so the build asks
# for what that check reads: the extras' libraries (the httpx engine, the stores, the Redis
# state and OTel setup are followed from the request path's imports) and, from the dev
# extra, mypy itself (mypyc is in it), asyncpg's stubs and hypercorn (request/abort.py reads
# its Closed event). setuptools: mypyc builds the extensions with it.
TYPED_EXTRAS = ("serve", "postgres", "redis", "httpx", "otel")
FROM_DEV = ("mypy", "asyncpg-stubs", "hypercorn")
BUILD_TOOLS = ("setuptools>=70",)


class CompileFailed(Exception):
    pass


def wanted() -> str:
    """pure, compiled (or fail) or auto, from FALLBACK_MW_COMPILE."""
    value = os.environ.get(VARIABLE, "").strip().lower()
    if value not in MODES:
        raise SystemExit(
            f"fallback_mw build: {VARIABLE}={value!r} is not one of 1 (the compiled core, "
            "or fail), auto (compiled when it can be, else pure) and 0 (pure Python)"
        )
    return MODES[value]


def compiler_missing() -> str | None:
    """Why no extension module can be built here, or None."""
    # The one setuptools runs for mypyc: $CC, else the one this Python was built with.
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"no C compiler ({cc}) found: install gcc or clang, or name one in CC"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        python = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        return f"no Python headers ({headers}): install the {python}-dev package"
    return None


def pgo_option() -> list[str]:
    """compile.py's `--pgo` when FALLBACK_MW_PGO is 1: the compiled core built twice, laid
    out by a training run through `serve` on 127.0.0.1 (scripts/pgo_train.py; gcc only)."""
    value = os.environ.get(PGO_VARIABLE, "").strip()
    if value not in ("", "0", "1"):
        raise SystemExit(f"fallback_mw build: {PGO_VARIABLE}={value!r} is not 1 or 0")
    return ["--pgo"] if value == "1" else []


class CompiledCoreHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def dependencies(self) -> list[str]:
        if self.target_name != "wheel" or wanted() == "pure":
            return []
        from packaging.requirements import Requirement

        extras = self.metadata.core.optional_dependencies
        wanted_specs = [*BUILD_TOOLS, *self.metadata.core.dependencies]
        for extra in TYPED_EXTRAS:
            wanted_specs += extras[extra]
        wanted_specs += [spec for spec in extras["dev"] if Requirement(spec).name in FROM_DEV]
        return wanted_specs

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        self._out: Path | None = None
        if self.target_name != "wheel" or version != "standard":
            return  # the sdist carries sources; an editable install runs the checkout's
        mode = wanted()
        if mode == "pure":
            return
        try:
            out = self._compile()
        except CompileFailed as exc:
            if mode == "compiled":
                raise SystemExit(
                    f"fallback_mw build: {VARIABLE}=1 but the compiled core was not built: "
                    f"{exc} ({VARIABLE}=auto builds the pure wheel instead)"
                ) from None
            print(
                f"fallback_mw build: WARNING: the compiled core was not built ({exc}): "
                "this wheel is pure Python",
                file=sys.stderr,
                flush=True,
            )
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        package = out / "fallback_mw"
        built = [p for p in out.rglob("*") if p.suffix in (".so", ".pyd")]
        for path in [*built, package / "compiled_core.txt"]:
            build_data["force_include"][str(path)] = path.relative_to(out).as_posix()

    def _compile(self) -> Path:
        missing = compiler_missing()
        if missing is not None:
            raise CompileFailed(missing)
        script = Path(self.root) / "scripts" / "compile.py"
        if not script.is_file():
            raise CompileFailed(f"{script} is missing (build from a checkout or the sdist)")
        self._out = Path(tempfile.mkdtemp(prefix="fallback-mw-compiled-"))
        try:
            return self._run(script, self._out)
        except BaseException:  # a failure (1 stops the build, before finalize) or an interrupt
            self._remove_out()
            raise

    def _run(self, script: Path, out: Path) -> Path:
        # Its output (mypyc's, the compiler's) as it comes: minutes of it (`pip -v` shows it).
        process = subprocess.Popen(
            [sys.executable, str(script), "--out", str(out), *pgo_option()],
            cwd=self.root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        last = ""
        assert process.stdout is not None
        for line in process.stdout:
            sys.stderr.write(line)
            last = line.strip() or last
        if process.wait() != 0:
            raise CompileFailed(last or f"compile.py exited {process.returncode}")
        if not (out / "fallback_mw" / "compiled_core.txt").is_file():
            raise CompileFailed("compile.py --out left no compiled_core.txt")
        return out

    def _remove_out(self) -> None:
        out: Path | None = getattr(self, "_out", None)
        if out is not None:
            shutil.rmtree(out, ignore_errors=True)
            self._out = None

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        self._remove_out()  # the wheel holds what it was built with
