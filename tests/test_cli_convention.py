"""One command tree, one convention: exit 0 done, 2 usage error or refusal, 1 runtime
failure; every failure is exactly one `fallback-mw: error: ...` line on stderr and never a
traceback. Driven through the installed `fallback-mw` script and `python -m fallback_mw`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fallback_mw.cli import VERBS, build_parser

FALLBACK_MW = str(Path(sys.executable).with_name("fallback-mw"))
SECRET = "pw-secret-never-printed"


def run(*args: str | bytes, module: bool = False) -> subprocess.CompletedProcess[str]:
    command: list[str | bytes] = (
        [sys.executable, "-m", "fallback_mw", *args] if module else [FALLBACK_MW, *args]
    )
    return subprocess.run(
        command, capture_output=True, text=True, timeout=60, check=False, env=dict(os.environ)
    )


def assert_one_error_line(result: subprocess.CompletedProcess[str], status: int) -> str:
    assert result.returncode == status, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fallback-mw: error: ")
    assert SECRET not in result.stderr + result.stdout
    return lines[0]


def test_every_verb_is_one_tree_under_one_entry_point() -> None:
    names = {"serve", "demo", "check", "request", "routes", "faults", "budgets", "usage"}
    names |= {"eval", "gameday", "capacity"}
    result = run("--help")
    assert result.returncode == 0
    for name in names:
        assert f"    {name} " in result.stdout
    assert run("--help", module=True).stdout == result.stdout
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(commands) == names
    assert all(callable(verb.register) for verb in VERBS)


@pytest.mark.parametrize(
    "args",
    [
        ["no-such-verb"],
        ["routes", "add", "--store", "sqlite:///x.db"],
        ["faults", "set", "explode", "--ttl", "5"],
        ["faults", "set", "fail", "--upstream", "p", "--ttl", "1e400"],
        ["faults", "set", "fail", "--upstream", "p", "--ttl", "10**9"],
        ["demo", "--port", "70000"],
        ["serve", "--config", "x.toml", "--port", "-1"],
        ["budgets", "show", "--bogus"],
        ["usage", "--limit", "many"],
    ],
)
def test_usage_errors_exit_2_with_one_line(args: list[str]) -> None:
    assert_one_error_line(run(*args), 2)


@pytest.mark.parametrize(
    ("args", "verb"),
    [
        (["budgets", "show", "--bogus"], "budgets show"),
        (["faults", "list", "--store", "sqlite:///x.db", "--bogus"], "faults list"),
        (["check", "--config", "x.toml", "extra"], "check"),
    ],
)
def test_an_unknown_argument_is_named_with_its_verb(args: list[str], verb: str) -> None:
    line = assert_one_error_line(run(*args), 2)
    assert line.startswith(f"fallback-mw: error: {verb}: unrecognized arguments: "), line


@pytest.mark.slow
def test_refusals_exit_2_with_one_line(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 's.db'}"
    cases = [
        ["faults", "clear", "--store", store],
        ["faults", "set", "fail", "--store", store, "--upstream", "p", "--ttl", "99999999999"],
        ["routes", "add", "--store", store, "--id", "r", "--prefix", "/r/",
         "--upstream", "http://127.0.0.1:1", "--retries", "99999999999999999999"],
        ["routes", "add", "--store", store, "--id", "r", "--prefix", "/r/",
         "--upstream", "http://169.254.169.254/"],
        ["routes", "list", "--store", "redis://127.0.0.1"],
        ["routes", "list"],
        ["usage", "--store", store, "--since", "99999999999d"],
        ["check", "--config", str(tmp_path / "absent.toml")],
    ]  # fmt: skip
    for args in cases:
        assert_one_error_line(run(*args), 2)
    assert run("routes", "list", "--store", store).stdout == "no routes\n"


def test_a_non_utf8_argument_is_refused_before_anything_is_stored(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 's.db'}"
    result = subprocess.run(
        [FALLBACK_MW, "routes", "add", "--store", store, "--id", b"chat\xff", "--prefix", "/c/",
         "--upstream", "http://127.0.0.1:1"],
        capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == b"fallback-mw: error: argument 6 is not valid UTF-8 text\n"
    assert not (tmp_path / "s.db").exists()


def test_under_an_ascii_locale_a_utf8_argument_says_how_and_output_is_escaped(
    tmp_path: Path,
) -> None:
    # Under LC_ALL=C without Python's UTF-8 mode (a cron job's environment) Python reads
    # the arguments as ASCII: a tenant `日本語` typed in UTF-8 was refused as "not valid
    # UTF-8 text", which it is; the refusal now says what to run instead. And Python's
    # stdout there is ASCII with `surrogateescape`, not `strict`: printing that tenant (a
    # `routes list`, any usage row holding one) ended in 'unexpected internal error
    # (UnicodeEncodeError)'. It is printed escaped, as under PYTHONIOENCODING=ascii.
    store = f"sqlite:///{tmp_path / 's.db'}"
    add = [FALLBACK_MW, "routes", "add", "--store", store, "--id", "chat", "--prefix", "/c/",
           "--tenant", "日本語", "--upstream", "http://127.0.0.1:1"]  # fmt: skip
    ascii_locale = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    refused = subprocess.run(add, capture_output=True, timeout=60, check=False, env=ascii_locale)
    assert refused.returncode == 2
    assert refused.stderr.startswith(b"fallback-mw: error: argument 10 is UTF-8 text this")
    assert b"PYTHONUTF8=1" in refused.stderr and len(refused.stderr.splitlines()) == 1
    utf8_mode = {**ascii_locale, "PYTHONUTF8": "1"}
    added = subprocess.run(add, capture_output=True, timeout=60, check=False, env=utf8_mode)
    assert added.returncode == 0, added.stderr
    listed = subprocess.run(
        [FALLBACK_MW, "routes", "list", "--store", store],
        capture_output=True, timeout=60, check=False, env=ascii_locale,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert b"tenant=\\u65e5\\u672c\\u8a9e\t" in listed.stdout


@pytest.mark.slow
def test_runtime_failures_exit_1_with_one_line(tmp_path: Path) -> None:
    unreachable = f"postgresql://postgres:{SECRET}@127.0.0.1:1/none"
    for args in (
        ["routes", "list", "--store", unreachable],
        ["faults", "list", "--store", unreachable],
        ["budgets", "show", "--store", unreachable],
        ["usage", "--store", unreachable],
        ["routes", "list", "--store", f"sqlite:///{tmp_path}/missing/dir/x.db"],
        ["routes", "remove", "--store", f"sqlite:///{tmp_path / 's.db'}", "--id", "nope"],
    ):
        line = assert_one_error_line(run(*args), 1)
        assert any(word in line for word in ("PostgreSQL", "postgres@", "SQLite", "no route"))


def test_help_of_a_verb_exits_0() -> None:
    result = run("faults", "clear", "--help")
    assert result.returncode == 0 and "--all" in result.stdout and result.stderr == ""


def test_every_option_of_every_verb_says_what_it_is_for() -> None:
    """`--help` is the operator's first manual: no option or argument is listed bare."""

    def bare(parser: argparse.ArgumentParser, verb: str) -> list[str]:
        found: list[str] = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += bare(sub, f"{verb} {name}".strip())
            elif (
                not isinstance(action, argparse._HelpAction | argparse._VersionAction)
                and not (action.help or "").strip()
            ):
                found.append(f"{verb}: {'/'.join(action.option_strings) or action.dest}")
        return found

    assert bare(build_parser(), "") == []


