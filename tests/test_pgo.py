"""scripts/compile.py --pgo: the compiled core built twice, the second time laid out by gcc
from the counts of a training run through `serve` (scripts/pgo_train.py). The whole build is
what scripts/test.sh's compiled pass runs its suite against; here, the training run itself
(against the pure package: the same traffic, real sockets), what it does when `serve`
cannot answer, and the refusals before anything is built."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "scripts" / "pgo_train.py"
COMPILE = ROOT / "scripts" / "compile.py"

pytestmark = pytest.mark.pure_pass_only(
    reason="runs scripts/pgo_train.py and compile.py on the tree, not the package's build"
)


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_the_training_run_sends_every_kind_of_request_through_serve() -> None:
    """Against the package's sources (PYTHONPATH=src): every request answered as it should
    be (the script checks each, failover and budget included), serve stopped cleanly."""
    result = _run(str(TRAIN), str(ROOT / "src"))
    assert result.returncode == 0, result.stderr
    assert "3600 requests through serve" in result.stdout


def test_a_training_run_whose_serve_cannot_start_fails_and_says_why(tmp_path: Path) -> None:
    """A copy whose package does not import: serve exits before it listens; the run fails
    with serve's own words, and no profile of a failure is taken as a layout."""
    broken = tmp_path / "staging" / "fallback_mw"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('the copy is broken')\n")
    (broken / "__main__.py").write_text("")
    result = _run(str(TRAIN), str(tmp_path / "staging"))
    assert result.returncode == 1
    assert "serve exited with status 1 before listening" in result.stderr
    assert "the copy is broken" in result.stderr


def test_pgo_is_refused_without_gcc(tmp_path: Path) -> None:
    """The profile flags are gcc's: another compiler (a clang here) is refused in one line
    before any build, and --out is left as it was."""
    clang = tmp_path / "clang"
    clang.write_text("#!/bin/sh\necho 'Debian clang version 16.0.6'\n")
    clang.chmod(0o755)
    out = tmp_path / "compiled"
    result = _run(str(COMPILE), "--out", str(out), "--pgo", env={"CC": str(clang)})
    assert result.returncode == 2, result.stderr
    assert f"--pgo: the profile flags are gcc's, and {clang} is not gcc" in result.stderr
    assert not out.exists()


def _compile_module() -> Any:
    spec = importlib.util.spec_from_file_location("fmw_compile_script", COMPILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("caller", [None, "-march=x86-64-v2"], ids=["unset", "caller's"])
def test_the_profile_flags_come_after_the_flags_the_build_would_use(caller: str | None) -> None:
    """setuptools 84 (a wheel's build environment) takes a CFLAGS set instead of the
    interpreter's flags: the profile flags alone lost -fwrapv and -DNDEBUG there (seen in
    the first FALLBACK_MW_PGO=1 wheel). They are added after the interpreter's flags, or
    after the caller's CFLAGS when set; LDFLAGS after the caller's."""
    compile_script = _compile_module()
    env = {} if caller is None else {"CFLAGS": caller, "LDFLAGS": "-Wl,-O1"}
    flags = compile_script._flags(env, *compile_script.PGO_GENERATE)
    base = caller or sysconfig.get_config_var("CFLAGS")
    assert flags["CFLAGS"] == f"{base} -fprofile-generate -fprofile-update=atomic"
    if caller is None:
        assert "-fwrapv" in flags["CFLAGS"] and "-DNDEBUG" in flags["CFLAGS"]
    expected_ld = "-fprofile-generate" if caller is None else "-Wl,-O1 -fprofile-generate"
    assert flags["LDFLAGS"] == expected_ld
    used = compile_script._flags(env, compile_script.PGO_USE)
    assert used["CFLAGS"].endswith(" -fprofile-use -fprofile-partial-training -Wno-missing-profile")
    assert used.get("LDFLAGS") == env.get("LDFLAGS")


def test_pgo_is_for_out_builds() -> None:
    result = _run(str(COMPILE), "--pgo")
    assert result.returncode == 2
    assert "--pgo is for --out builds" in result.stderr
