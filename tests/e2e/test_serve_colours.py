"""uvicorn's coloured "INFO:" lines only where they are read as colour: serve's log is
stderr, so stderr must be a terminal that shows colour (not TERM=dumb, not NO_COLOR)."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def write_config(tmp_path: Path) -> Path:
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.p]\nurl = "http://127.0.0.1:9"\n[[routes]]\nid = "r"\nprefix = "/r/"\n'
        'plan = ["p"]\n',
        encoding="utf-8",
    )
    return config


def serve_log(config: Path, env: dict[str, str], *, stderr_on_terminal: bool, log: Path) -> str:
    """What serve wrote to stderr until its startup completed (then Ctrl-C); its stdout on
    a pseudo-terminal, its stderr on the same one or in the file `log`."""
    leader, follower = pty.openpty()
    with log.open("wb") as file:
        process = subprocess.Popen(
            [str(Path(sys.executable).with_name("fallback-mw")), "serve", "--config",
             str(config), "--port", "0"],
            stdin=subprocess.DEVNULL, stdout=follower,
            stderr=follower if stderr_on_terminal else file, env=env,
        )  # fmt: skip
    os.close(follower)
    printed = b""
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            seen = printed if stderr_on_terminal else log.read_bytes()
            if b"Application startup complete" in seen:
                break
            if select.select([leader], [], [], 0.2)[0]:
                try:
                    printed += os.read(leader, 65536)
                except OSError:  # the process ended: the terminal is gone
                    break
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
        os.close(leader)
    text = (printed if stderr_on_terminal else log.read_bytes()).decode("utf-8", "replace")
    assert "Application startup complete" in text, text
    return text


def plain_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    env["TERM"] = "xterm-256color"
    return env


def test_serve_on_a_terminal_with_its_log_in_a_file_writes_no_colour_there(
    tmp_path: Path,
) -> None:
    """`fallback-mw serve ... 2> serve.log` from a shell: uvicorn asked whether stdout was a
    terminal, and wrote `ESC[32mINFO ESC[0m:` into the log file, which grep, a log shipper
    and an editor then show as escape sequences."""
    config = write_config(tmp_path)
    log = tmp_path / "serve.log"
    text = serve_log(config, plain_env(), stderr_on_terminal=False, log=log)
    assert "\x1b[" not in text, text
    assert "INFO:     Application startup complete." in text
    # The control: with both on the terminal, colour as before.
    coloured = serve_log(config, plain_env(), stderr_on_terminal=True, log=log)
    assert "\x1b[" in coloured


def test_serve_on_a_dumb_terminal_writes_no_colour(tmp_path: Path) -> None:
    """TERM=dumb (Emacs' shell, a CI console that shows escapes as text) still got them."""
    config = write_config(tmp_path)
    env = {**plain_env(), "TERM": "dumb"}
    text = serve_log(config, env, stderr_on_terminal=True, log=tmp_path / "unused.log")
    assert "\x1b[" not in text, text
