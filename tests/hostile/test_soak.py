"""The soak, short: scripts/soak.py for a few seconds (its own redis-server, restarted in
the middle). Every check it makes must hold: no budget hold, no leftover task, upstream
connections within the pool, breakers as expected, state shared again after the restart."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import IN_CI

SOAK = Path(__file__).parent.parent.parent / "scripts" / "soak.py"


@pytest.mark.slow
def test_a_short_soak_leaves_nothing_behind() -> None:
    if shutil.which("redis-server") is None:
        if IN_CI:
            pytest.fail("redis-server is not installed (CI=true: a missing service fails)")
        pytest.skip("redis-server is not installed")
    result = subprocess.run(
        [sys.executable, str(SOAK), "--seconds", "12", "--clients", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    report = json.loads(result.stdout)
    assert result.returncode == 0, (report["checks"], report["tasks_left"], result.stderr[-2000:])
    assert all(report["checks"].values())
    assert report["requests"] > 100
    assert report["outcomes"].get("client hung up", 0) > 0
    assert report["holds_left"] in ("0", "0E-9")
    assert report["tasks_left"] == []
