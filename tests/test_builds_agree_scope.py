"""Differential between the two builds (pure Python and the compiled core, scripts/test.sh's
second pass): an ASGI server may hand the gateway scope values that are legal but not the
shape uvicorn happens to use, and a Python host may write its own engine. The same request
must get the same specified answer in either build. Compiled, every annotation is checked
at run time (`tuple[bytes, bytes] object expected; got list`): a request the pure build
forwarded was a bare 500 compiled. These properties run unchanged in both passes; each
asserts the specified behaviour, so a difference between the builds fails one of them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fallback_mw import Gateway
from fallback_mw.upstream import UpstreamRequest
from fallback_mw.upstream.base import NoChunks

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONFIG = {
    "gateway": {"allow_hosts": ["up.test"]},
    "upstreams": {"primary": {"url": "http://up.test", "auth_env": "KEY"}},
    "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
}
ENVIRON = {"KEY": "sk-upstream"}


class Answer:
    """An upstream's answer as a host's own engine gives it."""

    def __init__(self, status: int, headers: Any, chunks: list[bytes]) -> None:
        self.status = status
        self.headers = headers
        self._chunks = chunks

    def iter_chunks(self) -> Any:
        return _Chunks(self._chunks) if self._chunks else NoChunks()

    async def aclose(self) -> None:
        return None


class _Chunks:
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = list(chunks)

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        if not self._chunks:
            raise StopAsyncIteration
        return self._chunks.pop(0)


class Engine:
    """A fallback_mw.upstream.UpstreamClient written from the protocol (no head checks of
    its own), recording what it was asked to send."""

    def __init__(self, answer: Callable[[], Answer]) -> None:
        self.answer = answer
        self.sent: list[UpstreamRequest] = []

    async def send(self, request: UpstreamRequest) -> Answer:
        self.sent.append(request)
        return self.answer()

    async def aclose(self) -> None:
        return None


def ok() -> Answer:
    return Answer(200, [(b"content-type", b"text/plain")], [b"hello"])


def scope(headers: Any, **fields: Any) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/v1/models",
        "raw_path": b"/v1/models",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("gw", 80),
        **fields,
    }


async def exchange(
    engine: Engine, asgi_scope: dict[str, Any]
) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request through a Gateway on `engine`: the status, head and body it answered."""
    gateway = Gateway(lambda s, r, se: None, config=CONFIG, client=engine, environ=ENVIRON)
    sent: list[dict[str, Any]] = []
    answered = asyncio.Event()
    request = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        if request:
            return request.pop()
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered.set()

    try:
        await asyncio.wait_for(gateway(asgi_scope, receive, send), 30)
    finally:
        await gateway.aclose()
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body


class Spelled(bytes):
    """A bytes subclass (a server's own header type)."""


# How a server may hand one header field: ASGI's `Iterable[[byte string, byte string]]`, as
# a tuple or a list, its name and value bytes or a bytes subclass.
containers = st.sampled_from([tuple, list])
spellings = st.sampled_from([bytes, Spelled])
names = st.sampled_from([b"x-probe-a", b"x-probe-b", b"accept", b"user-agent"])
values = st.binary(min_size=1, max_size=12).map(lambda b: bytes(48 + c % 75 for c in b))


@st.composite
def fields(draw: st.DrawFn) -> list[Any]:
    drawn = draw(st.lists(st.tuples(names, values), max_size=6, unique_by=lambda f: f[0]))
    drawn = [(b"host", b"gw"), *drawn, (b"authorization", b"Bearer sk-caller")]
    result = []
    for name, value in drawn:
        container, name_type, value_type = draw(containers), draw(spellings), draw(spellings)
        result.append(container((name_type(name), value_type(value))))
    return result


