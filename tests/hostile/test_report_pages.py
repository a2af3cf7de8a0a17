"""The HTML report pages (`gameday`, `eval`) carry text the command did not write: the
names of the alerts a shared Prometheus fires (any text a rule names them), a store's
error message. Opened in a real browser, such text must read as the characters it holds:
it cannot reorder the rest of its line (tests/e2e/test_report_page_alerts.py, with a real
Prometheus), nor stop the page or the report from being written. An alerts API answering
what a real Prometheus cannot (an unpaired surrogate, another shape) is played here."""

from __future__ import annotations

import http.server
import io
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from fallback_mw.cli import main
from tests.browser import reading_order


def _store(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    config = tmp_path / "gw.toml"
    config.write_text(
        f'[gateway]\nstore = "{url}"\n\n'
        '[upstreams.primary]\nurl = "http://127.0.0.1:9"\n\n'
        '[upstreams.backup]\nurl = "http://127.0.0.1:10"\n\n'
        '[[routes]]\nid = "chat"\nprefix = "/chat/"\nplan = ["primary", "backup"]\nretries = 1\n'
    )
    return str(config)


@contextmanager
def _prometheus_firing(
    *names: str, listed: list[Any] | None = None, rules: Any = None
) -> Iterator[str]:
    """Prometheus's alerts API (`GET /api/v1/alerts`), as a shared one answers it: nothing
    firing at the game day's baseline, then `names` firing (the JSON escapes each name, as
    any JSON encoder may), or the alerts `listed` as they are. Its rules API answers
    `rules` as they are, or 404 (then the prediction's alert name is not checked)."""
    polls: list[int] = []

    class Alerts(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/api/v1/rules") and rules is not None:
                self._answer({"status": "success", "data": {"groups": rules}})
                return
            if not self.path.startswith("/api/v1/alerts"):
                self.send_error(404)
                return
            polls.append(1)
            alerts = [
                {"labels": {"alertname": name}, "state": "firing"}
                for name in (names if len(polls) > 1 else ())
            ]
            if listed is not None and len(polls) > 1:
                alerts = listed
            self._answer({"status": "success", "data": {"alerts": alerts}})

        def _answer(self, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Alerts)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _game_day(tmp_path: Path, prometheus: str) -> tuple[str, Path]:
    out = tmp_path / "r.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    argv = [
        "gameday", "--config", _store(tmp_path), "--route", "chat", "--fault", "fail",
        "--duration", "2s", "--recovery-wait", "1s", "--owner", "Ana", "--out", str(out),
        "--prometheus", prometheus, "--predict", "alert:FallbackMwBreakerOpen<=30s",
        "--abort", "error_rate=50%",
    ]  # fmt: skip
    status = main(argv, stdout=stdout, stderr=stderr)
    # That alert never fires here (no traffic): NO DATA, exit status 1, the report written.
    assert status == 1 and "internal error" not in stderr.getvalue(), stderr.getvalue()
    return stdout.getvalue(), out


def test_an_alert_name_no_encoding_can_write_still_leaves_the_page_and_the_printed_report(
    tmp_path: Path,
) -> None:
    """JSON can name an alert with an unpaired surrogate escape (`\\ud800`), which no UTF-8
    holds: the exercise ran and cleared its fault, then writing the page failed ("unexpected
    internal error (UnicodeEncodeError)"), and the report it prints after the page was never
    printed. The character reads `?` on the page, as in the printed report."""
    with _prometheus_firing("Odd\ud800Alert") as prometheus:
        printed, out = _game_day(tmp_path, prometheus)
    assert "Odd?Alert firing at +" in printed
    page = out.with_suffix(".html").read_text(encoding="utf-8")
    assert "Odd?Alert firing +" in page
    labels = reading_order(out.with_suffix(".html"), tmp_path, "g.event text")
    assert any(label["text"].startswith("Odd?Alert firing +") for label in labels), labels


def test_an_alert_name_of_100000_characters_is_quoted_by_its_start(tmp_path: Path) -> None:
    """Prometheus sets no bound on a rule's name: one of 100,000 characters that fired was
    printed whole in the report's prometheus line and drawn whole in the page's timeline
    (a label 100,000 characters wide). Both quote its first 60 characters and its length,
    as the store's long keys are quoted; the JSON report keeps the name as it came."""
    name = "A" * 99_999 + "Z"
    with _prometheus_firing(name) as prometheus:
        printed, out = _game_day(tmp_path, prometheus)
    assert json.loads(out.read_text())["prometheus"]["alerts"].keys() == {name}
    line = next(line for line in printed.splitlines() if "prometheus:" in line)
    assert len(line) < 300, line[:300]
    assert f"{'A' * 60}...(100000 characters) firing at +" in line, line[:300]
    page = out.with_suffix(".html").read_text(encoding="utf-8")
    assert len(page) < 20_000, len(page)
    assert f"{'A' * 60}...(100000 characters) firing +" in page


@pytest.mark.parametrize(
    "alert",
    [{"labels": ["alertname", "X"], "state": "firing"}, {"labels": "X", "state": "firing"}],
)
def test_an_alert_prometheus_lists_in_another_shape_is_a_failed_poll_not_a_lost_report(
    tmp_path: Path, alert: dict[str, Any]
) -> None:
    """An API that lists an alert in a shape Prometheus does not (its labels a list or a
    string: a proxy's, another product's) once the fault was set: the watch's poll
    raised past its own error handling, the exercise cleared its fault, then ended in
    "unexpected internal error (AttributeError)": no page, no printed report, the JSON
    report left as it was at the start ("running"). Such an answer is a failed poll, as an
    unreachable Prometheus is, and the report says how many there were."""
    with _prometheus_firing(listed=[alert]) as prometheus:
        printed, out = _game_day(tmp_path, prometheus)
    report = json.loads(out.read_text())
    assert report["status"] == "completed"
    assert report["prometheus"]["failed_polls"] >= 1, report["prometheus"]
    assert "polls failed" in printed and out.with_suffix(".html").exists()


def test_rules_listed_in_another_shape_leave_the_prediction_unchecked_not_an_error(
    tmp_path: Path,
) -> None:
    """The rules API (read to check an `alert:NAME` prediction's name before anything is
    set) answering a rule that is not an object was "unexpected internal error
    (AttributeError)"; an answer it cannot read says nothing, as an error status does."""
    with _prometheus_firing(rules=[{"rules": [["FallbackMwBreakerOpen"]]}]) as prometheus:
        printed, out = _game_day(tmp_path, prometheus)
    assert json.loads(out.read_text())["status"] == "completed", printed


@pytest.mark.parametrize("hostile", ["\x1b[2J", "\u2066\u202e", "a\u200fb"])
def test_the_page_text_holds_only_printable_characters(hostile: str) -> None:
    """Every text a page quotes goes through one function (`html_page.text`): what is not
    printable (an escape, a bidi control, a right-to-left mark) reads `?`, markup is
    escaped."""
    from fallback_mw.cli.html_page import text

    shown = text(f'<b x="1">{hostile}</b>')
    assert shown.startswith("&lt;b x=&quot;1&quot;&gt;") and shown.endswith("&lt;/b&gt;")
    assert shown.isprintable() and "?" in shown
    assert text("store failed:\n\tdisk full") == "store failed: disk full"
