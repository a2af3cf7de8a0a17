"""Upstream URLs as an attacker or a careless platform team writes them: in the config
file, through the Python API and through the route store (`routes add`)."""

from __future__ import annotations

from typing import Any

import pytest

from fallback_mw.config import ConfigError, load_config
from fallback_mw.store.routes import make_upstream


def _conf(upstream: dict[str, Any]) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1", "proxy.test"]},
        "upstreams": {"u": upstream},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["u"]}],
    }


# The caller's path is appended to the upstream URL: `http://h/?` sent `/v1/chat?x=1` as
# the query of `/`, `http://h/#` dropped path and query; aiohttp failed every request to
# `http://:@h` (an empty Basic credential beside the injected one).
EMPTY_PARTS = [
    "http://127.0.0.1:9000/?",
    "http://127.0.0.1:9000?",
    "http://127.0.0.1:9000/#",
    "http://127.0.0.1:9000/v1?#",
    "http://@127.0.0.1:9000",
    "http://:@127.0.0.1:9000",
    "http://u:@127.0.0.1:9000",
]


@pytest.mark.parametrize("url", EMPTY_PARTS)
def test_an_upstream_url_with_an_empty_userinfo_query_or_fragment_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match=r"upstreams\.u\.url: .*(credentials|query)"):
        load_config(_conf({"url": url}), environ={})
    with pytest.raises(ConfigError, match=r"credentials|query"):
        make_upstream(url, None, None, "route 'r', --upstream")


@pytest.mark.parametrize(
    "proxy", ["http://proxy.test:3128?", "http://proxy.test:3128/#", "http://:@proxy.test:3128"]
)
def test_a_proxy_url_with_an_empty_userinfo_query_or_fragment_is_refused(proxy: str) -> None:
    with pytest.raises(ConfigError, match=r"upstreams\.u\.proxy"):
        load_config(_conf({"url": "http://127.0.0.1:9000", "proxy": proxy}), environ={})
