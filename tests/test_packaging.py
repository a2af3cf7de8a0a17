"""The package as a user gets it: the wheel and the sdist, built from a copy of this tree by
the build backend pyproject.toml names (hatchling, in the dev extra: no index is asked), hold
the package and nothing from a developer's checkout; the sdist builds the same wheel on its
own. tests/test_fresh_install.py installs the wheel in a new virtual environment."""

from __future__ import annotations

import email
import email.message
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure_pass_only(
    reason="hatchling builds the wheel and sdist from a copy of the source tree; "
    "nothing of the package runs, nor of build/compiled"
)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "fallback_mw"

# What scripts/compile.py leaves in a tree after a build: an extension module beside each
# compiled .py, mypyc's shared runtime beside the package, its C sources under build/.
COMPILED_LEFTOVERS = (
    "src/fallback_mw/request/context.cpython-311-x86_64-linux-gnu.so",
    "src/fallback_mw/layers/resolver.cpython-311-x86_64-linux-gnu.so",
    "src/fallback_mw/routing.cp311-win_amd64.pyd",
    "src/0123456789abcdef__mypyc.cpython-311-x86_64-linux-gnu.so",
    "build/mypyc/build/__native_0123456789abcdef.c",
    # Its record of what it compiled: in a pure wheel, --version would say compiled.
    "src/fallback_mw/compiled_core.txt",
)


# The wheel's build hook and what it runs to compile (scripts/build_hook.py).
BUILD_SCRIPTS = ("scripts/build_hook.py", "scripts/compile.py", "scripts/pgo_train.py")


def copy_tree(to: Path, *, gitignore: bool) -> Path:
    """The files a build reads (pyproject.toml, README.md, the build hook, src/), as a fresh
    clone has them, plus a compiled core as scripts/compile.py leaves it; .gitignore only
    when asked: a tree without it (an export, another VCS) must not ship what it would have
    hidden."""
    tree = to / "tree"
    tree.mkdir()
    for path in ROOT.iterdir():  # pyproject.toml, README.md, LICENSE, ...
        if path.is_file() and (not path.name.startswith(".") or gitignore):
            shutil.copy2(path, tree / path.name)
    (tree / "scripts").mkdir()
    for script in BUILD_SCRIPTS:
        shutil.copy2(ROOT / script, tree / script)
    shutil.copytree(
        PACKAGE,
        tree / "src" / "fallback_mw",
        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"),
    )
    for leftover in COMPILED_LEFTOVERS:
        path = tree / leftover
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x7fELF not really")
    return tree