@SETTINGS
@given(headers=fields(), outer=st.sampled_from([list, tuple]))
def test_every_legal_shape_of_request_headers_is_forwarded_alike(
    headers: list[Any], outer: type
) -> None:
    """Headers as a list of lists (ASGI writes the field as `[name, value]`) were a 500
    compiled (`tuple[union[bytes, bytearray], bytes] object expected; got list`, from the
    resolver's identity pass) where the pure build forwarded them."""
    engine = Engine(ok)
    status, head, body = asyncio.run(exchange(engine, scope(outer(headers))))
    assert (status, body, head[b"x-gateway-provider"]) == (200, b"hello", b"primary")
    [sent] = engine.sent
    forwarded = {name: value for name, value in sent.headers}
    for field in headers:
        name, value = bytes(field[0]).decode(), bytes(field[1]).decode()
        if name.startswith("x-probe-") or name in ("accept", "user-agent"):
            assert forwarded[name] == value, (name, forwarded)
    # The caller's credential is stripped, the upstream's own injected, whatever the shape.
    assert forwarded["authorization"] == "Bearer sk-upstream"


queries = st.sampled_from([b"", b"a=1", b"a=1&key=sk-caller", b"x=%20y&b=2"])


@SETTINGS
@given(query=queries, spelled=st.sampled_from(["bytes", "subclass", "none", "missing"]))
def test_a_query_string_of_none_or_missing_is_no_query_in_both_builds(
    query: bytes, spelled: str
) -> None:
    """`query_string` None (as some adapters pass `raw_path`) was forwarded as no query by
    the pure build and a 500 compiled (`bytes object expected; got None`, the resolver's
    request context). A bytes subclass is its bytes; the caller's `key` is stripped."""
    engine = Engine(ok)
    fields: dict[str, Any] = {
        "bytes": {"query_string": query},
        "subclass": {"query_string": Spelled(query)},
        "none": {"query_string": None},
        "missing": {},
    }[spelled]
    asgi_scope = scope([(b"host", b"gw")], **fields)
    if spelled == "missing":
        del asgi_scope["query_string"]
    status, _, body = asyncio.run(exchange(engine, asgi_scope))
    assert (status, body) == (200, b"hello")
    [sent] = engine.sent
    expected = query.replace(b"&key=sk-caller", b"") if spelled in ("bytes", "subclass") else b""
    url = sent.url.encode()
    assert url == b"http://up.test/v1/models" + (b"?" + expected if expected else b""), url


@SETTINGS
@given(
    outer=st.sampled_from([list, tuple]),
    container=containers,
    spelling=spellings,
    status=st.sampled_from([200, HTTPStatus.OK, 201, HTTPStatus.CREATED]),
)
def test_a_host_engines_head_in_any_sequence_of_pairs_is_relayed_alike(
    outer: type, container: type, spelling: type, status: int
) -> None:
    """A host's own engine (no `checks_response_heads`) whose answer's fields came as lists,
    in a tuple, or as a bytes subclass: relayed by the pure build, a bare 500 compiled
    (`tuple[bytes, bytes] object expected; got list`, the walk's head check). The walk now
    reads its head as the checked fields, the status as an int (HTTPStatus included)."""
    fields = [(b"Content-Type", b"text/plain"), (b"x-upstream", b"one")]
    spelled = outer([container((spelling(n), spelling(v))) for n, v in fields])
    engine = Engine(lambda: Answer(status, spelled, [b"hello"]))
    answered, head, body = asyncio.run(exchange(engine, scope([(b"host", b"gw")])))
    assert (answered, body) == (int(status), b"hello")
    assert type(answered) is int
    assert head[b"content-type"] == b"text/plain" and head[b"x-upstream"] == b"one", head


