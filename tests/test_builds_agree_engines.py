"""The shipped engines built from Python (`make_client`, `AiohttpClient(...)`,
`HttpxClient(...)`) take the same options in both builds. Compiled, the aiohttp engine's
annotations were checked as the call entered it: a `pathlib.Path` CA bundle (which the
configuration's `ca_file` takes) was refused in mypyc's words (`str or None object
expected; got pathlib.PosixPath`) where the pure build and the httpx engine took it, and a
float `max_connections` was refused compiled and taken pure. Now a path is taken as its
text by both engines in both builds, and a count that is no int is refused by both, at
construction, in words naming the option."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fallback_mw.upstream import make_client
from fallback_mw.upstream.aiohttp_engine import AiohttpClient
from fallback_mw.upstream.httpx_engine import HttpxClient

ENGINES = {"AiohttpClient": AiohttpClient, "HttpxClient": HttpxClient}


class Spelled(str):
    """A str subclass (a settings library's own text type)."""


paths = st.sampled_from(["/etc/ssl/certs/ca.pem", "certs/ca bundle.pem", "ca.pem"])
spellings = st.sampled_from([str, Spelled, Path])


@settings(max_examples=30, deadline=None)
@given(path=paths, spelling=spellings, engine=st.sampled_from(sorted(ENGINES)))
def test_a_ca_file_path_is_taken_as_its_text_by_both_engines(
    path: str, spelling: type, engine: str
) -> None:
    client: Any = ENGINES[engine](ca_file=spelling(path))
    assert client._ca_file == (str(Path(path)) if spelling is Path else path)
    assert type(client._ca_file) in (str, Spelled)
    made: Any = make_client("httpx" if engine == "HttpxClient" else "aiohttp", ca_file=Path(path))
    assert made._ca_file == str(Path(path))


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize(
    ("value", "named"),
    [(10.0, "float"), (Decimal(10), "decimal.Decimal"), (True, "bool"), ("10", "str")],
)
def test_a_max_connections_that_is_no_int_is_the_same_clear_error(
    engine: str, value: object, named: str
) -> None:
    with pytest.raises(TypeError) as raised:
        ENGINES[engine](max_connections=value)
    assert str(raised.value) == f"{engine}: max_connections= takes an int, not {named}"


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("value", [b"/etc/ssl/ca.pem", 5])
def test_a_ca_file_that_is_no_path_is_the_same_clear_error(engine: str, value: object) -> None:
    with pytest.raises(TypeError, match=rf"^{engine}: ca_file= takes the path of a PEM file"):
        ENGINES[engine](ca_file=value)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_an_int_max_connections_is_taken(engine: str) -> None:
    class Count(int):
        pass

    for value in (1, 64, Count(8)):
        ENGINES[engine](max_connections=value)