def test_check_env_says_what_it_checks_on_every_edit_verb() -> None:
    # `routes set-fallback --check-env` said "refuse when a named credential variable is
    # not set", but it also refused for the route's own primary, named by no argument, and
    # since the gateways refuse a whole store over one route it also checks every other
    # store route (a warning, the change stored). Each edit verb's --help says which.
    for verb, refuses in (
        ("add", True), ("set-fallback", True),
        ("set", False), ("clear-fallback", False), ("remove", False),
    ):  # fmt: skip
        result = run("routes", verb, "--help")
        assert result.returncode == 0, result.stderr
        text = " ".join(result.stdout.split())
        own = "also refuse when this route names a credential variable not set in this shell"
        assert (own in text) == refuses, text
        assert "refuses the whole store, this change included" in text, text


def test_no_option_is_explained_by_an_example_or_its_default_alone() -> None:
    # A new user reading `eval --help` met `--out FILE  (results/route-plan-eval.json)`
    # and `gameday --help` `--duration DURATION  e.g. 15m, 90s`: a default or an example,
    # but not what the option is. Every option's help starts by saying what it is for.
    import re

    def examples_only(parser: argparse.ArgumentParser, verb: str) -> list[str]:
        found: list[str] = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += examples_only(sub, f"{verb} {name}".strip())
            elif re.match(r"\(|e\.g\.", (action.help or "").strip()):
                found.append(f"{verb}: {'/'.join(action.option_strings)}: {action.help}")
        return found

    assert examples_only(build_parser(), "") == []


