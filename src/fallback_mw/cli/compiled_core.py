"""Which build of the package this is: pure Python, or the compiled core (the request path's
modules built with mypyc, scripts/compile.py), and whether that core is whole. Said by
`fallback-mw --version` and in serve's start line; worked out once, never per request.

A compiled build carries a record in the package, fallback_mw/compiled_core.txt (written by
scripts/compile.py, in place or with --out, and so in a compiled wheel): the mypyc runtime
library it needs, then one line per compiled module with the SHA-256 of the source it was
built from. A module is compiled when an extension module is beside its `.py` (Python
imports that one instead) and the `.py` is the source recorded: an edited source is stale
(its compiled module still runs the old code), a missing extension is interpreted."""

from __future__ import annotations

import functools
import hashlib
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

RECORD = "compiled_core.txt"
RUNTIME_PREFIX = "# runtime: "
PACKAGE = Path(__file__).resolve().parent.parent  # fallback_mw


def source_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _extension(path: Path) -> Path | None:
    for suffix in EXTENSION_SUFFIXES:
        built = path.with_name(path.stem + suffix)
        if built.is_file():
            return built
    return None


def describe(package: Path = PACKAGE) -> str:
    """`compiled core: 77 of 77 modules`, `pure Python`, or what is wrong with the core."""
    record = package / RECORD
    try:
        lines = record.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        strays = sum(1 for _ in package.rglob("*.so")) + sum(1 for _ in package.rglob("*.pyd"))
        if strays:  # extension modules no build of ours recorded (a build by hand)
            return f"pure Python, but {strays} extension modules of no recorded build beside it"
        return "pure Python"
    except OSError as exc:
        return f"compiled core: its record {RECORD} unreadable ({exc.strerror or exc})"
    runtime = ""
    modules: list[tuple[str, str]] = []
    for line in lines:
        if line.startswith(RUNTIME_PREFIX):
            runtime = line.removeprefix(RUNTIME_PREFIX).strip()
        elif line.strip() and not line.startswith("#"):
            name, _, digest = line.partition(" ")
            modules.append((name, digest.strip()))
    missing: list[str] = []
    stale: list[str] = []
    for name, digest in modules:
        source = package / name
        if _extension(source) is None:
            missing.append(name)
        elif not source.is_file() or source_hash(source) != digest:
            stale.append(name)
    compiled = len(modules) - len(missing)
    said = f"compiled core: {compiled} of {len(modules)} modules"
    problems = []
    if runtime and not (package.parent / runtime).is_file():
        problems.append(f"its runtime {runtime} missing: compiled modules fail to import")
    if missing:
        problems.append(f"{len(missing)} interpreted ({_names(missing)})")
    if stale:
        problems.append(
            f"{len(stale)} stale, their source changed since the build ({_names(stale)})"
        )
    return f"{said}; {'; '.join(problems)}" if problems else said


def _names(modules: list[str]) -> str:
    shown = ", ".join(modules[:3])
    return shown + (f" and {len(modules) - 3} more" if len(modules) > 3 else "")


@functools.cache
def build() -> str:
    """describe() of the installed package, once per process."""
    return describe()


def version_line() -> str:
    """`fallback-mw 0.1.0 (compiled core: 77 of 77 modules)`, `fallback-mw 0.1.0 (pure Python)`."""
    from fallback_mw import __version__

    return f"fallback-mw {__version__} ({build()})"
