"""`fallback-mw gameday --prometheus` against a real Prometheus (Debian's `prometheus`)
whose rules are not the gateway's: a shared Prometheus holds other teams' rules, and
Prometheus takes any text as an alert's name. The report's page, opened in Chromium, reads
as the characters it holds."""

from __future__ import annotations

import http.server
import io
import json
import shutil
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from fallback_mw.cli import main
from tests.browser import reading_order
from tests.conftest import IN_CI
from tests.e2e.test_prometheus import prometheus, until
from tests.helpers import free_port, sqlite_db

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]


@contextmanager
def _fault_rows_exporter(db: Path) -> Iterator[str]:
    """A scrape target exposing how many fault rows the store holds (`store_faults`): a
    rule on it fires once the game day has set its fault, and not before."""

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            try:
                with sqlite_db(db) as conn:
                    rows = conn.execute("SELECT COUNT(*) FROM fmw_faults").fetchone()[0]
            except sqlite3.Error:  # no store yet
                rows = 0
            body = f"# TYPE store_faults gauge\nstore_faults {rows}\n".encode()
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_an_alert_named_with_a_right_to_left_override_cannot_reverse_its_time_on_the_page(
    tmp_path: Path,
) -> None:
    """Another team's rule in the shared Prometheus, named `Evil` + U+202E (a right-to-left
    override: `promtool check rules` passes it), fired during the exercise: the page's
    timeline drew the rest of its label reversed, `Evil firing +2.1 s` read
    `Evil s 1.2+ gnirif` (the time it fired another number). The name's character that is
    not printable reads `?` on the page, as the printed report says it, and the label reads
    left to right."""
    binary = shutil.which("prometheus")
    if binary is None:
        message = "prometheus not found (Debian package `prometheus`; scripts/test.sh installs it)"
        if IN_CI:
            pytest.fail(message + " (CI=true: a missing prometheus is a failure)")
        pytest.skip(message)
    db = tmp_path / "store.db"
    config = tmp_path / "gw.toml"
    config.write_text(
        f'[gateway]\nstore = "sqlite:///{db}"\n\n'
        '[upstreams.primary]\nurl = "http://127.0.0.1:9"\n\n'
        '[upstreams.backup]\nurl = "http://127.0.0.1:10"\n\n'
        '[[routes]]\nid = "chat"\nprefix = "/chat/"\nplan = ["primary", "backup"]\nretries = 1\n'
    )
    rules = tmp_path / "other-team.rules.yml"
    rules.write_text(
        "groups:\n  - name: other-team\n    rules:\n"
        '      - alert: "Evil\\u202e"\n        expr: store_faults > 0\n',
        encoding="utf-8",
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (
        _fault_rows_exporter(db) as target,
        prometheus(binary, tmp_path, target, port, rules=rules) as log,
    ):
        async with httpx.AsyncClient(timeout=5) as client:

            async def scraped() -> bool:
                # The rule is loaded and the target scraped (no fault yet: not firing), so
                # the game day's baseline sees it inactive.
                answer = await client.get(f"{url}/api/v1/query", params={"query": "store_faults"})
                answer.raise_for_status()
                return bool(answer.json()["data"]["result"])

            await until("Prometheus scraping the store's fault rows", scraped, within=60,
                        logs=[log])  # fmt: skip
        out = tmp_path / "r.json"
        stdout, stderr = io.StringIO(), io.StringIO()
        argv = [
            "gameday", "--config", str(config), "--route", "chat", "--fault", "fail",
            "--duration", "8s", "--recovery-wait", "1s", "--owner", "Ana", "--out", str(out),
            "--prometheus", url, "--predict", "error_rate=100%", "--abort", "error_rate=50%",
        ]  # fmt: skip
        status = await anyio.to_thread.run_sync(lambda: main(argv, stdout=stdout, stderr=stderr))
    printed = stdout.getvalue()
    assert status == 1, stderr.getvalue()  # no traffic: the prediction has NO DATA
    seen = json.loads(out.read_text())["prometheus"]["alerts"]
    assert seen.keys() == {"Evil\u202e"} and seen["Evil\u202e"]["firing_s"] is not None, seen
    assert "Evil? firing at +" in printed, printed
    labels = reading_order(out.with_suffix(".html"), tmp_path, "g.event text")
    fired = [label for label in labels if label["text"].startswith("Evil")]
    assert len(fired) == 1, labels
    text, xs = fired[0]["text"], fired[0]["x"]
    assert xs == sorted(xs), (text, xs)  # every character right of the one before it
    assert text.startswith("Evil? firing +") and text.endswith(" s"), text
