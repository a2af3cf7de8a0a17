"""`fallback-mw eval`: the four arms over real loopback sockets (a real `fallback-mw serve`
process, scripted aiohttp upstreams, an aiohttp client). Only the deterministic properties
are asserted — counts, attempts, integrity — never a latency."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fallback_mw.cli.evaluation.arms import _integrity, _request_body
from fallback_mw.cli.evaluation.upstreams import Exchange, ScriptedUpstream, answer_body, digest
from tests.cli_runner import run_cli

pytestmark = pytest.mark.e2e

REQUESTS = 20


def _run_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str], primary: str) -> dict[str, Any]:
    out = tmp_path / "results" / "eval.json"
    status = run_cli(["eval", "--requests", str(REQUESTS), "--primary", primary, "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    artifact: dict[str, Any] = json.loads(out.read_text())
    for arm in artifact["arms"]:
        assert arm["name"] in printed  # the table names every arm
    return artifact


def _check_common(arms: list[dict[str, Any]]) -> None:
    assert [a["arm"] for a in arms] == [1, 2, 3, 4]
    for arm in arms:
        assert arm["requests"] == REQUESTS
        assert sum(arm["statuses"].values()) == REQUESTS
        # Every attempt the gateway reports is a request an upstream received, and back.
        assert arm["attempts_total"] == sum(arm["upstream_requests"].values())
        assert arm["integrity_failures"] == 0
        assert arm["integrity_checked"] == arm["successes"]
        assert arm["configuration"]["routes"][0]["plan"] == (
            ["primary", "backup"] if arm["arm"] in (2, 4) else ["primary"]
        )
    failing_single, failing_plan, healthy_single, healthy_plan = arms
    # (1) nothing answers; no fallback exists
    assert failing_single["successes"] == 0
    assert failing_single["fallbacks"] == 0
    assert set(failing_single["attempts_histogram"]) <= {"0", "1"}
    # (2) the plan answers every request, each from the backup
    assert failing_plan["successes"] == REQUESTS
    assert failing_plan["fallbacks"] == REQUESTS
    assert failing_plan["upstream_requests"]["backup"] == REQUESTS
    assert set(failing_plan["attempts_histogram"]) <= {"1", "2"}
    # (3) and (4): one attempt each, all at the primary, the backup never touched
    for arm in (healthy_single, healthy_plan):
        assert arm["successes"] == REQUESTS
        assert arm["fallbacks"] == 0
        assert arm["attempts_histogram"] == {"1": REQUESTS}
        assert arm["upstream_requests"]["primary"] == REQUESTS
    assert healthy_plan["upstream_requests"]["backup"] == 0


def test_eval_failing_primary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    artifact = _run_eval(tmp_path, capsys, "fail")
    assert artifact["primary"] == "fail"
    _check_common(artifact["arms"])
    # A failing primary answers 503 to every attempt it gets.
    assert artifact["arms"][0]["configuration"]["upstream_behaviour"]["primary"] == "fail"


def test_eval_hanging_primary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    artifact = _run_eval(tmp_path, capsys, "hang")
    _check_common(artifact["arms"])
    # Until its breaker opens, each request waits out the first-byte timeout; the walk
    # reports those as gateway errors, never as the hanging upstream's answer.
    assert "200" not in artifact["arms"][0]["statuses"]


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
