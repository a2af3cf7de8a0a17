"""International text in bodies the gateway writes or reads: a model rewrite of a body
written in UTF-16 or under a declared charset, and the usage of an answer whose bytes are
not all UTF-8. Each as the software on the other side reads it."""

from __future__ import annotations

import codecs
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import anyio
import pytest

from fallback_mw import ConfigError, Gateway, load_config
from fallback_mw.cli import main
from tests.helpers import client_for
from tests.hostile.test_usage_reading import FULL_COST, charged_for, sse
from tests.test_budget_guard import gateway_config
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

ENGINES = ["aiohttp", "httpx"]
DOCUMENT = {"model": "caller-model", "messages": [{"role": "user", "content": "Grüße, 日本 ☃"}]}
_CHARSET = re.compile(r";\s*charset\s*=\s*\"?([^;\"]*)", re.IGNORECASE)


def read_as_labelled(body: bytes, content_type: str | None) -> Any:
    """The JSON an upstream reads from this body: by the charset its Content-Type declares
    (Express's body-parser and ASP.NET Core decode by it before parsing), else by what
    the bytes say (RFC 8259's UTF-8, a byte-order mark, UTF-16 / UTF-32 by their zeros)."""
    match = _CHARSET.search(content_type or "")
    if match is None:
        return json.loads(body)
    text = body.decode(codecs.lookup(match[1].strip()).name)
    return json.loads(text.removeprefix("\ufeff"))  # as iconv-lite and .NET skip it


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("written", "content_type"),
    [
        (lambda text: text.encode("utf-16"), "application/json; charset=utf-16"),
        (lambda text: codecs.BOM_UTF16_BE + text.encode("utf-16-be"), "application/json"),
        (lambda text: text.encode("utf-16-le"), "application/json; charset=utf-16le"),
        (lambda text: text.encode("utf-32"), "application/json; charset=utf-32"),
        (lambda text: codecs.BOM_UTF8 + text.encode(), "application/json; charset=utf-8"),
        (lambda text: text.encode(), "application/json"),
        # Escaped by the caller (`\u00fc`), so ASCII: true to its label.
        (lambda text: text.encode(), "application/json; charset=iso-8859-1"),
        (lambda text: text.encode(), "application/json; charset=windows-1252"),
    ],
    ids=[
        "utf16-bom",
        "utf16be-bom-unlabelled",
        "utf16le",
        "utf32",
        "utf8-bom",
        "utf8",
        "latin1",
        "cp1252",
    ],
)
async def test_a_model_rewrite_is_written_as_the_callers_body_was(
    engine: str, written: Any, content_type: str
) -> None:
    # The rewrite went out in UTF-8, whatever the body was written in: under the caller's
    # `charset=utf-16` label the upstream decoded UTF-8 bytes as UTF-16 (garbage, a 400),
    # and `\u00fc` escapes a caller sent under `charset=iso-8859-1` went out as raw UTF-8,
    # which that label reads as "GrÃ¼Ã\x9fe". The rewritten body keeps the caller's
    # encoding and stays true to its label.
    ascii_only = "8859" in content_type or "1252" in content_type
    text = json.dumps(DOCUMENT, ensure_ascii=ascii_only)
    body = written(text)
    assert read_as_labelled(body, content_type) == DOCUMENT  # the caller's body reads right
    async with upstream(status_handler(200, b"{}")) as primary:
        conf = {
            "gateway": {"engine": engine},
            "upstreams": {"primary": {"url": primary.url, "model": "rewritten-model"}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post(
                    "/v1/chat", content=body, headers={"content-type": content_type}
                )
            assert response.status_code == 200, response.text
        finally:
            await gateway.aclose()
    received = primary.received[0]
    label = dict(received.headers)["content-type"]
    assert label == content_type
    assert int(dict(received.headers)["content-length"]) == len(received.body)
    assert read_as_labelled(received.body, label) == {**DOCUMENT, "model": "rewritten-model"}
    if ascii_only:
        assert received.body.isascii()


ANSWER = {
    "model": "gpt-test",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Grüße"}}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 20000},
}


def _written(encoding: str) -> bytes:
    return json.dumps(ANSWER, ensure_ascii=False).encode(encoding)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (_written("latin-1"), "application/json; charset=iso-8859-1"),
        (_written("cp1252"), "application/json"),
        (sse(_written("latin-1"), b"[DONE]"), "text/event-stream"),
        (_written("utf-16"), "application/json; charset=utf-16"),
    ],
    ids=["latin1-labelled", "cp1252-unlabelled", "sse-latin1", "utf16"],
)
async def test_an_answer_with_bytes_that_are_not_utf8_is_charged_its_usage(
    engine: str, body: bytes, content_type: str
) -> None:
    # An answer in a charset other than UTF-8 (or with one stray byte in a string) was
    # settled at the 0.01 hold, while its reader saw 20,000 completion tokens: aiohttp's
    # and requests' `.json()` decode by the declared charset, Go's encoding/json, Node's
    # fetch and openai-node, and a browser's EventSource read such a byte as U+FFFD.
    assert await charged_for(body, content_type, engine) == FULL_COST


BUCHER = "xn--bcher-kva.example"


