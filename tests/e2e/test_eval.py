"""`fallback-mw eval`: the four arms over real loopback sockets (a real `fallback-mw serve`
process, scripted aiohttp upstreams, an aiohttp client). Only the deterministic properties
are asserted — counts, attempts, integrity — never a latency. With the breaker held closed
(the default) the counts are exact: 2.00 / 2.00 / 1.00 / 1.00 attempts per request."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from fallback_mw.cli.evaluation.arms import _integrity, _request_body
from fallback_mw.cli.evaluation.upstreams import Exchange, ScriptedUpstream, answer_body, digest
from tests.browser import layout, screenshot, visible
from tests.cli_runner import run_cli

pytestmark = pytest.mark.e2e

REQUESTS = 20


def _run_eval(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    primary: str,
    requests: int = REQUESTS,
    *extra: str,
) -> tuple[dict[str, Any], str]:
    out = tmp_path / "results" / "eval.json"
    argv = ["eval", "--requests", str(requests), "--primary", primary, "--out", str(out)]
    status = run_cli([*argv, *extra])
    printed = capsys.readouterr().out
    assert status == 0, printed
    artifact: dict[str, Any] = json.loads(out.read_text())
    for arm in artifact["arms"]:
        assert arm["name"] in printed  # the table names every arm
    assert (tmp_path / "results" / "eval.html").is_file()
    return artifact, printed


def _check_common(arms: list[dict[str, Any]], requests: int = REQUESTS) -> None:
    """What holds with the breaker held closed, whatever the primary's failure."""
    assert [a["arm"] for a in arms] == [1, 2, 3, 4]
    for arm in arms:
        assert arm["requests"] == requests
        assert sum(arm["statuses"].values()) == requests
        # Every attempt the gateway reports is a request an upstream received, and back.
        assert arm["attempts_total"] == sum(arm["upstream_requests"].values())
        assert arm["integrity_failures"] == 0
        assert arm["integrity_checked"] == arm["successes"]
        assert arm["configuration"]["routes"][0]["plan"] == (
            ["primary", "backup"] if arm["arm"] in (2, 4) else ["primary"]
        )
        assert arm["configuration"]["routes"][0]["retries"] == 1
    failing_single, failing_plan, healthy_single, healthy_plan = arms
    # (1) nothing answers; every request tried the same dead primary twice (one retry)
    assert failing_single["successes"] == 0
    assert failing_single["fallbacks"] == 0
    assert failing_single["attempts_histogram"] == {"2": requests}
    assert failing_single["upstream_requests"] == {"primary": 2 * requests}
    # (2) the plan answers every request from the backup, after one primary attempt each
    assert failing_plan["successes"] == requests
    assert failing_plan["fallbacks"] == requests
    assert failing_plan["attempts_histogram"] == {"2": requests}
    assert failing_plan["upstream_requests"] == {"primary": requests, "backup": requests}
    # (3) and (4): one attempt each, all at the primary, the backup never touched
    for arm in (healthy_single, healthy_plan):
        assert arm["successes"] == requests
        assert arm["fallbacks"] == 0
        assert arm["attempts_histogram"] == {"1": requests}
        assert arm["upstream_requests"]["primary"] == requests
    assert healthy_plan["upstream_requests"]["backup"] == 0
    per_request = [a["attempts_per_request"] for a in arms]
    assert per_request == [2.0, 2.0, 1.0, 1.0]


def test_eval_failing_primary_measures_the_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's numbers: 300 requests, 2.00 / 2.00 / 1.00 / 1.00 attempts per request,
    300 fallbacks in arm 2; the table ends with the verdict, integrity as bad/checked."""
    artifact, printed = _run_eval(tmp_path, capsys, "fail", 300)
    assert artifact["primary"] == "fail"
    assert artifact["breaker"] == "held closed"
    _check_common(artifact["arms"], 300)
    assert artifact["arms"][1]["fallbacks"] == 300
    # A failing primary answers 503 to every attempt it gets; arm 1 relays no answer.
    assert artifact["arms"][0]["configuration"]["upstream_behaviour"]["primary"] == "fail"
    assert artifact["arms"][0]["statuses"] == {"502": 300}
    lines = printed.splitlines()
    rows = [line.split() for line in lines if line[:3].strip() in ("1", "2", "3", "4")]
    # att/req is the column after the success rate (the scenario names vary in length)
    att = [row[next(i for i, cell in enumerate(row) if cell.endswith("%")) + 1] for row in rows]
    assert att == ["2.00", "2.00", "1.00", "1.00"]
    assert "bad/checked" in printed
    assert [row[-2] for row in rows] == ["0/0", "0/300", "0/300", "0/300"]
    verdict = [line for line in lines if line.startswith("verdict:")]
    assert len(verdict) == 1 and verdict[0].startswith("verdict: PASS")
    last_row = max(i for i, line in enumerate(lines) if line[:3].strip() in ("1", "2", "3", "4"))
    assert lines.index(verdict[0]) == last_row + 1  # the table ends with the verdict
    assert artifact["verdict"]["passed"] is True


def test_eval_breaker_on_measures_the_breaker_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--breaker on`: the gateway's default breaker opens on the failing primary, so most
    requests of arm 1 are answered without an attempt and arm 2 skips the primary."""
    artifact, _ = _run_eval(tmp_path, capsys, "fail", 100, "--breaker", "on")
    assert artifact["breaker"].startswith("on")
    single, plan, healthy_single, healthy_plan = artifact["arms"]
    assert "breaker" not in artifact["arms"][0]["configuration"]["gateway"]
    assert single["successes"] == 0 and plan["successes"] == 100
    # The breaker opened well before the end: fewer attempts than the held-closed run.
    assert single["attempts_total"] < 100
    assert plan["upstream_requests"]["primary"] < 100
    assert plan["upstream_requests"]["backup"] == 100
    for arm in (healthy_single, healthy_plan):
        assert arm["attempts_histogram"] == {"1": 100}


