"""A SQLite store this user may only read (the file `chmod 444`, or its directory read-only):
the read verbs answer, the writes fail with one line naming why, and nothing is left
beside the file. Every verb failed ("attempt to write a readonly database"): the route
store rewrote its current schema version on each open, and SQLite, opened read-write, made
a read-only `-shm` beside a read-only file that then failed the owner's own writes once
the file was writable again. As root the verbs run without CAP_DAC_OVERRIDE (`setpriv`),
so the modes bind as they do for any other user."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers.sqlite import SQLiteLedger

CONFIG = """
[gateway]
store = "sqlite:///{path}"
allow_hosts = ["127.0.0.1"]
[upstreams.primary]
url = "http://127.0.0.1:9"
auth_env = "UF_PRIMARY_KEY"
[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary"]
"""


def unprivileged() -> list[str]:
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: file modes do not bind")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def fallback_mw(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "UF_PRIMARY_KEY": "k", "UF_STORED_KEY": "k"}
    return subprocess.run(
        [*unprivileged(), sys.executable, "-m", "fallback_mw", *args, "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=config.parent,
    )


def made_store(directory: Path) -> tuple[Path, Path]:
    directory.mkdir()
    path = directory / "gw.db"
    config = directory / "gw.toml"
    config.write_text(CONFIG.format(path=path))
    added = fallback_mw(
        config,
        *("routes", "add", "--id", "stored", "--prefix", "/s/"),
        *("--upstream", "http://127.0.0.1:10", "--auth-header", "x-api-key"),
        *("--auth-env", "UF_STORED_KEY"),
    )
    assert added.returncode == 0, added.stderr
    faulted = fallback_mw(config, "faults", "set", "fail", "--upstream", "primary", "--ttl", "600")
    assert faulted.returncode == 0, faulted.stderr

    async def spend() -> None:
        ledger = SQLiteLedger(str(path))
        budget = BudgetConfig(limit=Decimal(10), window="month")
        hold = await ledger.hold("acme", budget, Decimal(1))
        assert hold is not None
        await ledger.settle(hold, Decimal("0.25"))
        await ledger.aclose()

    asyncio.run(spend())
    return path, config


@pytest.mark.parametrize("read_only", ["file", "directory"])
def test_read_verbs_answer_and_writes_say_why_on_a_read_only_store(
    tmp_path: Path, read_only: str
) -> None:
    path, config = made_store(tmp_path / "store")
    beside = sorted(p.name for p in path.parent.iterdir())
    locked = path if read_only == "file" else path.parent
    locked.chmod(0o444 if read_only == "file" else 0o555)
    try:
        listed = fallback_mw(config, "routes", "list")
        assert listed.returncode == 0, listed.stderr
        assert "stored\tstore\t/s/" in listed.stdout
        faults = fallback_mw(config, "faults", "list")
        assert faults.returncode == 0, faults.stderr
        assert faults.stdout.startswith("fail\tupstream=primary\t")
        checked = fallback_mw(config, "check")
        assert checked.returncode == 0, checked.stderr
        assert "is valid: 2 route(s)" in checked.stdout
        budgets = fallback_mw(config, "budgets", "show")
        assert budgets.returncode == 0, budgets.stderr
        assert "0.25" in budgets.stdout
        why = (
            f"{path} is read-only for this user"
            if read_only == "file"
            else f"its directory {path.parent} is read-only for this user"
        )
        for write in (("routes", "remove", "--id", "stored"), ("faults", "clear", "--all")):
            refused = fallback_mw(config, *write)
            assert refused.returncode == 1
            assert refused.stdout == ""
            lines = refused.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith("fallback-mw: error: "), lines
            assert why in lines[0]
        assert sorted(p.name for p in path.parent.iterdir()) == beside  # no -wal, no -shm
    finally:
        locked.chmod(0o644 if read_only == "file" else 0o755)
    # Writable again: the owner's writes go through (a -shm left read-only failed them).
    removed = fallback_mw(config, "routes", "remove", "--id", "stored")
    assert removed.returncode == 0, removed.stderr
    assert "stored" not in fallback_mw(config, "routes", "list").stdout
