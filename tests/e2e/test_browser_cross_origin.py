"""A page in a real browser (headless Chromium) as the caller: on another origin, it calls
the gateway with a JSON POST (so a preflight first). The upstream allows any origin, as
providers do. Where the gateway injected the operator's key, the browser must not let the
page read the answer (docs/security.md); an upstream without a key is relayed as it is."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from aiohttp import web

from fallback_mw import Gateway
from tests.browser import chromium, dump_dom
from tests.hostile.test_cross_origin import SECRET, permissive
from tests.upstreams import host_app, serve_asgi, upstream

PAGE = """<html><body><pre id="out">pending</pre><script>
(async () => {
  const lines = [];
  for (const route of ["keyed", "keyless"]) {
    try {
      const answer = await fetch("%(gateway)s/" + route + "/v1/chat/completions",
        {method: "POST", headers: {"content-type": "application/json"}, body: "{}"});
      lines.push(route + " read " + answer.status);
    } catch (error) {
      lines.push(route + " refused");
    }
  }
  document.getElementById("out").textContent = lines.join(";");
})();
</script></body></html>"""


@pytest.mark.anyio
async def test_a_page_on_another_origin_cannot_read_an_answer_bought_with_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chromium()  # skipped (failed under CI) without a browser
    monkeypatch.setenv("OPERATOR_KEY", SECRET)
    async with upstream(permissive) as keyed, upstream(permissive) as keyless:
        conf = {
            "upstreams": {
                "keyed": {"url": keyed.url, "auth_env": "OPERATOR_KEY"},
                "keyless": {"url": keyless.url},
            },
            "routes": [
                {"id": "keyed", "prefix": "/keyed/", "plan": ["keyed"]},
                {"id": "keyless", "prefix": "/keyless/", "plan": ["keyless"]},
            ],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base:
                html = PAGE % {"gateway": base}

                async def page(request: web.Request) -> web.StreamResponse:
                    return web.Response(text=html, content_type="text/html")

                async with upstream(page) as site:  # another origin: another port
                    dom = await anyio.to_thread.run_sync(
                        dump_dom, f"{site.url}/index.html", tmp_path
                    )
        finally:
            await gateway.aclose()
    start = dom.index('<pre id="out">') + len('<pre id="out">')
    outcome = dom[start : dom.index("</pre>", start)]
    assert outcome == "keyed refused;keyless read 200", dom[:2000]
    # The browser asked first (the preflight, answered without the upstream's permission)
    # and so never sent the POST with the key; the keyless upstream got both.
    assert [r.method for r in keyed.received] == ["OPTIONS"]
    assert [r.method for r in keyless.received] == ["OPTIONS", "POST"]
