"""Docs that cannot drift: every fenced code block in README.md, docs/*.md and the examples'
READMEs is executed or loaded here, by its language tag:

* `toml`: loaded with `load_config` (each credential variable it names set to a dummy
  value). `<!-- docs-test: fragment -->` before a block adds `[upstreams.NAME]` for every
  plan name the block does not define.
* `python`: run in a fresh interpreter (warnings are errors) in a directory holding a
  `gateway.toml`, against the example app with its local mock upstreams (a primary
  answering 503, an OpenAI/Anthropic-shaped backup); `127.0.0.1:8000` in the snippet is
  replaced by the example's address. `<!-- docs-test: django -->` sets up Django settings
  with the gateway middleware first.
* `yaml`, `json`: parsed.
* `sh`: run with bash only under `<!-- docs-test: run -->` (in that directory, `.venv/bin`
  first on PATH, against the running example); otherwise the block must say why not with
  `<!-- docs-test: skip: REASON -->`, reported as a skipped test with that reason.
* `text` (output samples, command synopses): not executed.

A block with no language, or any other language, fails: say what it is. The last test
checks the checker: planted broken snippets must fail it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from fallback_mw import load_config
from fallback_mw.cli.config_warnings import route_warnings
from tests.examples_runner import Example, running_example

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").glob("*/README.md")),
]
DOCUMENTED_ADDRESS = "127.0.0.1:8000"
SHELL = {"sh", "bash", "shell"}
NOT_RUN = {"text"}
# Blocks that must stay exactly as they are (the README starts with its two commands), with
# the reason they are not run here.
SKIPPED_HERE = {
    ("README.md", "./scripts/demo.sh\n./scripts/test.sh\n"): (
        "./scripts/test.sh is this suite; the demo runs in "
        "tests/test_cli.py::test_demo_shows_failover_and_the_post_rule"
    ),
}
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str  # "" without a <!-- docs-test: ... --> line right before the fence

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse_blocks(path: Path, text: str | None = None) -> list[Block]:
    lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opened = _FENCE.match(lines[index])
        if not opened:
            index += 1
            continue
        indent, fence, lang = opened.groups()
        body: list[str] = []
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            body.append(lines[end][len(indent) :] if lines[end].startswith(indent) else lines[end])
            end += 1
        previous = lines[index - 1] if index > 0 else ""
        marker = _MARKER.match(previous)
        blocks.append(
            Block(
                path=path,
                line=index + 1,
                lang=lang.lower(),
                text="\n".join(body) + "\n",
                marker=marker.group(1) if marker else "",
            )
        )
        index = end + 1
    return blocks


ALL_BLOCKS = [block for doc in DOCS for block in parse_blocks(doc)]


# --- the checks, one per kind -----------------------------------------------------------


def check_toml(block: Block) -> None:
    text = block.text
    if block.marker == "fragment":
        data = tomllib.loads(text)
        defined = set(data.get("upstreams", {}))
        wanted = [n for r in data.get("routes", []) for n in r.get("plan", []) if n not in defined]
        for number, name in enumerate(dict.fromkeys(wanted)):
            text += f'\n[upstreams."{name}"]\nurl = "http://127.0.0.1:{9100 + number}"\n'
    data = tomllib.loads(text)
    variables = {
        var
        for upstream in data.get("upstreams", {}).values()
        for var in (
            [upstream["auth_env"]]
            if isinstance(upstream.get("auth_env"), str)
            else upstream.get("auth_env", [])
        )
    }
    config = load_config(data, environ={var: "docs-test-dummy" for var in variables})
    if block.marker != "fragment":
        # A whole config a reader may copy: `fallback-mw check` must not warn about it.
        warnings = [
            warning
            for route in config.routes
            for warning in route_warnings(route, config.upstreams, config.gateway.deadline_ms)
        ]
        assert not warnings, f"{block.name}: fallback-mw check warns: {warnings}"


@dataclass
class Sandbox:
    """Where python and sh blocks run: a directory with a gateway.toml pointed at the
    example's mock upstreams, and the environment that config needs."""

    directory: Path
    example: Example
    env: dict[str, str]


