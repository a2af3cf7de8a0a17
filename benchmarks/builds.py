"""Which build of the gateway a benchmark's `serve` arms run (`--build pure|compiled`).

pure (the default): a tree's sources as they are (this checkout: its editable install).
compiled: that tree's compiled copy, `scripts/compile.py --out build/compiled --pgo` (built
when missing or out of date: minutes; up to date, under a second), put in front with
PYTHONPATH. `--pgo`: as a release is built (README, "A compiled wheel"), laid out by gcc
from a training run's profile; a tree whose compile.py has no `--pgo` is built without.
The header of each run names the build measured, as `fallback-mw --version` says it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILDS = ("pure", "compiled")


class BuildFailed(RuntimeError):
    """The compiled copy asked for could not be built."""


def compiled_copy(src: Path) -> Path:
    """The compiled copy of the package in `src` (a tree's src/), built by that tree's own
    scripts/compile.py into the tree's build/compiled."""
    tree = src.resolve().parent
    script, out = tree / "scripts" / "compile.py", tree / "build" / "compiled"
    if not script.is_file():
        raise BuildFailed(f"{src}: no scripts/compile.py beside it to build a compiled copy")
    pgo = ["--pgo"] if '"--pgo"' in script.read_text() else []  # an older tree's: without
    command = [sys.executable, str(script), "--out", str(out), *pgo]
    print(f"building the compiled core of {src} ({' '.join(command[1:])})", flush=True)
    done = subprocess.run(command, check=False)
    if done.returncode != 0:
        raise BuildFailed(f"{script} --out {out} failed (exit status {done.returncode})")
    return out


def pythonpath(build: str, src: Path) -> str:
    """What PYTHONPATH puts in front for `build` of the tree whose package is in `src`."""
    return str(compiled_copy(src) if build == "compiled" else src)


def environment(build: str) -> dict[str, str]:
    """The environment this checkout's gateway arms need on top of the benchmark's own:
    nothing for pure (its editable install), PYTHONPATH for compiled."""
    return {} if build == "pure" else {"PYTHONPATH": pythonpath(build, ROOT / "src")}


def named(env: dict[str, str]) -> str:
    """`fallback-mw --version` of the gateway `env` runs: the build measured."""
    said = subprocess.run(
        [sys.executable, "-m", "fallback_mw", "--version"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return said.stdout.strip() or f"(--version failed: {said.stderr.strip()[-200:]})"
