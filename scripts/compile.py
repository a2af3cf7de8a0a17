"""An opt-in compiled core: the request path's modules built with mypyc (the one in the dev
extra's mypy) as C extensions beside their sources, in place. The default install, and
every checkout, is pure Python; nothing imports this script.

    .venv/bin/python scripts/compile.py            # build (needs a C compiler, 2-4 minutes)
    .venv/bin/python scripts/compile.py --clean    # back to pure Python: the .so files gone
    .venv/bin/python scripts/compile.py --check    # only the checks below, no build
    .venv/bin/python scripts/compile.py --list     # the modules compiled
    .venv/bin/python scripts/compile.py --out DIR  # a compiled copy in DIR; src/ untouched

An extension module beside its `.py` is imported instead of it, so an editable install
(`pip install -e .`, scripts/venv.sh) runs the compiled modules from then on, until
`--clean`; a source edit is not seen by a compiled module until it is built again
(`--status` says which modules are compiled and which are stale). Tests, benchmarks and
`scripts/mutants.py` run whatever is in place (mutants.py imports a copy of the sources).

`--out DIR` leaves src/ alone: it builds a complete compiled copy of the package in DIR
(DIR/fallback_mw with every `.py` and an extension module beside each listed one, mypyc's
shared runtime beside the package), which `PYTHONPATH=DIR` imports ahead of the editable
install (scripts/test.sh's compiled pass, in build/compiled). DIR keeps a digest of what
it was built from (the package's files, the list, mypy's version, the Python's extension
suffix, pyproject.toml); a second run from the same sources builds nothing.

Six shapes compile wrong with mypyc (mypy 2.4.1), each checked in every listed module
before a build, naming the line (docs/performance.md, "A compiled core"):

- an `await` in a `finally`: after the `finally` the compiled coroutine re-raises whatever
  `sys.exc_info()` holds, a stale exception (a `CancelledError` that was already turned
  into a deadline) included. Do the cleanup in `except BaseException as exc: ...; raise
  exc` plus the normal path.
- a bare `raise` after an `await` in an `except` block: a compiled coroutine keeps the
  exception it handles in the thread's exception state, which every other task's compiled
  handler also sets and restores while this one is suspended, so a bare `raise` after the
  suspension re-raises another task's exception, or none (`TypeError: invalid exception
  object`, the task never finishes). `raise exc` by name.
- an `async with`: its exit on an exception is awaited, then the exception re-raised from
  that same thread state (the bare `raise` above). Not used in a listed module.
- an `async def __call__` in a Python class (`@python_class`, or any decorator but
  mypyc's own and `dataclass`): compiled, a Python class's coroutine method is no
  coroutine function to `inspect`, so uvicorn and hypercorn, which tell an ASGI 3 app by
  `iscoroutinefunction(app.__call__)`, serve it as ASGI 2 (every request a 500). Assign a
  module-level `async def` instead (`__call__ = _serve`): compiled, that one is.
- `object.__new__(cls)` of a class a listed module defines: compiled, that class is a
  native class, whose instances `object.__new__` refuses (`TypeError: object.__new__(X)
  is not safe, use X.__new__()`). Read `X.__new__` after the class (`_new = X.__new__`):
  `object.__new__` interpreted, the native one compiled (`cls.__new__(cls)` in a method
  of X is an internal mypyc error).

- an `X | None` local of an `async def`, assigned in a `try` and read in its `finally`:
  the compiled coroutine keeps it across an await as the `X` the assignment narrowed it
  to, so the `finally` after a return before the assignment refuses its None (`TypeError:
  X object expected; got None`, failover/send.py's request on a fault's early return).
  Type it `object` and ask `isinstance` in the `finally`.

And mypyc refuses async generators (`yield` in an `async def`): modules with one stay
interpreted.

One shape compiles slow, and is checked as the others: a module-level constant (an
UPPER_CASE name) without `Final`. Compiled, such a name is looked up in the module's
dictionary at every use (about 140 instructions; some 200 a healthy request before they
were marked), a `Final` one is a C static or a literal. A constant tests replace while the
gateway runs (`monkeypatch.setattr`) says so on its line or the line above, `# not Final:
<why>`: compiled code would not see the replacement.

`--check` also reads the tests the compiled pass runs: one that replaces what compiled code
reads directly (a `Final` constant, a compiled module's function or class, a native class's
method) runs there without its replacement, and passes without checking anything. Skip it
in the compiled pass (`skipif(COMPILED, ...)`), or say on the line (or the line above)
`# compiled: <why>` when only interpreted code reads it.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PACKAGE = SRC / "fallback_mw"
BUILD = ROOT / "build" / "mypyc"

# The request path (STYLE.md's layers, in request order, and what they call per request),
# less what mypyc cannot build or what then misbehaves (each left out with its reason):
#   upstream/httpx_*.py, health/quota.py, loops.py: async generators, which mypyc refuses
#     (the body reader's, the engine seam's and the aiohttp engine's are async iterator
#     classes for that reason: request/body.py, upstream/timed_body.py TimedBody,
#     upstream/aiohttp_engine.py _Chunks).
#   upstream/aiohttp_connector.py: its connector and resolver subclass aiohttp's (Python
#     classes, which a native class cannot inherit from), and the lookup's timeout is an
#     `async with`.
#   upstream/aiohttp_request.py: its OneWriteRequest subclasses aiohttp's ClientRequest (a
#     Python class), and its session path is the one the engine keeps under another aiohttp.
#   upstream/guard.py: UnsafeAddressError inherits from OSError ("Inheriting from most
#     builtin types is unimplemented").
#   config/*: pydantic models (their validators and the plugin's fields).
#   telemetry/line_writer.py: compiled, one CI run's `serve --workers 2` stop hung past 30 s
#     after its output's reader had gone (tests/e2e/test_serve_workers.py, the compiled
#     pass); not reproduced in seven runs by hand nor in the CI run before. Interpreted
#     until that is understood.
#   cli/server_limits.py, cli/httptools_framing.py: mixins, put before uvicorn's protocol
#     classes in a class made per server; compiled, a `@python_class`'s methods refuse an
#     instance of any subclass (`TypeError: _HeadGuard object expected; got
#     GuardedHttpToolsProtocol`), and a native class cannot be mixed with a Python one.
#   health/__init__.py, health/memory.py: their classes are subclassed (AlwaysHealthy,
#     MemoryHealth: by the tests, and a deployment's own health state may), and an
#     interpreted class cannot inherit from a compiled one.
#     MemoryHealth's per-attempt calls are compiled in health/memory_calls.py.
# gateway.py's Gateway is weakly referenced: a `@python_class` (fallback_mw/python_class.py)
# whose `__call__` is a module-level `async def`, as the plan walker's.
MODULES = (
    "layers/resolver.py",
    "layers/head.py",
    "layers/injector.py",
    "layers/limits.py",
    "layers/walker/walker.py",
    "layers/walker/walk.py",
    "layers/walker/kit.py",
    "layers/walker/retry_after.py",
    "layers/walker/cursor.py",
    "layers/walker/disconnect.py",
    "layers/walker/hedge.py",
    "layers/walker/max_forwards.py",
    "layers/walker/preflight.py",
    "layers/walker/stream.py",
    "layers/walker/own_urls.py",
    "layers/walker/via.py",
    "failover/attempt.py",
    "failover/send.py",
    "failover/decide.py",
    "failover/outcome.py",
    "failover/replay.py",
    "failover/messages.py",
    "failover/deadline_messages.py",
    "request/context.py",
    "request/records.py",
    "request/codings.py",
    "request/local_errors.py",
    "request/record.py",
    "request/usage.py",
    "request/usage_documents.py",
    "request/abort.py",
    "request/frames.py",
    "security/fields.py",
    "security/answers.py",
    "security/queries.py",
    "security/values.py",
    "security/addresses.py",
    "routing.py",
    "spelling.py",
    "plan.py",
    "credentials.py",
    "injected.py",
    "tokens.py",
    "budget/cost.py",
    "budget/records.py",
    "health/breaker.py",
    "health/pool.py",
    "health/memory_calls.py",
    "capacity/__init__.py",
    "capacity/memory.py",
    "capacity/model.py",
    "telemetry/core.py",
    "telemetry/ends.py",
    "telemetry/shadow_spans.py",
    "telemetry/spans.py",
    "telemetry/redact.py",
    "telemetry/request_log.py",
    "telemetry/propagation.py",
    "telemetry/genai.py",
    "shadow.py",
    "request/body.py",
    "request/body_json.py",
    "upstream/base.py",
    "upstream/outgoing.py",
    "upstream/timed_body.py",
    "upstream/aiohttp_engine.py",
    "upstream/aiohttp_lean.py",
    "upstream/caps.py",
    "request/secrets.py",
    "timers.py",
    "layers/guard.py",
    "gateway.py",
    "layers/charge.py",
    "request/refusals.py",
    "cli/head_with_body.py",
    "cli/otlp_spans.py",
    "request/connection_loss.py",
)


def _awaits(nodes: list[ast.stmt]) -> ast.AST | None:
    for statement in nodes:
        for node in ast.walk(statement):
            if isinstance(node, ast.Await | ast.AsyncWith | ast.AsyncFor):
                return node
    return None


def _own_nodes(function: ast.AsyncFunctionDef) -> list[ast.AST]:
    """The function's nodes, not those of functions or classes defined in it."""
    nested = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda
    found: list[ast.AST] = []
    stack: list[ast.AST] = [node for node in function.body if not isinstance(node, nested)]
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, nested))
    return found


