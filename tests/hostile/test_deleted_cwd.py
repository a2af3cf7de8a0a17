"""A command run in a directory that has since been removed (a release directory a deploy
replaced, a shell left in a deleted checkout): every relative path is unusable, and the
error says so instead of a bare "FileNotFoundError"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fallback_mw import Gateway
from tests.upstreams import host_app


def run_in_deleted_directory(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    gone = tmp_path / "release-41"
    gone.mkdir()
    return subprocess.run(
        [
            *("bash", "-c", 'cd "$1" && rmdir "$1" && shift && exec "$@"', "bash", str(gone)),
            *(sys.executable, "-m", "fallback_mw", *argv),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )


@pytest.mark.parametrize(
    "argv",
    [
        ("check", "--config", "gateway.toml"),
        ("routes", "list", "--store", "sqlite:///routes.db"),
        ("usage", "--config", "gateway.toml"),
    ],
    ids=["check", "routes-list", "usage"],
)
def test_a_relative_path_in_a_deleted_directory_is_named_as_such(
    tmp_path: Path, argv: tuple[str, ...]
) -> None:
    """Each printed `fallback-mw: error: FileNotFoundError: No such file or directory`
    (exit 1): naming neither the file nor why; the config file's own "not found" message
    failed as it asked for the current directory to say where it had looked."""
    done = run_in_deleted_directory(tmp_path, *argv)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "current directory" in lines[0] and "no longer exists" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert done.returncode in (1, 2)


def test_gateway_given_a_relative_path_in_a_deleted_directory_reports_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host app (Django's `Gateway(app, config="gateway.toml")`) got a FileNotFoundError
    out of the refusal's own message, not the configuration error the gateway reports."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    gateway = Gateway(host_app, config="gateway.toml")
    assert gateway.config_error is not None
    assert "'gateway.toml'" in gateway.config_error
    assert "no longer exists" in gateway.config_error
