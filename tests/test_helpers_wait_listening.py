"""tests.helpers.wait_listening: a generous bound for a slow start, none for a process that
has already exited (a broken serve fails the test at once, not after the bound)."""

from __future__ import annotations

import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import anyio
import pytest

from tests.helpers import wait_listening

pytestmark = pytest.mark.pure_pass_only(
    reason="tests.helpers.wait_listening on plain processes; nothing of the package runs"
)

UNUSED_PORT = 21501  # nothing listens there (this run's own port range)


def test_a_process_that_exited_fails_the_wait_at_once(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    log.write_text("boom\n")
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"exited early \(3\): boom"):
        anyio.run(wait_listening, process, UNUSED_PORT, log)
    assert time.monotonic() - started < 5


def test_a_process_that_never_listens_fails_at_the_bound(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    log.write_text("")
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = time.monotonic()
        with pytest.raises(pytest.fail.Exception, match="within 1 s"):
            anyio.run(partial(wait_listening, process, UNUSED_PORT, log, limit=1.0))
        assert 1.0 <= time.monotonic() - started < 10
    finally:
        process.kill()
        process.wait()