# Class decorators under which mypyc still makes a native class; any other leaves a Python class.
NATIVE_DECORATORS = frozenset({"dataclass", "final", "mypyc_attr", "trait"})


def _python_class(cls: ast.ClassDef) -> bool:
    for decorator in cls.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        named = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if named not in NATIVE_DECORATORS:
            return True
    return False


_CONSTANT = re.compile(r"_*[A-Z][A-Z0-9_]*")
_TYPE_MAKERS = frozenset({"TypeVar", "ParamSpec", "TypeVarTuple", "NewType"})


def _slow_constants(tree: ast.Module, lines: list[str]) -> list[tuple[int, str]]:
    """The module-level constants `tree` assigns without Final (line, name): neither
    written with `global`, nor a type variable, nor marked `# not Final:` on their line or
    the line above."""
    written = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            if "Final" in ast.unparse(node.annotation):
                continue
            target, value = node.target, node.value
        else:
            continue
        said = lines[max(node.lineno - 2, 0) : node.lineno]  # its line, or the line above
        if any("# not Final:" in line for line in said):
            continue
        # `A, B = 0, 1`: each name is reported (Final takes one name at a time).
        targets = target.elts if isinstance(target, ast.Tuple) else [target]
        names = [n.id for n in targets if isinstance(n, ast.Name)]
        maker = value.func if isinstance(value, ast.Call) else None
        if isinstance(maker, ast.Name | ast.Attribute) and (
            (maker.id if isinstance(maker, ast.Name) else maker.attr) in _TYPE_MAKERS
        ):
            continue
        found.extend((node.lineno, n) for n in names if _CONSTANT.fullmatch(n) and n not in written)
    return found