def run_python(block: Block, sandbox: Sandbox) -> subprocess.CompletedProcess[str]:
    code = block.text.replace(DOCUMENTED_ADDRESS, sandbox.example.url.removeprefix("http://"))
    env = dict(sandbox.env)
    if block.marker == "django":
        env["DJANGO_SETTINGS_MODULE"] = "docs_settings"
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        cwd=sandbox.directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def run_shell(block: Block, sandbox: Sandbox) -> subprocess.CompletedProcess[str]:
    script = block.text.replace(DOCUMENTED_ADDRESS, sandbox.example.url.removeprefix("http://"))
    env = {**sandbox.env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=sandbox.directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def accidental_redirects(script: str) -> list[str]:
    """The words of a shell script where an unquoted `<` or `>` sits inside an argument:
    `--predict alert:X<=60s` reads a file named `=60s` and never runs the command. A
    redirect meant as one follows a blank, a file descriptor's digit, `&` or another
    redirect character."""
    found: list[str] = []
    quote = ""
    escaped = False
    for index, char in enumerate(script):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or script[index - 1].isspace()):
            quote = "\n"  # a comment, to the end of its line
        elif char in "<>" and index and script[index - 1] not in " \t\n&<>0123456789":
            start = max(script.rfind(" ", 0, index), script.rfind("\n", 0, index)) + 1
            found.append(script[start:].split(None, 1)[0])
    return found


def check_block(block: Block, sandbox: Sandbox | None) -> None:
    """Raise AssertionError when the block does not hold; pytest.skip when it says why it
    is not run."""
    where = block.name
    if block.lang in SHELL:
        # Checked whether or not the block runs here: a reader copies it.
        redirects = accidental_redirects(block.text)
        assert not redirects, (
            f"{where}: quote these words, the shell reads <, > as a redirect: {redirects}"
        )
    fixed = SKIPPED_HERE.get((block.path.relative_to(ROOT).as_posix(), block.text))
    if fixed:
        pytest.skip(f"{where}: {fixed}")
    if block.marker.startswith("skip:"):
        reason = block.marker.removeprefix("skip:").strip()
        assert reason, f"{where}: 'skip:' needs a reason"
        pytest.skip(f"{where}: {reason}")
    if block.lang in NOT_RUN:
        return
    if block.lang == "toml":
        check_toml(block)
    elif block.lang in ("yaml", "yml"):
        yaml.safe_load(block.text)
    elif block.lang == "json":
        json.loads(block.text)
    elif block.lang == "python":
        assert sandbox is not None
        result = run_python(block, sandbox)
        assert result.returncode == 0, f"{where} failed:\n{result.stdout}\n{result.stderr}"
    elif block.lang in SHELL:
        assert block.marker == "run", (
            f"{where}: a shell block needs <!-- docs-test: run --> (safe to run here) or "
            "<!-- docs-test: skip: REASON -->"
        )
        assert sandbox is not None
        result = run_shell(block, sandbox)
        assert result.returncode == 0, f"{where} failed:\n{result.stdout}\n{result.stderr}"
    elif not block.lang:
        raise AssertionError(
            f"{where}: untagged code block: tag it (text for output or a synopsis, sh for "
            "commands, toml, python, ...)"
        )
    else:
        raise AssertionError(f"{where}: no check for language {block.lang!r}")


# --- the sandboxes ----------------------------------------------------------------------

DJANGO_SETTINGS = """
SECRET_KEY = "docs-test"
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "docs_settings"
INSTALLED_APPS: list = []
MIDDLEWARE = ["fallback_mw.django.GatewayMiddleware"]
FALLBACK_MW = {"config": "gateway.toml"}
urlpatterns: list = []
"""


def _example_for(block: Block) -> str:
    # A block in examples/<name>/README.md runs against that example; the rest against
    # the FastAPI example (which serves the same routes and upstreams).
    parts = block.path.relative_to(ROOT).parts
    return parts[1] if parts[0] == "examples" else "fastapi_app"


