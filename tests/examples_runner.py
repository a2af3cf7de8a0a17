"""Start an example as its README says (`python examples/<name>/run.py`), on free ports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@dataclass
class Example:
    url: str  # the gateway (the app)
    primary: str  # the mock upstreams
    backup: str
    output: list[str]  # complete once the example has stopped


@contextmanager
def running_example(name: str) -> Iterator[Example]:
    """`python examples/<name>/run.py --port 0`, run as its README says; yields the gateway
    URL it prints. Stopped with SIGINT (Ctrl-C), killed if it does not stop."""
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE",)}
    env.pop("PRIMARY_API_KEY", None)
    env.pop("BACKUP_API_KEY", None)
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLES / name / "run.py"), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    watchdog = threading.Timer(60, process.kill)  # a hung start fails the test, not the suite
    watchdog.start()
    output: list[str] = []
    url = primary = backup = None
    try:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            found = re.match(r"gateway: (http://127\.0\.0\.1:\d+)", line)
            if found:
                url = found.group(1)
            upstreams = re.match(r"primary (\S+) answers 503; backup (\S+) ", line)
            if upstreams:
                primary, backup = upstreams.groups()
                break
        assert url is not None and primary and backup, "".join(output)
        # The watchdog times the start only: a module whose tests use the example for longer
        # than that (a slow or busy machine) must not lose it midway.
        watchdog.cancel()
        yield Example(url=url, primary=primary, backup=backup, output=output)
    finally:
        watchdog.cancel()
        process.send_signal(2)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            output.extend(process.stdout)
            process.stdout.close()