def hazards(path: Path) -> list[str]:
    """What in `path` mypyc would compile wrong or refuse, or compile slow, one line each."""
    found: list[str] = []
    name = path.relative_to(SRC) if path.is_relative_to(SRC) else path
    text = path.read_text()
    tree = ast.parse(text, str(path))
    for line, constant in _slow_constants(tree, text.splitlines()):
        found.append(
            f"{name}:{line}: a module-level constant without Final ({constant}: compiled, "
            "looked up in the module's dictionary at every use)"
        )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "__new__"
            and isinstance(node.value, ast.Name)
            and node.value.id == "object"
        ):
            found.append(f"{name}:{node.lineno}: object.__new__ (a compiled class refuses it)")
        elif isinstance(node, ast.ClassDef) and _python_class(node):
            for method in node.body:
                if isinstance(method, ast.AsyncFunctionDef) and method.name == "__call__":
                    found.append(
                        f"{name}:{method.lineno} ({node.name}): an async def __call__ in a "
                        "Python class (an ASGI server takes it for ASGI 2)"
                    )
    for function in ast.walk(tree):
        if not isinstance(function, ast.AsyncFunctionDef):
            continue
        for node in _own_nodes(function):
            where = f"{name}:{getattr(node, 'lineno', function.lineno)} ({function.name})"
            if isinstance(node, ast.Yield | ast.YieldFrom):
                found.append(f"{where}: an async generator (mypyc refuses them)")
            elif isinstance(node, ast.Try | ast.TryStar) and _awaits(node.finalbody):
                found.append(f"{where}: an await in a finally")
            elif isinstance(node, ast.ExceptHandler) and _awaits(node.body):
                for statement in node.body:
                    for inner in ast.walk(statement):
                        if isinstance(inner, ast.Raise) and inner.exc is None:
                            found.append(
                                f"{name}:{inner.lineno} ({function.name}): a bare raise after "
                                "an await in an except block"
                            )
            elif isinstance(node, ast.AsyncWith):
                found.append(f"{where}: an async with")
            elif isinstance(node, ast.Try | ast.TryStar) and node.finalbody:
                for name in sorted(_optional_locals(function) & _kept_into(node)):
                    found.append(
                        f"{where}: an optional local assigned in a try and read in its "
                        f"finally ({name})"
                    )
    return found


