"""Address spellings an attacker (or a careless entry) uses to get a metadata or loopback
literal past the load-time checks: a dotted quad with a trailing dot is the address to the
WHATWG URL parser and curl, a name to getaddrinfo."""

from __future__ import annotations

from typing import Any

import pytest

from fallback_mw.config import ConfigError, load_config


def _conf(allow_hosts: list[str], url: str) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": allow_hosts},
        "upstreams": {"u": {"url": url}},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["u"]}],
    }


@pytest.mark.parametrize(
    "allow_hosts", [["169.254.169.254."], ["0.0.0.0/0"], ["127.0.0.1", "localhost"]]
)
@pytest.mark.parametrize("url", ["http://169.254.169.254.", "http://100.100.100.200.:80/v1"])
def test_a_metadata_literal_with_a_trailing_dot_is_refused_whatever_the_allowlist(
    allow_hosts: list[str], url: str
) -> None:
    """`allow_hosts = ["169.254.169.254."]` (a name to the allowlist) admitted
    `url = "http://169.254.169.254."` at load: read as a name, not as the metadata
    address SPEC §3 refuses whatever the allowlist says."""
    with pytest.raises(ConfigError) as caught:
        load_config(_conf(allow_hosts, url), environ={})
    message = str(caught.value)
    assert "link-local / metadata address" in message or (
        "gateway.allow_hosts" in message and "trailing dot" in message
    ), message


@pytest.mark.parametrize("allow_hosts", [["127.0.0.1"], ["127.0.0.1."], ["0.0.0.0/0"]])
def test_a_dotted_quad_with_a_trailing_dot_is_refused_as_a_spelling(
    allow_hosts: list[str],
) -> None:
    """Neither engine can send to it (aiohttp refuses the URL, httpx looks it up as a
    name): it is refused at load with what to write instead, in the allowlist too."""
    with pytest.raises(ConfigError) as caught:
        load_config(_conf(allow_hosts, "http://127.0.0.1.:9001"), environ={})
    message = str(caught.value)
    assert "trailing dot" in message and "four decimal numbers" in message, message
    assert "\n" not in message
