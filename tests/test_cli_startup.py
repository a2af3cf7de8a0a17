"""`fallback-mw` starts fast: the parser (`--help`, a usage error) imports none of the heavy
parts, and a verb imports what it needs, not what every other verb needs. Every call an
operator makes (`--help`, `check`, `budgets show`) paid for all eleven verbs' imports: the
pydantic config, aiohttp, the telemetry, about 0.4-0.7 s a call."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# What the command line's parser has no use for: the third-party packages behind the config,
# the upstream engine, the server, the stores and the telemetry, and the package's own
# heavy parts.
HEAVY = (
    "pydantic", "aiohttp", "anyio", "opentelemetry", "uvicorn", "httpx", "asyncpg", "redis",
    "sqlite3", "sqlalchemy", "psycopg",
    "fallback_mw.config", "fallback_mw.gateway", "fallback_mw.budget", "fallback_mw.store",
    "fallback_mw.telemetry", "fallback_mw.cli.evaluation", "fallback_mw.cli.game_day",
)  # fmt: skip

_PROBE = """
import contextlib, io, json, sys
from fallback_mw.cli import main
statuses = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        statuses.append(main(argv, stdout=out, stderr=err))
heavy = json.loads(sys.argv[2])
loaded = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))
print(json.dumps({"statuses": statuses, "loaded": loaded}))
"""


def probe(*argvs: list[str], heavy: tuple[str, ...] = HEAVY) -> dict[str, list[object]]:
    """Run each command line in one fresh interpreter (in turn, in-process, as the entry
    point does) and say which of `heavy` it left imported."""
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argvs), json.dumps(heavy)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    found: dict[str, list[object]] = json.loads(result.stdout)
    return found


def test_help_and_usage_errors_import_nothing_heavy() -> None:
    found = probe(
        ["--help"],
        ["serve", "--help"],
        ["routes", "add", "--help"],
        ["budgets", "set", "--help"],
        ["eval", "--help"],
        ["gameday", "--help"],
        ["faults", "set", "explode", "--ttl", "5"],
        ["check"],
        [],
    )
    assert found == {"statuses": [0, 0, 0, 0, 0, 0, 2, 2, 2], "loaded": []}


def test_a_verb_imports_only_what_it_needs(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.primary]\nurl = "http://127.0.0.1:9"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    others = ("fallback_mw.cli.evaluation", "fallback_mw.cli.game_day", "uvicorn")
    assert probe(["check", "--config", str(config)], heavy=others) == {
        "statuses": [0],
        "loaded": [],
    }
    store = f"sqlite:///{tmp_path / 'store.db'}"
    assert probe(["budgets", "show", "--store", store], heavy=others) == {
        "statuses": [0],
        "loaded": [],
    }