# A test that replaces what the compiled core reads directly sees no replacement in the
# compiled pass: a `Final` constant is a C static or a literal, a compiled module's function
# or class is called natively by its compiled callers, a native class's method is bound in C.
# Such a test passes there without checking anything (a counter that stays at 0 passes
# `calls <= 1`). Each replacement is looked for in the tests the compiled pass runs.
_REPLACERS = frozenset({"setattr", "patch", "object"})


def _imported(tree: ast.Module) -> dict[str, str]:
    """The names a test file binds to fallback_mw's modules or their members (any scope)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fallback_mw"):
                    bound[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fallback_mw"):
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _dotted(node: ast.expr, bound: dict[str, str]) -> str | None:
    """`node` (a name or an attribute chain) as a dotted fallback_mw path, or None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in bound:
        return None
    return ".".join([bound[node.id], *reversed(parts)])


def _compiled_member(dotted: str) -> tuple[str, str] | None:
    """(module path, member) when `dotted` names a member of a compiled module that compiled
    code reads directly: a function, a class (or its attribute), a `Final` constant."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        relative = "/".join(parts[1:cut])
        module = next(
            (m for m in (f"{relative}.py", f"{relative}/__init__.py") if m in MODULES), None
        )
        if module is None:
            continue
        member = parts[cut]
        for node in ast.parse((PACKAGE / module).read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if node.name == member:
                    return module, ".".join(parts[cut:])
            elif (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == member
                and "Final" in ast.unparse(node.annotation)
            ):
                return module, member
        return None
    return None


def _not_compiled_pass(decorators: list[ast.expr]) -> bool:
    """Decorators (or a `pytestmark`) that keep a test out of the compiled pass."""
    text = " ".join(ast.unparse(d) for d in decorators)
    return "pure_pass_only" in text or ("skipif" in text and "COMPILED" in text)


def replaced_in_tests(tests: Path) -> list[str]:
    """The tests of the compiled pass that replace (monkeypatch.setattr, mock.patch,
    patch.object) a member of a compiled module its compiled callers read directly, one line
    each; `# compiled: <why>` on the replacement's line or the line above says it is read
    through anyway (interpreted callers only)."""
    found = []
    for path in sorted(tests.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text, str(path))
        lines = text.splitlines()
        marks = [
            n.value
            for n in tree.body
            if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)
        ]
        if _not_compiled_pass(marks):
            continue
        bound = _imported(tree)
        kept_out = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and _not_compiled_pass(node.decorator_list)
        ]
        skipped = {id(n) for outer in kept_out for n in ast.walk(outer)}
        for node in sorted(
            (n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: n.lineno
        ):
            if id(node) in skipped or not node.args:
                continue
            func = node.func
            if not isinstance(func, ast.Attribute) or func.attr not in _REPLACERS:
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                dotted: str | None = first.value
            elif (
                len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                owner = _dotted(first, bound)
                dotted = f"{owner}.{node.args[1].value}" if owner else None
            else:
                continue
            if dotted is None or not dotted.startswith("fallback_mw."):
                continue
            said = lines[max(node.lineno - 2, 0) : (node.end_lineno or node.lineno)]
            if any("# compiled:" in line for line in said):
                continue
            member = _compiled_member(dotted)
            if member is not None:
                where = path.relative_to(tests.parent) if tests.parent in path.parents else path
                found.append(
                    f"{where}:{node.lineno}: replaces {member[1]} of the compiled "
                    f"{member[0]}, which compiled callers read directly (the compiled pass "
                    "runs this test without the replacement)"
                )
    return found


def _optional_locals(function: ast.AsyncFunctionDef) -> set[str]:
    """The locals `function` annotates with a type that admits None (`X | None`)."""
    return {
        node.target.id
        for node in _own_nodes(function)
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and "None" in ast.unparse(node.annotation)
    }


def _kept_into(node: ast.Try | ast.TryStar) -> set[str]:
    """The names a `try` assigns (its body and handlers) that its `finally` reads."""
    stored = {
        n.id
        for part in [*node.body, *node.handlers]
        for n in ast.walk(part)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    read = {
        n.id
        for part in node.finalbody
        for n in ast.walk(part)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }
    return stored & read


def built(module: str) -> list[Path]:
    path = PACKAGE / module
    return sorted(path.parent.glob(path.stem + ".*.so")) + sorted(
        path.parent.glob(path.stem + ".*.pyd")
    )


# What a build compiled, in the package it built (in place or in an --out copy, and so in a
# compiled wheel): `fallback-mw --version` and serve's start line read it
# (fallback_mw/cli/compiled_core.py, which documents the format).
RECORD = "compiled_core.txt"


def write_record(package: Path, modules: Sequence[str]) -> None:
    """The mypyc runtime beside `package`, then each compiled module with its source's
    SHA-256 (a source edited since the build is stale)."""
    runtimes = sorted(p.name for p in package.parent.glob("*__mypyc*") if p.is_file())
    lines = [f"# runtime: {name}" for name in runtimes[:1]]
    for module in modules:
        lines.append(f"{module} {hashlib.sha256((package / module).read_bytes()).hexdigest()}")
    (package / RECORD).write_text("\n".join(lines) + "\n", encoding="utf-8")


def clean() -> int:
    removed = 0
    (PACKAGE / RECORD).unlink(missing_ok=True)
    for extension in [*PACKAGE.rglob("*.so"), *PACKAGE.rglob("*.pyd"), *SRC.glob("*__mypyc*")]:
        extension.unlink()
        removed += 1
    shutil.rmtree(BUILD, ignore_errors=True)
    print(f"compile.py: {removed} compiled files removed; fallback_mw is pure Python")
    return 0


def check() -> int:
    problems = [line for module in MODULES for line in hazards(PACKAGE / module)]
    if (ROOT / "tests").is_dir():
        problems += replaced_in_tests(ROOT / "tests")
    for line in problems:
        print(f"compile.py: {line}", file=sys.stderr)
    if problems:
        print(
            "compile.py: rewrite these (see this script's docstring) or leave the module "
            "out of MODULES",
            file=sys.stderr,
        )
        return 1
    return 0


def status() -> int:
    stale = 0
    for module in MODULES:
        extensions = built(module)
        if not extensions:
            print(f"{module}: interpreted")
        elif extensions[0].stat().st_mtime < (PACKAGE / module).stat().st_mtime:
            print(f"{module}: compiled, STALE (the source changed since the build)")
            stale += 1
        else:
            print(f"{module}: compiled")
    return 1 if stale else 0


def build() -> int:
    if check():
        return 1
    clean()
    started = time.monotonic()
    mypyc = Path(sys.executable).parent / "mypyc"
    if not mypyc.exists():
        print("compile.py: no mypyc beside this Python (the dev extra's mypy has it)")
        return 2
    # From src/, so the extensions land beside their sources (an in-place build names
    # each by its package path) and the shared runtime library at src/'s top level.
    env = dict(os.environ, MYPYC_OPT_LEVEL=os.environ.get("MYPYC_OPT_LEVEL", "3"))
    command = [
        str(mypyc),
        "--config-file",
        str(ROOT / "pyproject.toml"),
        *(f"fallback_mw/{module}" for module in MODULES),
    ]
    result = subprocess.run(command, cwd=SRC, env=env, check=False)
    shutil.move(SRC / "build", BUILD) if (SRC / "build").exists() else None
    if result.returncode != 0:
        print("compile.py: mypyc failed; nothing compiled is left in place", file=sys.stderr)
        clean()
        return 1
    missing = [module for module in MODULES if not built(module)]
    if missing:
        print(f"compile.py: not built: {', '.join(missing)}", file=sys.stderr)
        clean()
        return 1
    write_record(PACKAGE, MODULES)
    seconds = time.monotonic() - started
    print(f"compile.py: {len(MODULES)} modules compiled in {seconds:.0f} s (--clean undoes it)")
    return 0


STAMP = ".fallback_mw-compiled"  # in an --out DIR: the digest it was built from
COPIED = shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", "*.c", RECORD)


def digest(mypy: str, pgo: bool = False) -> str:
    """What an --out build is made of: the package's files (each listed module's
    annotations are read from the others), the list, mypy, the Python, the build's config."""
    sha = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*")):
        relative = path.relative_to(PACKAGE)
        if path.is_file() and not any(COPIED(str(relative.parent), relative.parts)):
            sha.update(f"{relative}\0".encode() + path.read_bytes() + b"\0")
    settings = [*MODULES, mypy, str(sysconfig.get_config_var("EXT_SUFFIX"))]
    settings.append(os.environ.get("MYPYC_OPT_LEVEL", "3"))
    if pgo:  # the training run's traffic is part of what the copy is made of
        settings.append("pgo\0" + (ROOT / "scripts" / "pgo_train.py").read_text())
    sha.update("\0".join(settings).encode() + (ROOT / "pyproject.toml").read_bytes())
    return sha.hexdigest()


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def build_out(out: Path, pgo: bool = False) -> int:
    """A compiled copy of the package in `out`, from a staging directory beside it that
    replaces `out` only once built and imported whole; src/ is never written. With `pgo`,
    built twice, the second time laid out by the first one's profile (`_profiled`)."""
    if check():
        return 1
    if pgo:
        refused = _pgo_refused()
        if refused:
            print(f"compile.py: --pgo: {refused}", file=sys.stderr)
            return 2
    try:
        mypy = importlib.metadata.version("mypy")
    except importlib.metadata.PackageNotFoundError:
        mypy = ""
    # `python -m mypyc`: a wheel's build under pip has mypy on this Python's path but its
    # scripts elsewhere (pip's isolated build environment), never beside the interpreter.
    mypyc = [sys.executable, "-m", "mypyc"]
    if not mypy:
        print("compile.py: no mypy (mypyc is in it) for this Python (the dev extra pins it)")
        return 2
    out = out.resolve()
    wanted = digest(mypy, pgo)
    recorded = (out / "fallback_mw" / RECORD).is_file()  # a copy built before the record
    if recorded and (out / STAMP).is_file() and (out / STAMP).read_text().strip() == wanted:
        print(f"compile.py: {out} is built from these sources already")
        return 0
    if out.exists() and not (out / STAMP).is_file() and any(out.iterdir()):
        print(f"compile.py: {out} holds something else; not replaced", file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # SIGTERM (scripts/test.sh stopping its background build) ends the build through the
    # `finally` below, as Ctrl-C does: its default action left the staging directory.
    signal.signal(signal.SIGTERM, _terminated)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        shutil.copytree(PACKAGE, staging / "fallback_mw", ignore=COPIED)
        env = dict(os.environ, MYPYC_OPT_LEVEL=os.environ.get("MYPYC_OPT_LEVEL", "3"))
        modules = [f"fallback_mw/{module}" for module in MODULES]
        config = ["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", ".mypy_cache"]
        command = [*mypyc, *config, *modules]
        if pgo:
            failed = _profiled(command, staging, env)
            if failed:
                print(f"compile.py: --pgo: {failed}; nothing replaced", file=sys.stderr)
                return 1
        elif subprocess.run(command, cwd=staging, env=env, check=False).returncode != 0:
            print("compile.py: mypyc failed; nothing replaced", file=sys.stderr)
            return 1
        for leftover in ("build", ".mypy_cache"):  # the C sources, mypy's cache
            shutil.rmtree(staging / leftover, ignore_errors=True)
        suffix = str(sysconfig.get_config_var("EXT_SUFFIX"))
        missing = [
            m for m in MODULES if not (staging / "fallback_mw" / m).with_suffix(suffix).is_file()
        ]
        runtime = list(staging.glob(f"*__mypyc{suffix}"))
        if missing or len(runtime) != 1:
            print(f"compile.py: not built: {missing or 'the shared runtime'}", file=sys.stderr)
            return 1
        probe = (
            "import fallback_mw.gateway as g, sys; sys.exit(not g.__file__.endswith(sys.argv[1]))"
        )
        # In front of any PYTHONPATH there is (pip's build environment is on it).
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [str(staging), os.environ.get("PYTHONPATH")])),
        )
        if subprocess.run([sys.executable, "-c", probe, suffix], env=env, check=False).returncode:
            print("compile.py: the copy built does not import compiled", file=sys.stderr)
            return 1
        write_record(staging / "fallback_mw", MODULES)
        (staging / STAMP).write_text(wanted + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    seconds = time.monotonic() - started
    laid_out = ", laid out by a training run's profile (--pgo)" if pgo else ""
    print(f"compile.py: {len(MODULES)} modules compiled into {out}{laid_out} in {seconds:.0f} s")
    return 0


# gcc's profile-guided optimization (`--pgo`): the first build counts, the second uses.
# -fprofile-update=atomic: serve's threads (the log writer's) count without losing counts;
# -fprofile-partial-training: code the training run never reached is optimized as without a
# profile, not as cold (a failure's path stays as fast as in a build without --pgo).
PGO_GENERATE = ("-fprofile-generate -fprofile-update=atomic", "-fprofile-generate")
PGO_USE = "-fprofile-use -fprofile-partial-training -Wno-missing-profile"


def _pgo_refused() -> str | None:
    """Why this machine cannot build with gcc's profile flags, or None."""
    compiler = (os.environ.get("CC") or str(sysconfig.get_config_var("CC") or "cc")).split()
    try:
        said = subprocess.run([*compiler, "--version"], capture_output=True, text=True)
    except OSError as exc:
        return f"no C compiler ({exc})"
    # gcc says so in its copyright line, whatever it is called (cc, x86_64-linux-gnu-gcc).
    gcc = "Free Software Foundation" in said.stdout and "clang" not in said.stdout
    if said.returncode != 0 or not gcc:
        return f"the profile flags are gcc's, and {compiler[0]} is not gcc"
    return None


def _flags(env: dict[str, str], cflags: str, ldflags: str = "") -> dict[str, str]:
    """`env` with `cflags` after the C flags the build would use (the caller's CFLAGS, else
    the interpreter's: the setuptools of a wheel's build environment, 84 here, replaces the
    interpreter's flags with a CFLAGS set, losing -fwrapv and -DNDEBUG; this venv's, 65,
    adds it after them, and a flag given twice is harmless) and `ldflags` after the
    caller's LDFLAGS (added to the link by both)."""
    base = env.get("CFLAGS", str(sysconfig.get_config_var("CFLAGS") or ""))
    flags = {"CFLAGS": f"{base} {cflags}".strip()}
    if ldflags:
        flags["LDFLAGS"] = f"{env.get('LDFLAGS', '')} {ldflags}".strip()
    return env | flags


def _profiled(command: list[str], staging: Path, env: dict[str, str]) -> str | None:
    """mypyc's build in `staging` twice: instrumented, then trained by scripts/pgo_train.py
    (serve from `staging`, real sockets), then built again from the counts it wrote beside
    the objects (the same paths: gcc finds each by its object's). None, or what failed."""
    if subprocess.run(command, cwd=staging, env=_flags(env, *PGO_GENERATE)).returncode:
        return "mypyc failed (the instrumented build)"
    trainer = ROOT / "scripts" / "pgo_train.py"
    if subprocess.run([sys.executable, str(trainer), str(staging)], env=env).returncode:
        return "the training run failed"
    if not any((staging / "build").rglob("*.gcda")):
        return "the training run wrote no profile"
    # The extensions and objects go (mypyc keeps C files it would write the same, and
    # setuptools then rebuilds nothing); the counts (.gcda) stay beside where they were.
    for stale in [*staging.rglob("*.so"), *staging.rglob("*.o"), *staging.rglob("*.pyd")]:
        stale.unlink()
    if subprocess.run(command, cwd=staging, env=_flags(env, PGO_USE)).returncode:
        return "mypyc failed (the build from the profile)"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--clean", action="store_true", help="remove the compiled modules")
    action.add_argument("--check", action="store_true", help="the hazard checks only")
    action.add_argument("--list", action="store_true", help="the modules compiled")
    action.add_argument("--status", action="store_true", help="which modules are compiled")
    parser.add_argument("--out", type=Path, metavar="DIR", help="build a compiled copy in DIR")
    parser.add_argument(
        "--pgo",
        action="store_true",
        help="with --out: built twice, laid out by a training run through serve (gcc)",
    )
    args = parser.parse_args()
    if args.out is not None and not args.list:
        if args.clean or args.check or args.status:
            parser.error("--out builds; --clean, --check and --status are for the in-place build")
        return build_out(args.out, pgo=args.pgo)
    if args.pgo:
        parser.error("--pgo is for --out builds")
    if args.clean:
        return clean()
    if args.check:
        return check()
    if args.list:
        print("\n".join(MODULES))
        return 0
    if args.status:
        return status()
    return build()


if __name__ == "__main__":
    sys.exit(main())