def backend(
    tree: Path, call: str, out: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """One of hatchling's PEP 517 hooks (`build_wheel`, `get_requires_for_build_wheel`...)
    run in `tree`, as pip or `python -m build` would; FALLBACK_MW_COMPILE only from `env`."""
    hook = f"import sys, hatchling.build as b; print(b.{call}(sys.argv[1]))"
    if call.startswith("get_requires"):
        hook = f"import hatchling.build as b; print('\\n'.join(b.{call}()))"
    environ = {k: v for k, v in os.environ.items() if k != "FALLBACK_MW_COMPILE"}
    return subprocess.run(
        [sys.executable, "-c", hook, str(out)],
        cwd=tree,
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def build(
    tree: Path, kind: str, out: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> Path:
    """Build one artifact with hatchling's PEP 517 hooks, as pip or `python -m build` would."""
    out.mkdir(exist_ok=True)
    result = backend(tree, f"build_{kind}", out, env, timeout)
    assert result.returncode == 0, result.stderr
    return out / result.stdout.strip().splitlines()[-1]


def shipped_sources() -> set[str]:
    return {
        path.relative_to(PACKAGE.parent).as_posix()
        for path in PACKAGE.rglob("*.py")
        if "__pycache__" not in path.parts
    }


def wheel_files(wheel: Path) -> tuple[set[str], set[str]]:
    """The wheel's package files and its .dist-info files."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    info = {name for name in names if ".dist-info/" in name}
    return names - info, info


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(archive.read(name))


@pytest.mark.parametrize("gitignore", [True, False], ids=["with-gitignore", "no-gitignore"])
def test_the_wheel_holds_the_package_and_nothing_compiled(tmp_path: Path, gitignore: bool) -> None:
    # A .so left by scripts/compile.py, packed into a py3-none-any wheel, would be imported
    # instead of its .py on every machine that installs it (and fail there, its mypyc
    # runtime left behind): whatever the tree holds, the wheel is the pure-Python package.
    wheel = build(copy_tree(tmp_path, gitignore=gitignore), "wheel", tmp_path / "dist")
    files, info = wheel_files(wheel)
    assert files == shipped_sources() | {"fallback_mw/py.typed"}
    assert wheel.name == "fallback_mw-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        (tag,) = [n for n in info if n.endswith("/WHEEL")]
        assert "Root-Is-Purelib: true" in archive.read(tag).decode()


def test_the_sdist_holds_no_compiled_core_and_builds_the_same_wheel(tmp_path: Path) -> None:
    tree = copy_tree(tmp_path, gitignore=False)
    sdist = build(tree, "sdist", tmp_path / "dist")
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
        archive.extractall(tmp_path / "unpacked", filter="data")
    leftovers = [n for n in names if n.endswith((".so", ".pyd", ".c")) or "/build/" in n]
    assert leftovers == []
    assert not [n for n in names if n.endswith("compiled_core.txt")]
    # What FALLBACK_MW_COMPILE=1 needs to compile from the sdist (`pip install` of it).
    (top,) = {n.split("/")[0] for n in names}
    assert {f"{top}/{script}" for script in BUILD_SCRIPTS} <= set(names)
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    files, _ = wheel_files(build(unpacked, "wheel", tmp_path / "from-sdist"))
    assert files == shipped_sources() | {"fallback_mw/py.typed"}


def test_the_wheel_metadata_a_resolver_reads(tmp_path: Path) -> None:
    import fallback_mw

    wheel = build(copy_tree(tmp_path, gitignore=True), "wheel", tmp_path / "dist")
    meta = metadata(wheel)
    assert meta["Name"] == "fallback_mw"
    assert meta["Version"] == fallback_mw.__version__
    assert meta["Requires-Python"] == ">=3.11"
    _, info = wheel_files(wheel)
    with zipfile.ZipFile(wheel) as archive:
        (points,) = [n for n in info if n.endswith("/entry_points.txt")]
        text = archive.read(points).decode()
    assert "[console_scripts]\nfallback-mw = fallback_mw.cli:main" in text


def test_the_wheel_and_the_sdist_carry_the_licence_they_declare(tmp_path: Path) -> None:
    # Apache-2.0 asks that whoever redistributes the work give its recipients a copy of the
    # licence: a wheel that declares it carries the text, and says which one it is (PEP 639).
    tree = copy_tree(tmp_path, gitignore=True)
    wheel = build(tree, "wheel", tmp_path / "dist")
    assert metadata(wheel)["License-Expression"] == "Apache-2.0"
    _, info = wheel_files(wheel)
    with zipfile.ZipFile(wheel) as archive:
        texts = [archive.read(n).decode() for n in info if "/licenses/" in n]
    assert len(texts) == 1
    assert "Apache License" in texts[0] and "Version 2.0, January 2004" in texts[0]
    with tarfile.open(build(tree, "sdist", tmp_path / "dist")) as archive:
        assert any(name.endswith("/LICENSE") for name in archive.getnames())


# The oldest release of each dependency the gateway was seen to work on, and what failed on
# the one before (each found by installing the wheel with that release and running this
# suite's tests of the feature; tests/test_fresh_install.py runs the base and the serve and
# redis extras at the declared bounds). pip keeps an installed release that satisfies the
# bound, so a bound below these hands a user the failure named here.
KNOWN_LOWEST = {
    # 3.9-3.13.3: no ClientSession(max_headers=), every routed request a 500.
    "aiohttp": ("3.14", "an early answer to a chunked upload became a local 502"),
    # 1.25-1.29: create_histogram's bucket advisory missing, Gateway() a TypeError.
    "opentelemetry-api": ("1.40", "without an SDK the caller's traceparent was dropped"),
    "anyio": ("4.4", "an httpx-engine first-byte timeout escaped as a CancelledError"),
    "uvicorn": ("0.53", "HTTP/1.0 clients got chunk sizes in the body; websockets.legacy"),
    "redis": ("5.0.2", "5.0.0: no Redis.from_pool, breaker calls hung; 5.0.1: login errors"),
    "asyncpg": ("0.30", "Pool(connect=): every ledger call a TypeError"),
    "httpx": ("0.28", "an upstream URL's `|` and `^` re-encoded: another path upstream"),
    "django": ("5.2.13", "a DEBUG page showed the caller's key; x_tenant_id refused"),
    "opentelemetry-sdk": ("1.40", "pins the API it belongs to"),
}


def test_no_dependency_admits_a_release_the_gateway_fails_on(tmp_path: Path) -> None:
    from packaging.requirements import Requirement
    from packaging.version import Version

    wheel = build(copy_tree(tmp_path, gitignore=True), "wheel", tmp_path / "dist")
    bounds: dict[str, Version] = {}
    for line in metadata(wheel).get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        for spec in requirement.specifier:
            if spec.operator == ">=":
                found = Version(spec.version)
                bounds[requirement.name] = min(found, bounds.get(requirement.name, found))
    too_low = [
        f"{name}>={bounds[name]} admits {name} below {oldest}: {why}"
        for name, (oldest, why) in KNOWN_LOWEST.items()
        if bounds[name] < Version(oldest)
    ]
    assert too_low == []


# The build hook (scripts/build_hook.py): FALLBACK_MW_COMPILE unset or 0 is the pure wheel
# above, asking for nothing more to build it; 1 compiles or fails; auto falls back to pure.


@pytest.mark.parametrize("value", [None, "0", ""], ids=["unset", "zero", "empty"])
def test_without_compiling_the_build_asks_for_nothing_more(
    tmp_path: Path, value: str | None
) -> None:
    tree = copy_tree(tmp_path, gitignore=True)
    env = None if value is None else {"FALLBACK_MW_COMPILE": value}
    asked = backend(tree, "get_requires_for_build_wheel", tmp_path, env)
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout.strip() == ""
    wheel = build(tree, "wheel", tmp_path / "dist", env)
    assert wheel.name == "fallback_mw-0.1.0-py3-none-any.whl"


def test_compiling_asks_for_the_dev_extras_mypy_and_what_it_type_checks(tmp_path: Path) -> None:
    from packaging.requirements import Requirement

    tree = copy_tree(tmp_path, gitignore=True)
    asked = backend(tree, "get_requires_for_build_wheel", tmp_path, {"FALLBACK_MW_COMPILE": "1"})
    assert asked.returncode == 0, asked.stderr
    specs = {Requirement(line).name: line for line in asked.stdout.splitlines()}
    (mypy,) = [line for line in metadata_of_dev() if Requirement(line).name == "mypy"]
    assert specs["mypy"] == mypy and "==" in mypy  # the one the hazards were checked on
    assert {"setuptools", "pydantic", "aiohttp", "httpx", "asyncpg", "redis"} <= set(specs)


def metadata_of_dev() -> list[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(project["optional-dependencies"]["dev"])


NO_COMPILER = {"CC": "/nonexistent/cc"}


def test_compiling_without_a_c_compiler_fails_in_one_line(tmp_path: Path) -> None:
    # A release built where nothing can compile must not silently be the pure wheel.
    tree = copy_tree(tmp_path, gitignore=True)
    env = {"FALLBACK_MW_COMPILE": "1", **NO_COMPILER}
    result = backend(tree, "build_wheel", tmp_path / "dist", env)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("fallback_mw build: FALLBACK_MW_COMPILE=1 but the compiled core")
    assert "no C compiler (/nonexistent/cc)" in line
    assert not list((tmp_path / "dist").glob("*.whl"))


def test_auto_without_a_c_compiler_builds_the_pure_wheel_and_warns(tmp_path: Path) -> None:
    tree = copy_tree(tmp_path, gitignore=True)
    env = {"FALLBACK_MW_COMPILE": "auto", **NO_COMPILER}
    (tmp_path / "dist").mkdir()
    result = backend(tree, "build_wheel", tmp_path / "dist", env)
    assert result.returncode == 0, result.stderr
    assert "WARNING: the compiled core was not built (no C compiler" in result.stderr
    wheel = tmp_path / "dist" / result.stdout.strip().splitlines()[-1]
    assert wheel.name == "fallback_mw-0.1.0-py3-none-any.whl"
    files, _ = wheel_files(wheel)
    assert files == shipped_sources() | {"fallback_mw/py.typed"}


def test_a_value_compile_does_not_know_is_refused_in_one_line(tmp_path: Path) -> None:
    tree = copy_tree(tmp_path, gitignore=True)
    result = backend(tree, "build_wheel", tmp_path, {"FALLBACK_MW_COMPILE": "yes"})
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("fallback_mw build: FALLBACK_MW_COMPILE='yes' is not one of 1")


def _compile_script_that(tree: Path, does: str) -> None:
    """scripts/compile.py in `tree` replaced by one that `does` (Python, `out` the --out DIR):
    the hook's part is run, not minutes of mypyc."""
    (tree / "scripts" / "compile.py").write_text(
        f"import sys\nfrom pathlib import Path\nout = Path(sys.argv[2])\n{does}\n",
        encoding="utf-8",
    )


@pytest.mark.parametrize("mode", ["1", "auto"])
def test_a_failed_compile_leaves_no_temporary_directory(tmp_path: Path, mode: str) -> None:
    """The hook's --out directory (fallback-mw-compiled-*, in the temporary directory) was
    left behind by each build whose compile failed with FALLBACK_MW_COMPILE=1: a CI
    retrying a release build filled its /tmp with them."""
    tree = copy_tree(tmp_path, gitignore=True)
    _compile_script_that(tree, "print('compile.py: mypyc failed (forced)'); sys.exit(1)")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    (tmp_path / "dist").mkdir()
    env = {"FALLBACK_MW_COMPILE": mode, "TMPDIR": str(temporary)}
    result = backend(tree, "build_wheel", tmp_path / "dist", env)
    assert "compile.py: mypyc failed (forced)" in result.stderr, result.stderr
    assert result.returncode == (1 if mode == "1" else 0), result.stderr
    assert list(temporary.iterdir()) == []


@pytest.mark.parametrize(("value", "passed"), [("1", True), ("0", False), (None, False)])
def test_fallback_mw_pgo_asks_compile_py_for_the_profiled_build(
    tmp_path: Path, value: str | None, passed: bool
) -> None:
    """FALLBACK_MW_PGO=1 (with a compiled build) runs compile.py with --pgo (tests/test_pgo.py
    has what --pgo does); 0 or unset, without."""
    tree = copy_tree(tmp_path, gitignore=True)
    _compile_script_that(tree, "print('compile.py given', sys.argv[1:]); sys.exit(1)")
    env = {"FALLBACK_MW_COMPILE": "1"} | ({} if value is None else {"FALLBACK_MW_PGO": value})
    result = backend(tree, "build_wheel", tmp_path, env)
    assert result.returncode == 1
    assert "compile.py given ['--out'," in result.stderr, result.stderr
    assert ("'--pgo']" in result.stderr) is passed


def test_a_pgo_value_the_hook_does_not_know_is_refused_in_one_line(tmp_path: Path) -> None:
    tree = copy_tree(tmp_path, gitignore=True)
    env = {"FALLBACK_MW_COMPILE": "1", "FALLBACK_MW_PGO": "yes"}
    result = backend(tree, "build_wheel", tmp_path, env)
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line == "fallback_mw build: FALLBACK_MW_PGO='yes' is not 1 or 0"


def test_a_compiled_build_leaves_no_temporary_directory(tmp_path: Path) -> None:
    tree = copy_tree(tmp_path, gitignore=True)
    _compile_script_that(
        tree,
        "(out / 'fallback_mw').mkdir()\n"
        "(out / 'fallback_mw' / 'compiled_core.txt').write_text('# runtime: none\\n')",
    )
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {"FALLBACK_MW_COMPILE": "1", "TMPDIR": str(temporary)}
    wheel = build(tree, "wheel", tmp_path / "dist", env)
    assert "fallback_mw/compiled_core.txt" in wheel_files(wheel)[0]
    assert list(temporary.iterdir()) == []