@pytest.fixture(scope="module")
def sandboxes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Sandbox]]:
    started: dict[str, Sandbox] = {}
    with ExitStack() as stack:

        def get(name: str) -> Sandbox:
            if name not in started:
                example = stack.enter_context(running_example(name))
                directory = tmp_path_factory.mktemp(f"docs-{name}")
                # The example's config with a store, so the admin verbs have one to act on.
                template = (ROOT / "examples" / name / "gateway.toml").read_text()
                template = template.replace(
                    "[gateway]\n", '[gateway]\nstore = "sqlite:///docs.db"\n', 1
                )
                (directory / "gateway.toml").write_text(
                    template.replace("http://127.0.0.1:9001", example.primary).replace(
                        "http://127.0.0.1:9002", example.backup
                    )
                )
                (directory / "docs_settings.py").write_text(DJANGO_SETTINGS)
                env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
                env.update(PRIMARY_API_KEY="docs-primary", BACKUP_API_KEY="docs-backup")
                started[name] = Sandbox(directory=directory, example=example, env=env)
            return started[name]

        yield _Lazy(get)  # type: ignore[misc]


class _Lazy(dict[str, Sandbox]):
    def __init__(self, get: Any) -> None:
        super().__init__()
        self._get = get

    def __missing__(self, name: str) -> Sandbox:
        sandbox: Sandbox = self._get(name)
        return sandbox


# --- the tests ----------------------------------------------------------------------------


def test_every_document_is_covered() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/llm.md", "examples/fastapi_app/README.md"} <= names
    assert ALL_BLOCKS, "no code blocks found"


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=lambda b: b.name)
def test_code_block(block: Block, request: pytest.FixtureRequest) -> None:
    if (block.path.relative_to(ROOT).as_posix(), block.text) in SKIPPED_HERE:
        pytest.skip(
            f"{block.name}: {SKIPPED_HERE[(block.path.relative_to(ROOT).as_posix(), block.text)]}"
        )
    needs_sandbox = block.lang == "python" or (block.lang in SHELL and block.marker == "run")
    sandbox = None
    if needs_sandbox and not block.marker.startswith("skip:"):
        sandbox = request.getfixturevalue("sandboxes")[_example_for(block)]
    check_block(block, sandbox)


BROKEN = """
<!-- docs-test: fragment -->
```toml
[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retry = 1
```

```python
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
print(client.chat.completions.create(model="gpt-4o-mini", messages=[]).choices[0].message.contents)
```

```
fallback-mw serve --config gateway.toml
```

```sh
fallback-mw serve --config gateway.toml
```

<!-- docs-test: skip: a game day -->
```sh
fallback-mw gameday --route chat --predict alert:FallbackMwBreakerOpen<=60s 2>&1 >/dev/null
```
"""


def test_the_checker_fails_on_broken_snippets(sandboxes: dict[str, Sandbox]) -> None:
    # The negative control: a misspelt key, a wrong attribute, an untagged block, a shell
    # block that says neither run nor skip and one with an argument the shell reads as a
    # redirect each fail the check.
    blocks = parse_blocks(ROOT / "docs" / "broken.md", BROKEN)
    assert [b.lang for b in blocks] == ["toml", "python", "", "sh", "sh"]
    failures = []
    for block in blocks:
        try:
            check_block(block, sandboxes["fastapi_app"])
        except Exception as exc:
            failures.append(str(exc))
    assert len(failures) == 5, failures
    assert "unknown key" in failures[0] and "routes['chat'].retry" in failures[0]
    assert "has no attribute 'contents'" in failures[1]
    assert "untagged code block" in failures[2]
    assert "docs-test: run" in failures[3]
    # Skipped or not, a shell block must not redirect where a reader meant an argument.
    assert failures[4].endswith("['alert:FallbackMwBreakerOpen<=60s']"), failures[4]


