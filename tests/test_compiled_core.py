"""What `fallback-mw --version` and serve's start line say of the build
(fallback_mw/cli/compiled_core.py): pure Python, the compiled core whole, or what is wrong with
it (a module's extension missing, a source edited since the build, the runtime gone). On a
planted package: a record as scripts/compile.py writes it, extension modules as empty files
(only their presence is asked)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from fallback_mw.cli.compiled_core import RECORD, describe

ROOT = Path(__file__).resolve().parent.parent
SUFFIX = EXTENSION_SUFFIXES[0]
MODULES = ("gateway.py", "layers/resolver.py", "routing.py", "plan.py", "tokens.py")
RUNTIME = f"0123456789abcdef__mypyc{SUFFIX}"


def plant(root: Path, *, compiled: bool = True, record: bool = True) -> Path:
    package = root / "fallback_mw"
    for module in ("__init__.py", *MODULES):
        (package / module).parent.mkdir(parents=True, exist_ok=True)
        (package / module).write_text(f"# {module}\n")
    if compiled:
        (root / RUNTIME).write_bytes(b"")
        for module in MODULES:
            path = package / module
            path.with_name(path.stem + SUFFIX).write_bytes(b"")
    if record:
        lines = [f"# runtime: {RUNTIME}"] + [
            f"{m} {hashlib.sha256((package / m).read_bytes()).hexdigest()}" for m in MODULES
        ]
        (package / RECORD).write_text("\n".join(lines) + "\n")
    return package


def test_no_record_and_no_extension_is_pure_python(tmp_path: Path) -> None:
    assert describe(plant(tmp_path, compiled=False, record=False)) == "pure Python"


def test_a_whole_compiled_core_counts_its_modules(tmp_path: Path) -> None:
    assert describe(plant(tmp_path)) == "compiled core: 5 of 5 modules"


def test_a_module_whose_extension_is_missing_runs_interpreted_and_is_named(tmp_path: Path) -> None:
    package = plant(tmp_path)
    (package / "layers" / f"resolver{SUFFIX}").unlink()
    assert describe(package) == (
        "compiled core: 4 of 5 modules; 1 interpreted (layers/resolver.py)"
    )


def test_a_source_edited_since_the_build_is_stale(tmp_path: Path) -> None:
    # Its extension is still imported instead of it: the edit does not run.
    package = plant(tmp_path)
    for module in MODULES[:4]:
        (package / module).write_text("# edited\n")
    assert describe(package) == (
        "compiled core: 5 of 5 modules; 4 stale, their source changed since the build "
        "(gateway.py, layers/resolver.py, routing.py and 1 more)"
    )


def test_a_missing_runtime_is_said(tmp_path: Path) -> None:
    package = plant(tmp_path)
    (tmp_path / RUNTIME).unlink()
    assert describe(package) == (
        f"compiled core: 5 of 5 modules; its runtime {RUNTIME} missing: compiled modules "
        "fail to import"
    )


def test_extension_modules_no_build_recorded(tmp_path: Path) -> None:
    assert describe(plant(tmp_path, record=False)) == (
        "pure Python, but 5 extension modules of no recorded build beside it"
    )


def compile_script() -> object:
    spec = importlib.util.spec_from_file_location("fmw_compile_rec", ROOT / "scripts/compile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_the_record_compile_py_writes_is_the_one_read(tmp_path: Path) -> None:
    package = plant(tmp_path, record=False)
    script = compile_script()
    script.write_record(package, MODULES)  # type: ignore[attr-defined]
    assert describe(package) == "compiled core: 5 of 5 modules"
    (package / MODULES[0]).write_text("# edited\n")
    assert "1 stale" in describe(package)