@pytest.mark.parametrize(
    ("status", "headers", "named"),
    [
        (200.0, [(b"content-type", b"text/plain")], "status"),
        ("200", [(b"content-type", b"text/plain")], "status"),
        (200, [("content-type", "text/plain")], "headers"),
        (200, {b"content-type": b"text/plain"}, "headers"),
    ],
)
def test_a_host_engines_head_of_the_wrong_type_is_the_same_clear_error(
    status: Any, headers: Any, named: str
) -> None:
    """A float or text status, text fields or a dict: the pure build relayed `200.0` to
    the server or failed on `<=` between int and str, the compiled core said `int object
    expected; got float`. Both now raise one TypeError naming the engine's answer."""
    engine = Engine(lambda: Answer(status, headers, [b"hello"]))
    with pytest.raises(TypeError) as raised:
        asyncio.run(exchange(engine, scope([(b"host", b"gw")])))
    message = str(raised.value)
    assert message.startswith(f"client=: the engine's answer has {named} "), message


MISSING = object()
# Each optional or loosely typed scope key, as servers and adapters hand it (ASGI 3: `client`
# and `server` an iterable pair or None, `raw_path` and `root_path` optional, the
# `extensions` and `state` dicts of servers that send them, HTTP/2 and /3 as "2" and "3").
scope_fields = st.fixed_dictionaries(
    {
        "client": st.sampled_from([("127.0.0.1", 1), ["10.0.0.1", 2], None, MISSING]),
        "server": st.sampled_from([("gw", 80), ["gw", 443], ["/tmp/gw.sock", None], None]),
        "raw_path": st.sampled_from([b"/v1/models", Spelled(b"/v1/models"), None, MISSING]),
        "root_path": st.sampled_from(["", MISSING]),
        "http_version": st.sampled_from(["1.0", "1.1", "2", "3", MISSING]),
        "scheme": st.sampled_from(["http", "https", MISSING]),
        "extensions": st.sampled_from(
            [MISSING, {}, {"http.response.trailers": {}, "http.response.pathsend": {}}]
        ),
        "state": st.sampled_from([MISSING, {}, {"app": "state"}]),
        "asgi": st.sampled_from([{"version": "3.0"}, {"version": "3.0", "spec_version": "2.4"}]),
    }
)


@SETTINGS
@given(fields=scope_fields)
def test_every_legal_scope_is_forwarded_alike(fields: dict[str, Any]) -> None:
    """Whatever the optional scope keys hold, the routed request is forwarded once, to the
    path the caller sent, and its answer relayed: the same in both builds."""
    asgi_scope = scope([(b"host", b"gw")])
    for key, value in fields.items():
        if value is MISSING:
            asgi_scope.pop(key, None)
        else:
            asgi_scope[key] = value
    engine = Engine(ok)
    status, head, body = asyncio.run(exchange(engine, asgi_scope))
    assert (status, body, head[b"x-gateway-provider"]) == (200, b"hello", b"primary")
    [sent] = engine.sent
    assert sent.url == "http://up.test/v1/models"
    version = fields["http_version"] if fields["http_version"] is not MISSING else "1.1"
    [via] = [value for name, value in sent.headers if name == "via"]
    assert via.startswith(f"{version} "), via


@pytest.mark.parametrize(
    ("headers", "kind"),
    [
        ({b"content-type": b"text/plain"}, "dict"),
        ([(b"content-type", b"text/plain", b"x")], "list"),
        ([b"content-type: text/plain"], "list"),
        (b"content-type: text/plain", "bytes"),
    ],
)
def test_a_host_engines_headers_that_are_no_pairs_are_named_as_they_are(
    headers: Any, kind: str
) -> None:
    """Headers that are no (name, value) pairs (a dict, triples, whole lines) were said to
    be `headers dict of NoneType`: the None the check put in place of what it could not
    unpack, which the engine never handed. Now they are named as what they are."""
    engine = Engine(lambda: Answer(200, headers, [b"hello"]))
    with pytest.raises(TypeError) as raised:
        asyncio.run(exchange(engine, scope([(b"host", b"gw")])))
    message = str(raised.value)
    assert message.startswith(
        f"client=: the engine's answer has headers {kind}, not (name, value) pairs; "
    ), message
    assert "NoneType" not in message