@pytest.mark.slow
def test_eval_hanging_primary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    artifact, _ = _run_eval(tmp_path, capsys, "hang")
    _check_common(artifact["arms"])
    # Each attempt waits out the first-byte timeout; the walk reports those as gateway
    # errors, never as the hanging upstream's answer.
    assert "200" not in artifact["arms"][0]["statuses"]


def test_eval_page_renders_in_chromium(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The HTML page beside the JSON: self-contained (the browser fetched nothing), the
    table, the verdict, and per arm a latency histogram with p50/p95/p99 marks, as laid
    out by headless Chromium."""
    artifact, _ = _run_eval(tmp_path, capsys, "fail")
    page = tmp_path / "results" / "eval.html"
    html = page.read_text()
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in html
    seen = layout(page, tmp_path)
    assert seen["title"] == "fallback-mw eval"
    assert seen["requests"] == []  # nothing loaded from anywhere
    marks = seen["marks"]
    charts = visible(marks, tag="svg", cls="latency")
    assert sorted(int(m["data"]["arm"]) for m in charts) == [1, 2, 3, 4]
    assert all(m["w"] >= 600 and m["h"] >= 100 for m in charts)
    assert len(visible(marks, tag="rect", cls="bin")) >= 4  # every arm has bars
    for name in ("p50", "p95", "p99"):
        assert len(visible(marks, tag="line", cls=name)) == 4
    assert artifact["verdict"]["line"] in seen["text"]
    assert "0/20" in seen["text"]  # integrity as bad/checked
    if os.environ.get("FALLBACK_MW_SCREENSHOTS"):  # docs/img/, refreshed by hand
        screenshot(page, Path(os.environ["FALLBACK_MW_SCREENSHOTS"]) / "eval.png", tmp_path)


def test_integrity_check_catches_a_changed_or_foreign_body() -> None:
    """Negative control for the integrity column."""
    upstream = ScriptedUpstream(name="backup", behaviour="ok")
    sent = _request_body("n1")
    body = answer_body("backup", "n1")
    upstream.exchanges["n1"] = Exchange(received=digest(sent), sent=digest(body))
    by_name = {"backup": upstream}
    assert _integrity(body, sent, "n1", "backup", by_name)
    assert not _integrity(body[:-1] + b"X", sent, "n1", "backup", by_name)
    assert not _integrity(answer_body("backup", "n2"), sent, "n1", "backup", by_name)
    assert not _integrity(body, _request_body("n2"), "n1", "backup", by_name)
    assert not _integrity(body, sent, "n1", "primary", by_name)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["eval", "--requests", "0"], "--requests must be between"),
        (["eval", "--concurrency", "-3"], "--concurrency must be between"),
    ],
)
def test_eval_refuses_bad_input(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fallback-mw: error: ") and message in err
    assert "Traceback" not in err


def test_eval_refuses_a_directory_as_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(["eval", "--requests", "1", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_eval_refuses_an_out_it_cannot_write_before_running_the_arms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An --out whose directory cannot be made is refused at once (exit 2, nothing run),
    as gameday does: it ran all four arms (minutes with a large --requests) and only then
    failed, losing the artifact."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "results" / "eval.json"
    assert run_cli(["eval", "--requests", "1", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("fallback-mw: error: --out ") and str(out) in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    assert "route-plan evaluation" not in captured.out  # no arm ran


def test_the_evaluation_gateway_port_is_one_no_outgoing_connection_can_take() -> None:
    """eval's own gateway took its port from bind(0): the kernel's ephemeral range, which
    it also hands to outgoing connections as local ports, so the port could be taken
    before `serve` bound it ("address already in use"). Drawn below that range now."""
    from fallback_mw.cli.evaluation import gateway
    from fallback_mw.cli.ports import FIRST_EPHEMERAL

    for _ in range(50):
        port = gateway.free_port()
        assert 10_000 <= port < FIRST_EPHEMERAL
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free


def test_eval_on_a_port_another_program_listens_on_says_so_and_measures_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`eval --port P` with P already taken: its gateway could not bind, but eval saw P
    accept a connection (the other program's) and ran its arms against that program,
    printing a table and a verdict of someone else's server."""
    import threading

    from fallback_mw.cli.ports import free_port

    foreign = socket.socket()
    foreign.bind(("127.0.0.1", free_port()))
    foreign.listen(64)
    port = foreign.getsockname()[1]

    def answer_and_close() -> None:  # a server that is not the gateway: closes at once
        while True:
            try:
                conn, _ = foreign.accept()
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=answer_and_close, daemon=True)
    thread.start()
    try:
        out = tmp_path / "eval.json"
        status = run_cli(["eval", "--requests", "2", "--port", str(port), "--out", str(out)])
    finally:
        with contextlib.suppress(OSError):
            foreign.shutdown(socket.SHUT_RDWR)  # wakes the accept() of the thread
        foreign.close()
        thread.join(5)
    captured = capsys.readouterr()
    assert status == 1, captured
    assert captured.err == (
        f"fallback-mw: error: the gateway exited (1): cannot listen on 127.0.0.1:{port}: "
        "address already in use\n"
    )
    assert "verdict" not in captured.out and not out.exists()
