"""scripts/compile.py's checks: the modules it compiles (the opt-in mypyc core) hold none
of the code shapes mypyc compiles wrong, so a change that brings one back (an `await` in a
`finally` on the request path) fails here, in the pure-Python suite, not only once someone
builds the compiled core. The checker itself is checked on planted code. Seconds: the
source is parsed, nothing is built."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.pure_pass_only(
    reason="scripts/compile.py's checks on the source and on planted code; "
    "nothing of the package runs"
)

ROOT = Path(__file__).resolve().parent.parent


def compile_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fmw_compile", ROOT / "scripts" / "compile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_every_compiled_module_exists_and_holds_no_shape_mypyc_compiles_wrong() -> None:
    script = compile_script()
    for module in script.MODULES:
        path = script.PACKAGE / module
        assert path.is_file(), module
        assert script.hazards(path) == [], module


PLANTED = {
    "an await in a finally": """
async def f(g):
    try:
        pass
    finally:
        await g()
""",
    "a bare raise after an await in an except block": """
async def f(g):
    try:
        pass
    except BaseException:
        await g()
        raise
""",
    "an async with": """
async def f(lock):
    async with lock:
        pass
""",
    "an async generator": """
async def f():
    yield 1
""",
    "an async def __call__ in a Python class": """
@python_class
class App:
    async def __call__(self, scope, receive, send):
        pass
""",
    "an optional local assigned in a try and read in its finally": """
async def f(send):
    request: Request | None = None
    try:
        request = Request()
        await send(request)
    finally:
        if request is not None:
            request.close()
""",
    "a module-level constant without Final": """
LIMIT = 5
""",
    "a module-level constant without Final (A": """
A, b = 0, 1
""",
    "object.__new__": """
class C:
    @classmethod
    def make(cls):
        return object.__new__(cls)
""",
}


@pytest.mark.parametrize("shape", sorted(PLANTED))
def test_the_checker_finds_each_shape(shape: str, tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(PLANTED[shape])
    found = compile_script().hazards(planted)
    assert len(found) == 1 and shape in found[0], found


def test_the_checker_passes_the_workaround(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        """
async def f(g, h):
    try:
        await g()
    except BaseException as exc:
        await h()
        raise exc
    await h()
    try:
        pass
    except ValueError:
        raise  # no await before it: the exception state is still this handler's
    finally:
        h()  # no await in the finally

    def inner():  # a nested function is its own: a sync generator is compiled
        yield 1


async def g(send):
    sent: object = None  # no None in the type: kept as an object
    try:
        sent = request = Request()
        await send(request)
    finally:
        if isinstance(sent, Request):
            sent.close()


async def _serve(self, scope, receive, send):
    pass


@python_class
class App:
    __call__ = _serve  # a module function: a coroutine function when compiled too


@dataclass(slots=True)
class Native:  # a native class: its coroutine methods are coroutine functions
    async def __call__(self, scope, receive, send):
        pass

    @classmethod
    def make(cls):
        return _new(cls)


_new = Native.__new__
LIMIT: Final = 5  # a constant, Final: a C static or a literal when compiled
_SET: Final[frozenset[int]] = frozenset({1})
T = TypeVar("T")
# not Final: a test replaces it
_REPLACED = 3
_STATE = 0


def flip():
    global _STATE
    _STATE = 1
"""
    )
    assert compile_script().hazards(planted) == []


def test_a_compiled_pass_that_imports_the_pure_package_fails(tmp_path: Path) -> None:
    # scripts/test.sh's compiled pass sets FMW_TEST_COMPILED; without the compiled copy on
    # the path (a build that failed or was left out), the suite must not run at all, or it
    # would pass as the pure suite under the compiled core's name. Pure here in either pass:
    # PYTHONPATH (the compiled copy's) is not handed on.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["FMW_TEST_COMPILED"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "--co", "tests/__init__.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode != 0, result.stdout
    assert "listed modules are interpreted" in result.stdout + result.stderr


REPLACING = """
import pytest
from unittest import mock

import fallback_mw.health.pool as pool
from fallback_mw import timers
from fallback_mw.routing import RouteTable
from tests.helpers import COMPILED


def test_replaces(monkeypatch):
    monkeypatch.setattr(timers, "TICK", 1.0)  # found: a Final constant
    monkeypatch.setattr("fallback_mw.health.pool.AFFINITY_LIMIT", 1)  # found: by dotted name
    monkeypatch.setattr(pool, "score", lambda *a: 0.0)  # found: a compiled function
    monkeypatch.setattr(RouteTable, "covers", lambda *a: True)  # found: a native method
    with mock.patch("fallback_mw.timers._PER_SECOND", 1):  # found: mock.patch
        pass
    with mock.patch.object(pool, "credential_mark"):  # found: patch.object
        pass
    monkeypatch.setattr(pool, "SCORE_HALF_LIFE", 1.0)  # not Final: read through
    monkeypatch.setattr(pool, "datetime", None)  # imported: read through the module
    monkeypatch.setattr("fallback_mw.config.load_config", None)  # not compiled
    monkeypatch.setattr(timers, "TICK", 2.0)  # compiled: a planted exemption


@pytest.mark.skipif(COMPILED, reason="checks the sources' shape")
def test_kept_out(monkeypatch):
    monkeypatch.setattr(timers, "TICK", 1.0)
"""


def test_the_tests_that_replace_what_the_compiled_core_reads_directly_are_found(
    tmp_path: Path,
) -> None:
    # health/pool.SCORE_HALF_LIFE was Final once; tests/test_credential_pool.py shortens it by
    # its dotted name, and the compiled pass's run of that test failed only in CI.
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_planted.py").write_text(REPLACING)
    (tmp_path / "tests" / "test_kept_out.py").write_text(
        "import pytest\nfrom fallback_mw import timers\n\npytestmark = pytest.mark.pure_pass_only("
        'reason="source")\n\n\ndef test(monkeypatch):\n'
        '    monkeypatch.setattr(timers, "TICK", 1.0)\n'
    )
    found = compile_script().replaced_in_tests(tmp_path / "tests")
    named = [line.split(": replaces ")[1].split(",")[0] for line in found]
    assert named == [
        "TICK of the compiled timers.py",
        "AFFINITY_LIMIT of the compiled health/pool.py",
        "score of the compiled health/pool.py",
        "RouteTable.covers of the compiled routing.py",
        "_PER_SECOND of the compiled timers.py",
        "credential_mark of the compiled health/pool.py",
    ], found
    assert all(line.startswith("tests/test_planted.py:") for line in found), found


def test_no_test_of_the_compiled_pass_replaces_what_the_compiled_core_reads_directly() -> None:
    assert compile_script().replaced_in_tests(ROOT / "tests") == []