def test_the_incidents_sample_shows_request_ids_as_the_cli_prints_them() -> None:
    # docs/budgets.md's `usage --incidents` sample showed 16-digit request ids; the CLI
    # prints the 32 hex digits of every request's id, which a reader greps the log for.
    from fallback_mw.request.context import new_request_id

    budgets = ROOT / "docs" / "budgets.md"
    (sample,) = [
        block
        for block in parse_blocks(budgets)
        if block.lang == "text" and "--incidents" in block.text and "REQUEST" in block.text
    ]
    header, *rows = [line for line in sample.text.splitlines() if not line.startswith("$")]
    assert header.split()[1] == "REQUEST"
    ids = [row.split()[1] for row in rows]
    assert ids and all(re.fullmatch(r"[0-9a-f]+", i) for i in ids), ids
    assert {len(i) for i in ids} == {len(new_request_id())}, ids
    # The columns line up as the CLI pads them: each header starts where its values do.
    starts = [header.index(name) for name in ("ROUTE", "TENANT", "INCIDENT")]
    for row in rows:
        assert [row[start - 2 : start] for start in starts] == ["  "] * 3, row


def test_every_uvicorn_command_an_example_gives_keeps_query_strings_out_of_its_log() -> None:
    # The examples sent readers to real providers with `uvicorn app:app`: uvicorn's access
    # log then wrote every request's query string (a `?key=` credential included), which
    # the gateway itself never records and `serve` turns off (docs/telemetry.md).
    commands = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in sorted((ROOT / "examples").rglob("*"))
        if path.suffix in (".md", ".py")
        for match in re.finditer(r"`?uvicorn [\w.]+:\w+[^`\n]*", path.read_text(encoding="utf-8"))
        if "--no-access-log" not in match.group(0)
    ]
    assert not commands, commands


def test_the_request_log_line_sample_has_the_fields_a_real_failover_line_has(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # docs/telemetry.md showed a failover (attempts=2, chosen=backup) as a line ending in
    # duration_ms; the gateway's own line for it goes on with `failures=primary:503`, the
    # field that says why it failed over: a reader grepping for what the sample shows must
    # find it in the real line.
    import asyncio
    import logging

    from tests.helpers import gateway_client
    from tests.upstreams import status_handler, upstream

    (sample,) = [
        block.text.strip()
        for block in parse_blocks(ROOT / "docs" / "telemetry.md")
        if block.lang == "text" and block.text.startswith("gateway request ")
    ]

    async def failover() -> None:
        async with (
            upstream(status_handler(503)) as primary,
            upstream(status_handler(200)) as backup,
        ):
            conf = {
                "upstreams": {"primary": {"url": primary.url}, "backup": {"url": backup.url}},
                "routes": [
                    {"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}
                ],
            }
            async with gateway_client(conf) as client:
                assert (await client.get("/v1/models")).status_code == 200

    with caplog.at_level(logging.INFO, logger="fallback_mw.request"):
        asyncio.run(failover())
    (line,) = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.request"]

    def fields(text: str) -> dict[str, str]:
        return dict(word.split("=", 1) for word in text.split() if "=" in word)

    shown, real = fields(sample), fields(line)
    assert list(shown) == list(real), (sample, line)
    assert {k: v for k, v in shown.items() if k != "duration_ms"} == {
        k: v for k, v in real.items() if k != "duration_ms"
    }


def test_the_incidents_sample_lists_its_rows_in_the_order_the_cli_prints_them() -> None:
    # `usage` prints the records oldest first (the newest --limit, then in time order, as
    # a log reads); the docs/budgets.md samples showed the newest first.
    budgets = ROOT / "docs" / "budgets.md"
    samples = [
        block
        for block in parse_blocks(budgets)
        if block.lang == "text" and block.text.startswith("$ fallback-mw usage")
    ]
    assert samples
    for sample in samples:
        times = [line.split()[0] for line in sample.text.splitlines()[2:] if line.strip()]
        assert times == sorted(times), (sample.name, times)
