"""scripts/compile.py --out stopped part-way, as scripts/test.sh stops the compiled core's
background build when the check ends first (Ctrl-C, SIGTERM): SIGTERM to its process group,
mypyc and the C compiler in it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.pure_pass_only(
    reason="runs scripts/compile.py on the tree; nothing of the package (or of build/compiled)"
)


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups")
def test_a_build_stopped_by_sigterm_leaves_no_staging_directory(tmp_path: Path) -> None:
    """The build stages its copy in a directory beside --out (`.compiled-*`, 73 MB here once
    mypyc has run) and removes it in a `finally`, which SIGTERM's default action never ran:
    each full scripts/test.sh interrupted while its background build ran left one in
    build/. The staging directory is removed, and the build ends non-zero."""
    out = tmp_path / "compiled"
    build = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "compile.py"), "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        # mypyc at work in the staging directory: its cache is there.
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".compiled-*/.mypy_cache")):
            assert build.poll() is None, f"compile.py ended first ({build.returncode})"
            assert time.monotonic() < deadline, "mypyc never started"
            time.sleep(0.05)
        os.killpg(build.pid, signal.SIGTERM)
        status = build.wait(timeout=60)
    finally:
        if build.poll() is None:
            os.killpg(build.pid, signal.SIGKILL)
            build.wait()
    assert status != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())