def test_the_operations_exit_status_table_lists_every_status_a_command_returns() -> None:
    # docs/operations.md's table told readers 0, 2 and 1 were all there is: dispatch also
    # returns 130 (Ctrl-C) and 141 (the reader went away), and the checking verbs exit 1
    # when their answer is no.
    from fallback_mw.cli.app import EXIT_FAILED, EXIT_OK, EXIT_REFUSED, EXIT_SIGPIPE

    doc = (Path(__file__).parents[1] / "docs" / "operations.md").read_text(encoding="utf-8")
    table = doc.split("Exit status, the same for every `fallback-mw` command", 1)[1]
    rows = [line for line in table.split("\n\n")[1].splitlines() if line.startswith("| **")]
    documented = {int(row.split("**")[1]) for row in rows}
    assert documented == {EXIT_OK, EXIT_FAILED, EXIT_REFUSED, 130, EXIT_SIGPIPE}
    failed = next(row for row in rows if row.startswith(f"| **{EXIT_FAILED}**"))
    for verb in ("capacity", "gameday", "eval", "request"):
        assert f"`{verb}`" in failed, verb


def test_no_error_or_warning_line_writes_a_terminal_control(tmp_path: Path) -> None:
    # An argument's control characters (a pasted escape sequence, a script's variable) were
    # repeated raw in the one line: `check --config` in 'looked for ...', `serve --host` in
    # 'cannot listen on ...', the no-store-file warning's path. The terminal acted on them
    # (here: retitle the window, clear the screen); each now shows as `?`.
    control = "\x1b]0;pwned\x07\x1b[2J"
    check = run("check", "--config", f"gw{control}.toml")
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.p]\nurl = "http://127.0.0.1:9"\n[[routes]]\nid = "r"\nprefix = "/r/"\n'
        'plan = ["p"]\n',
        encoding="utf-8",
    )
    serve = run("serve", "--config", str(config), "--host", control, "--port", "1")
    for result, says in ((check, "not found"), (serve, "cannot listen on")):
        line = assert_one_error_line(result, 2 if result is check else 1)
        assert says in line and "?]0;pwned??[2J" in line, line
        assert "\x1b" not in line and "\x07" not in line, line
    # A store URL holding a control character is refused whole (store_url._check_text),
    # never quoted: a file name no one can type, and the URL may hold a password.
    listed = run("routes", "list", "--store", f"sqlite:///{tmp_path}/s{control}.db")
    line = assert_one_error_line(listed, 2)
    assert "store URL has a control character" in line, line
    assert "\x1b" not in listed.stderr and "\x07" not in listed.stderr, listed.stderr


def test_a_closed_stdout_or_stderr_keeps_the_exit_status_and_names_the_closed_stream(
    tmp_path: Path,
) -> None:
    # Started with stdout closed (`>&-`, a supervisor that closes it), every verb ended in
    # 'unexpected internal error (AttributeError); please report it' (Python's sys.stdout
    # is None then); with stderr closed a refusal exited 1, not 2, its error line crashing.
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.p]\nurl = "http://127.0.0.1:9"\n[[routes]]\nid = "r"\nprefix = "/r/"\n'
        'plan = ["p"]\n',
        encoding="utf-8",
    )
    script = (
        '"$1" check --config "$2" >&-; echo "closed stdout: $?"; '
        '"$1" check --config "$2".absent 2>&-; echo "closed stderr: $?"'
    )
    result = subprocess.run(
        ["bash", "-c", script, "bash", FALLBACK_MW, str(config)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.stdout == "closed stdout: 1\nclosed stderr: 2\n", (result.stdout, result.stderr)
    assert result.stderr == (
        "fallback-mw: error: stdout is closed (the command was started with it closed): "
        "nothing can be printed\n"
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["routes", "--store", "sqlite:///x.db", "list"],
            "--store goes after the verb (fallback-mw routes VERB --store ...; "
            "`fallback-mw routes --help` lists the verbs)",
        ),
        (
            ["faults", "--config=gw.toml", "list"],
            "--config goes after the verb (fallback-mw faults VERB --config ...; "
            "`fallback-mw faults --help` lists the verbs)",
        ),
        (
            ["--config", "gw.toml", "check"],
            "--config goes after the command (fallback-mw COMMAND --config ...; "
            "`fallback-mw --help` lists the commands)",
        ),
    ],
)
def test_an_option_given_before_its_verb_is_refused_saying_where_it_goes(
    args: list[str], said: str
) -> None:
    # `fallback-mw routes --store URL list` (git's habit of options first) was answered
    # "routes: argument VERB: invalid choice: 'sqlite:///x.db' (choose from ...)": the store
    # URL named as the verb it could not find.
    line = assert_one_error_line(run(*args), 2)
    assert line == f"fallback-mw: error: {said}", line
