"""Shared fixtures. Postgres and Redis are real services on this machine; outside CI a
missing service skips its tests, under CI=true it fails them."""

from __future__ import annotations

import gc
import os
import socket
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# Under CI the property tests draw the same examples on every run: a landing gate that goes
# red at random on a bug nobody changed blocks unrelated work (a tenant property found one
# so, f720ce2). Outside CI they stay random, so a developer's runs keep searching; a
# failure prints its example and the seed to reproduce it.
settings.register_profile("ci", derandomize=True, print_blob=True)
if IN_CI:
    settings.load_profile("ci")
PG_HOST = os.environ.get("FMW_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("FMW_TEST_PG_PORT", "5432"))
PG_USER = os.environ.get("FMW_TEST_PG_USER", "postgres")
# Test databases are named PREFIX + a random suffix (one shared server, many users).
PG_PREFIX = os.environ.get("FMW_TEST_PG_PREFIX", "fmw_test_")
REDIS_HOST = os.environ.get("FMW_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("FMW_TEST_REDIS_PORT", "6379"))
REDIS_DB = int(os.environ.get("FMW_TEST_REDIS_DB", "0"))


# scripts/mutants.py runs named tests against a mutated copy of src/: the copy, never the
# editable install, must be what they import (a green run of the wrong package proves nothing).
_MUTANT_SRC = os.environ.get("FMW_MUTANT_SRC")
if _MUTANT_SRC:
    import fallback_mw

    if not Path(fallback_mw.__file__).resolve().is_relative_to(Path(_MUTANT_SRC).resolve()):
        raise RuntimeError(f"FMW_MUTANT_SRC is set but fallback_mw is {fallback_mw.__file__}")

# scripts/test.sh's compiled pass (FMW_TEST_COMPILED=1, PYTHONPATH=build/compiled): each module
# scripts/compile.py lists must import as the extension module built from it. A pass that
# imported the pure package (no PYTHONPATH, a failed or partial build) would be the pure
# suite once more under the compiled core's name.
if os.environ.get("FMW_TEST_COMPILED"):
    import importlib.machinery
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "fmw_compile_list", Path(__file__).resolve().parent.parent / "scripts" / "compile.py"
    )
    assert _spec is not None and _spec.loader is not None
    _script = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_script)
    _interpreted = [
        name
        for name in (
            "fallback_mw." + module.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            for module in _script.MODULES
        )
        if not isinstance(
            importlib.import_module(name).__loader__, importlib.machinery.ExtensionFileLoader
        )
    ]
    if _interpreted:
        raise RuntimeError(
            f"FMW_TEST_COMPILED is set but {len(_interpreted)} listed modules are interpreted "
            f"({', '.join(_interpreted[:3])}, ...): build scripts/compile.py --out DIR and put "
            "DIR on PYTHONPATH"
        )

# scripts/test.sh's pass of the aiohttp engine on ClientSession.request
# (FMW_TEST_AIOHTTP_SESSION_PATH=1, a few engine test files): the path the engine keeps under
# an aiohttp release its own request path was not read against (upstream/aiohttp_request.py).
# In-process only: a `serve` the tests start takes the engine's own path.
if os.environ.get("FMW_TEST_AIOHTTP_SESSION_PATH"):
    from fallback_mw.upstream import aiohttp_request

    aiohttp_request.use(False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The compiled pass (FMW_TEST_COMPILED) leaves out the tests marked
    `pure_pass_only(reason=...)`: those that run nothing of the package, so the build cannot
    change what they see (the source parsed, a test helper, a wheel built from the tree, mypy
    on a downstream program). Each says why in its reason; one without a reason is an error.

    On scripts/test.sh's workers (-n 3 --dist loadfile --no-loadscope-reorder), the test
    files are handed out in this order: those holding the most `slow` tests first, then the
    most tests first (xdist's own order, which counts tests only). The minutes-long files
    (the compiled wheel's build, the benchmarks) then start at once beside the others rather
    than last, alone on one worker: a pass took about 150 s longer so. Only the files' order
    changes; the tests of a file run in their order, on one worker."""
    pure_only = []
    for item in items:
        marker = item.get_closest_marker("pure_pass_only")
        if marker is not None:
            if not marker.kwargs.get("reason"):
                raise pytest.UsageError(f"{item.nodeid}: pure_pass_only needs a reason=")
            pure_only.append(item)
    if pure_only and os.environ.get("FMW_TEST_COMPILED"):
        config.hook.pytest_deselected(items=pure_only)
        left = set(map(id, pure_only))
        items[:] = [item for item in items if id(item) not in left]
    if not hasattr(config, "workerinput"):
        return
    slow: Counter[Path] = Counter()
    tests: Counter[Path] = Counter()
    for item in items:
        tests[item.path] += 1
        slow[item.path] += item.get_closest_marker("slow") is not None
    # Stable: a file's tests stay together and in their order.
    items.sort(key=lambda item: (-slow[item.path], -tests[item.path]))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", autouse=True)
def _collect_a_modules_garbage() -> Iterator[None]:
    """Collect garbage as each module ends, so that a socket or transport a module leaves
    unclosed (its ResourceWarning is an error here) fails that module's last test. Left to
    the collector it fails whichever later test happens to allocate when the collector runs:
    an unclosed `OpenAI` client of tests/e2e/test_llm_sdks.py failed
    tests/hostile/test_connection_burst.py so, at random, under CI."""
    yield
    gc.collect()


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def require_service(name: str, host: str, port: int) -> None:
    if _reachable(host, port):
        return
    message = f"{name} is not reachable at {host}:{port}"
    if IN_CI:
        pytest.fail(message + " (CI=true: a missing service is a failure)")
    pytest.skip(message)


@pytest.fixture
async def pg_url() -> AsyncIterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    require_service("PostgreSQL", PG_HOST, PG_PORT)
    import asyncpg

    name = f"{PG_PREFIX}{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, database="postgres")
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        admin = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, database="postgres")
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store URL for a ledger, once per backend: a SQLite file, then a fresh PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def redis_url() -> Iterator[str]:
    """The real Redis, with a key prefix unique to this test (`?prefix=`)."""
    require_service("Redis", REDIS_HOST, REDIS_PORT)
    prefix = f"fmwtest:{uuid.uuid4().hex[:12]}:"
    yield f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}?prefix={prefix}"
    import redis

    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
    try:
        keys = list(client.scan_iter(match=prefix + "*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