@pytest.mark.parametrize(
    ("allow_hosts", "url", "where", "spelling"),
    [
        (["Bücher.example"], f"http://{BUCHER}", "gateway.allow_hosts", BUCHER),
        (["bücher.example."], f"http://{BUCHER}", "gateway.allow_hosts", BUCHER),
        (["xn--strae-oqa.de"], "http://straße.de:8080/v1", "upstreams.u.url", "xn--strae-oqa.de"),
        (["日本.example"], "http://127.0.0.1:1", "gateway.allow_hosts", "xn--wgv71a.example"),
    ],
)  # fmt: skip
def test_a_host_written_in_unicode_is_refused_naming_its_xn_spelling(
    allow_hosts: list[str], url: str, where: str, spelling: str
) -> None:
    # An allowlist entry in Unicode was refused as "not a host name", which left the user
    # to guess; the upstream URL's refusal named the xn-- form without giving it. Both
    # now give the spelling (IDNA 2008 / UTS 46, as browsers and curl spell it: `ß` is
    # kept, xn--strae-oqa, not IDNA 2003's `ss`), and the fixed config loads.
    conf: dict[str, Any] = {
        "gateway": {"allow_hosts": allow_hosts},
        "upstreams": {"u": {"url": url}},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["u"]}],
    }
    with pytest.raises(ConfigError, match=re.escape(where)) as refused:
        load_config(conf, environ={})
    assert f"xn-- form, {spelling}" in str(refused.value)
    fixed = {**conf, "gateway": {"allow_hosts": [spelling, "127.0.0.1"]}}
    fixed["upstreams"] = {"u": {"url": url.replace(url.split("/")[2].split(":")[0], spelling)}}
    assert load_config(fixed, environ={}).upstreams["u"].host == spelling


def test_a_proxy_host_written_in_unicode_is_refused_naming_its_xn_spelling() -> None:
    conf: dict[str, Any] = {
        "upstreams": {"u": {"url": "http://127.0.0.1:1", "proxy": "http://прокси.example:3128"}},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["u"]}],
    }
    with pytest.raises(ConfigError, match=r"upstreams\.u\.proxy") as refused:
        load_config(conf, environ={})
    assert "xn-- form, xn--h1adldfi.example" in str(refused.value)


@pytest.mark.parametrize("budget", ["予算 2026", "acme's", "acme"])
async def test_a_budget_refusal_names_a_command_and_a_table_that_work_as_pasted(
    tmp_path: Path, budget: str
) -> None:
    # The 402 said `fallback-mw budgets set --budget 予算 2026 --limit AMOUNT` (or
    # [budgets.予算 2026] limit): pasted, the shell split the id into two arguments
    # and TOML refused the table name. Both are now quoted where they need it.
    store = f"sqlite:///{tmp_path / 'l.db'}"
    async with upstream(status_handler(200, b"{}")) as primary:
        conf = gateway_config({"primary": primary.url}, store=store, limit="0", budget=budget)
        conf["budgets"] = {budget: conf["budgets"]["acme"]}
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                refused = await client.post("/v1/chat", content=b"{}")
                assert refused.status_code == 402, refused.text
                message = refused.json()["error"]["message"]
                command = re.search(r"`(fallback-mw budgets set [^`]*)`", message)
                table = re.search(r"or (\[budgets\.[^\]]*\])", message)
                assert command is not None and table is not None, message
                argv = shlex.split(command[1].replace("AMOUNT", "5"))
                assert argv[argv.index("--budget") + 1] == budget
                assert tomllib.loads(f"{table[1]}\nlimit = 5") == {
                    "budgets": {budget: {"limit": 5}}
                }
                assert await anyio.to_thread.run_sync(main, [*argv[1:], "--store", store]) == 0
        finally:
            await gateway.aclose()
        gateway = Gateway(host_app, config=conf)  # one that reads the budget just set
        try:
            async with client_for(gateway) as client:
                served = await client.post("/v1/chat", content=b"{}")
                assert served.status_code == 200, served.text
        finally:
            await gateway.aclose()


@pytest.mark.parametrize(
    ("written", "meant"),
    [("/v1/caf%C3%A9/", "/v1/café/"), ("/v1/%E6%97%A5%E6%9C%AC/", "/v1/日本/")],
)
async def test_a_percent_encoded_prefix_is_refused_naming_the_prefix_to_write(
    written: str, meant: str
) -> None:
    # A prefix copied from a browser's address bar (`/v1/caf%C3%A9/`) was refused as "must
    # be a plain path without ... percent-encoding", leaving the user to decode it. The
    # refusal names the prefix meant, and that prefix routes the encoded request.
    def conf(prefix: str) -> dict[str, Any]:
        return {
            "upstreams": {"u": {"url": "http://127.0.0.1:1"}},
            "routes": [{"id": "r", "prefix": prefix, "plan": ["u"]}],
        }

    with pytest.raises(ConfigError, match=r"routes\['r'\]\.prefix") as refused:
        load_config(conf(written), environ={})
    assert f"write the characters themselves, {meant!r}" in str(refused.value)
    async with upstream(status_handler(200, b"ok")) as primary:
        routed = conf(meant)
        routed["upstreams"]["u"]["url"] = primary.url
        gateway = Gateway(host_app, config=routed)
        try:
            async with client_for(gateway) as client:
                response = await client.get(written + "x")
        finally:
            await gateway.aclose()
    assert (response.status_code, response.headers.get("x-gateway-route")) == (200, "r")
    assert primary.received[0].path == written + "x"
