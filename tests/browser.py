"""Headless Chromium (Debian's `chromium`, installed by scripts/chromium.sh) for the tests
that open the HTML report pages of `eval` and `gameday`. Outside CI a missing browser skips
those tests; under CI=true it fails them.

`layout(page)` loads a copy of the page with one probe script appended; the script measures
what the browser laid out (each SVG mark's box) and writes it into the DOM as JSON, which
`--dump-dom` returns. So the test reads what was rendered, not the file it wrote."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import IN_CI

_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
    "--disable-extensions",
)

# For every element of the page: the tag, its classes and data-*, and its laid-out box.
_PROBE = """
<script>
(() => {
  const marks = [];
  for (const el of document.querySelectorAll("svg, svg *, [id]")) {
    const box = el.getBoundingClientRect();
    marks.push({tag: el.tagName.toLowerCase(), cls: el.getAttribute("class") || "",
                id: el.id || "", data: Object.assign({}, el.dataset || {}),
                w: box.width, h: box.height, x: box.x, y: box.y});
  }
  const requests = performance.getEntriesByType("resource").map(e => e.name);
  const out = document.createElement("pre");
  out.id = "layout-probe";
  out.textContent = JSON.stringify({marks, requests,
                                    title: document.title,
                                    text: document.body.innerText});
  document.body.appendChild(out);
})();
</script>
"""


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    message = "chromium not found (Debian package `chromium`; scripts/test.sh installs it)"
    if IN_CI:
        pytest.fail(message + " (CI=true: a missing browser is a failure)")
    pytest.skip(message)


def _run(args: list[str], profile: Path) -> str:
    result = subprocess.run(
        [chromium(), *_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def layout(page: Path, workdir: Path) -> dict[str, Any]:
    """The page as Chromium laid it out: {marks: [...], requests: [...], title, text}."""
    probed = workdir / ("probed-" + page.name)
    html = page.read_text()
    assert "</body>" in html
    probed.write_text(html.replace("</body>", _PROBE + "</body>", 1))
    dom = _run(["--dump-dom", probed.as_uri()], workdir / "chromium-profile")
    start = dom.index('<pre id="layout-probe">') + len('<pre id="layout-probe">')
    end = dom.index("</pre>", start)
    raw = dom[start:end].replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"')
    data: dict[str, Any] = json.loads(raw.replace("&amp;", "&"))
    return data


def dump_dom(url: str, workdir: Path, *, budget_ms: int = 5000) -> str:
    """The DOM of the page at `url` once its scripts ran (`--virtual-time-budget`: the
    page's fetches and timers settle first). Blocking: run it in a thread beside servers on
    this event loop."""
    return _run([f"--virtual-time-budget={budget_ms}", "--dump-dom", url], workdir / "profile")


def screenshot(page: Path, png: Path, workdir: Path, *, size: str = "1000,1200") -> None:
    _run(
        [f"--window-size={size}", "--hide-scrollbars", f"--screenshot={png}", page.as_uri()],
        workdir / "chromium-profile",
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def visible(marks: list[dict[str, Any]], *, tag: str, cls: str = "") -> list[dict[str, Any]]:
    """Marks of `tag` (with class `cls`) that have a laid-out box of non-zero size."""
    return [
        m
        for m in marks
        if m["tag"] == tag and (not cls or cls in m["cls"].split()) and (m["w"] > 0 or m["h"] > 0)
    ]


# For each element `selector` matches: its text, and where the browser drew each character
# (its x, in the order the text holds them). An SVG <text> says it itself; any other element
# through a Range over each character of its text nodes.
_READING_ORDER = """
<script>
(() => {
  const found = [];
  for (const el of document.querySelectorAll(SELECTOR)) {
    const xs = [];
    if (typeof el.getNumberOfChars === "function") {
      for (let i = 0; i < el.getNumberOfChars(); i++) xs.push(el.getStartPositionOfChar(i).x);
    } else {
      const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
      for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        for (let i = 0; i < node.length; i++) {
          const range = document.createRange();
          range.setStart(node, i);
          range.setEnd(node, i + 1);
          xs.push(range.getBoundingClientRect().x);
        }
      }
    }
    found.push({text: el.textContent, x: xs.map(x => Math.round(x * 10) / 10)});
  }
  const out = document.createElement("pre");
  out.id = "reading-probe";
  out.textContent = JSON.stringify(found);
  document.body.appendChild(out);
})();
</script>
"""


def reading_order(page: Path, workdir: Path, selector: str) -> list[dict[str, Any]]:
    """[{text, x: [...]}] for each element `selector` matches, as Chromium drew it: text
    that reads left to right has its x growing (a bidi override in it reverses them)."""
    probed = workdir / ("reading-" + page.name)
    html = page.read_text(encoding="utf-8")
    assert "</body>" in html
    script = _READING_ORDER.replace("SELECTOR", json.dumps(selector))
    probed.write_text(html.replace("</body>", script + "</body>", 1), encoding="utf-8")
    dom = _run(["--dump-dom", probed.as_uri()], workdir / "chromium-profile")
    start = dom.index('<pre id="reading-probe">') + len('<pre id="reading-probe">')
    raw = dom[start : dom.index("</pre>", start)]
    for escaped, char in (("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&amp;", "&")):
        raw = raw.replace(escaped, char)
    found: list[dict[str, Any]] = json.loads(raw)
    return found
