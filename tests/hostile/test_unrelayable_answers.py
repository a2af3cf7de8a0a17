"""Upstream answers the relay cannot carry are the upstream's failures (SPEC §12): a status
outside 100-599, a 1xx as the final answer, contradictory framing, a transfer coding other
than chunked. On both engines, on real
sockets: the walk fails over when it may (the backup serves), else the local 502 in JSON;
never an empty reply, a traceback or a stale Content-Length."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from fallback_mw import Gateway
from tests.hostile.test_hostile_upstreams import Behaviour, config, raw_upstream, read_head, run
from tests.upstreams import host_app, serve_asgi, status_handler, upstream

pytestmark = pytest.mark.anyio

ENGINES = ["aiohttp", "httpx"]
FORGED = b"HTTP/1.1 200 OK\r\nx-forged: 1\r\ncontent-length: 6\r\n\r\nforged"

ANSWERS = {
    "status-000": b"HTTP/1.1 000 X\r\ncontent-length: 2\r\n\r\nok",
    "status-099": b"HTTP/1.1 099 X\r\ncontent-length: 2\r\n\r\nok",
    "status-600": b"HTTP/1.1 600 X\r\ncontent-length: 2\r\n\r\nok",
    "http-0.9": b'{"upstream": "bytes-never-quoted"}',
    "final-101": b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
    b"connection: upgrade\r\n\r\n",
    "length-and-chunked": b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n"
    b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "204-with-length": b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\nhello",
    # A 205 has no content either (RFC 9110 §15.3.6): it was relayed with its "hello".
    "205-with-length": b"HTTP/1.1 205 Reset Content\r\ncontent-length: 5\r\n\r\nhello",
    "two-lengths": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!",
    # The same length repeated (RFC 9110 §8.6: a recipient MAY reject it as invalid or MAY
    # take the one value). aiohttp's parser refuses it (failed over); h11 merged it and the
    # httpx engine relayed it as served. Both engines now read it as RFC 9112 §6.3 reads an
    # invalid Content-Length in a response: framing that cannot be trusted, a failover.
    "equal-lengths-in-one-field": b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok",
    "equal-lengths-in-two-fields": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n"
    b"Content-Length: 2\r\n\r\nok",
    "equal-lengths-after-an-interim": b"HTTP/1.1 100 Continue\r\n\r\n"
    b"HTTP/1.1 200 OK\r\ncontent-length: 2,2\r\n\r\nok",
    # 2, spelled in 31 digits: aiohttp read it, uvicorn refused to write it after the
    # commit point (an empty reply, outcome internal_error); h11 refuses over 20 digits.
    "length-31-digits": b"HTTP/1.1 200 OK\r\ncontent-length: " + b"0" * 30 + b"2\r\n\r\nok",
    # More than its Content-Length, in the same read: the httpx engine relayed "ok" as
    # the complete answer (aiohttp's parser refuses it).
    "past-its-length": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nokEXTRA",
    # A whole second answer past the framing, in the same read (a desynced proxy, a
    # smuggled answer): aiohttp's parser queued it as the next message and the engine
    # relayed the first as served, where the httpx engine failed it over.
    "answer-past-its-length": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok" + FORGED,
    "answer-past-a-204": b"HTTP/1.1 204 No Content\r\n\r\n" + FORGED,
    "answer-past-an-interim-and-its-length": b"HTTP/1.1 100 Continue\r\n\r\n"
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok" + FORGED,
    # 7 MB of fields (each within aiohttp's 64 KiB, fewer than its 128): aiohttp relayed
    # the head whole, past what a client reads (h11: 100 KiB), booked as served.
    "head-7mb": b"HTTP/1.1 200 OK\r\n"
    + b"".join(b"x-h%d: %s\r\n" % (n, b"v" * 60_000) for n in range(120))
    + b"content-length: 2\r\n\r\nok",
    # Past aiohttp's bounds (128 fields, 64 KiB a field) but within 100 KiB: aiohttp
    # refused the head (failed over), the httpx engine relayed it as served.
    "129-fields": b"HTTP/1.1 200 OK\r\n"
    + b"".join(b"x-h%d: v\r\n" % n for n in range(128))
    + b"content-length: 2\r\n\r\nok",
    "field-over-64k": b"HTTP/1.1 200 OK\r\nx-big: "
    + b"v" * 66_000
    + b"\r\ncontent-length: 2\r\n\r\nok",
    # Re-framed, the gzip-coded body would reach the client unlabelled (aiohttp relayed it).
    "gzip-chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n"
    b"5\r\nhello\r\n0\r\n\r\n",
    # Field values the engines accept but no ASGI server will write (uvicorn raised after
    # the commit point: an empty reply to the client, no failover).
    "control-in-value": b"HTTP/1.1 200 OK\r\nx-bad: a\x01b\r\ncontent-length: 2\r\n\r\nok",
    "delete-in-value": b"HTTP/1.1 200 OK\r\nx-bad: a\x7fb\r\ncontent-length: 2\r\n\r\nok",
    # Whitespace before the colon (RFC 9112 §5.1: never valid): aiohttp's parser takes it for
    # these two names, framing and all, with the space in the name, which uvicorn (h11 and
    # httptools) refused to write after the commit point (an empty reply booked as served);
    # h11, on the httpx engine, refuses it.
    # A chunked body that breaks its framing in the bytes that came with the head: aiohttp's
    # parser refused it before the head was used (a failover); the httpx engine relayed the
    # head and aborted the body.
    "chunk-size-not-hex": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    b"zz\r\nhello\r\n0\r\n\r\n",
    "chunk-without-crlf": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    b"2\r\nokXY\r\n0\r\n\r\n",
    "second-chunk-size-not-hex": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    b"2\r\nok\r\nXYZ\r\n",
    # Chunk lines ended by a bare LF: aiohttp's parser refused them before the head was
    # used; h11 waits for a CRLF that never ends a size line, so the httpx engine relayed
    # the head and aborted the body.
    "chunk-lines-ended-by-lf": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\nok\n0\n\n",
    "space-before-colon-length": b"HTTP/1.1 200 OK\r\ncontent-length : 2\r\n\r\nok",
    "space-before-colon-coding": b"HTTP/1.1 200 OK\r\ntransfer-encoding : chunked\r\n\r\n"
    b"2\r\nok\r\n0\r\n\r\n",
}


def answer(data: bytes) -> Behaviour:
    async def behaviour(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(data)
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.close()

    return behaviour


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(ANSWERS))
async def test_an_answer_the_relay_cannot_carry_fails_over(name: str, engine: str) -> None:
    result, _, remaining = await run(answer(ANSWERS[name]), engine)
    assert isinstance(result, httpx.Response), result
    assert (result.status_code, result.text) == (200, "backup")
    assert result.headers["x-gateway-attempts"] == "2"
    assert result.headers["content-length"] == "6"
    assert remaining == 0


def good_then(data: bytes) -> Behaviour:
    """A whole answer to the first request on a connection, then `data` to the next one on
    the same connection (kept alive)."""

    async def behaviour(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await read_head(reader)
        writer.write(data)
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.close()

    return behaviour


@pytest.mark.parametrize("engine", ENGINES)
async def test_equal_lengths_on_a_kept_alive_connection_fail_over_on_both_engines(
    engine: str,
) -> None:
    """The httpx engine reads each answer's head as written, the second one on a
    connection too (its record starts afresh with each request), not only the first."""
    async with (
        raw_upstream(good_then(ANSWERS["equal-lengths-in-one-field"])) as (url, accepted),
        upstream(status_handler(200, b"backup")) as backup,
    ):
        gateway = Gateway(host_app, config=config(url, backup.url, engine))
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                first = await client.get("/v1/x")
                second = await client.get("/v1/x")
        finally:
            await gateway.aclose()
    assert (first.status_code, first.text, first.headers["x-gateway-provider"]) == (
        200, "ok", "hostile",
    )  # fmt: skip
    assert (second.status_code, second.text, second.headers["x-gateway-attempts"]) == (
        200, "backup", "2",
    )  # fmt: skip
    assert len(accepted) == 1  # the second answer came on the first connection


async def post_once(behaviour: Behaviour, engine: str) -> httpx.Response:
    """A POST (not replayable): the walk cannot go on after the hostile answer."""
    async with (
        raw_upstream(behaviour) as (url, _),
        upstream(status_handler(200, b"backup")) as backup,
    ):
        gateway = Gateway(host_app, config=config(url, backup.url, engine))
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.post("/v1/x", content=b"{}", timeout=30)
        finally:
            await gateway.aclose()
    return response


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "name", ["status-600", "final-101", "length-and-chunked", "space-before-colon-length"]
)
async def test_without_failover_it_is_the_local_502(name: str, engine: str) -> None:
    response = await post_once(answer(ANSWERS[name]), engine)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_failed"
    assert response.headers["x-gateway-attempts"] == "1"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("name", "cause"),
    [
        ("status-600", "the upstream status cannot be relayed"),
        ("control-in-value", "a response field cannot be relayed"),
        ("answer-past-its-length", "the answer breaks its own framing"),
        ("http-0.9", "the engine's HTTP/1.1 parser refused the upstream's answer"),
    ],
)
async def test_the_local_502_names_why_the_answer_could_not_be_relayed(
    name: str, cause: str, engine: str
) -> None:
    # It said only "last failure: transport", as for a reset: the upstream did answer, and
    # nothing told the operator that the answer was what the gateway refused. The cause is
    # the gateway's own phrase, never the upstream's bytes or the engine parser's text.
    response = await post_once(answer(ANSWERS[name]), engine)
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert cause in message, message
    for quoted in (b"bytes-never-quoted", b"forged", b"X\r", b"\x01"):
        assert quoted.decode() not in message


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_204_or_304_is_relayed_without_a_length(engine: str) -> None:
    for data, status in (
        (b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n", 204),
        (b'HTTP/1.1 304 Not Modified\r\ncontent-length: 5\r\netag: "a"\r\n\r\n', 304),
        # RFC 9112 §6.1: a 304 may say the transfer coding its GET would have had.
        (b'HTTP/1.1 304 Not Modified\r\ntransfer-encoding: chunked\r\netag: "a"\r\n\r\n', 304),
    ):
        result, accepted, _ = await run(answer(data), engine)
        assert isinstance(result, httpx.Response), result
        assert result.status_code == status
        assert "content-length" not in result.headers
        assert result.content == b""
        assert accepted == 1


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_304_naming_its_transfer_coding_is_not_a_failure(engine: str) -> None:
    """RFC 9112 §6.1 lets a 304 carry the `Transfer-Encoding` its GET would have had (and
    no body): read as contradictory framing, each revalidation of a cached answer was the
    upstream's failure, a 502 (or a failover to another upstream's full answer) that
    marked its breaker. It is relayed as a 304, and the connection serves the next request."""
    answers = [
        b'HTTP/1.1 304 Not Modified\r\ntransfer-encoding: chunked\r\netag: "a"\r\n\r\n',
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    ]

    async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for data in answers:
            await read_head(reader)
            writer.write(data)
            await writer.drain()
        await asyncio.sleep(1)

    async with raw_upstream(keep_alive) as (url, accepted), upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=config(url, b.url, engine))
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                revalidated = await client.get("/v1/x", headers={"if-none-match": '"a"'})
                fresh = await client.get("/v1/x")
        finally:
            await gateway.aclose()
    assert revalidated.status_code == 304, revalidated.text
    assert revalidated.headers["etag"] == '"a"'
    assert "transfer-encoding" not in revalidated.headers and revalidated.content == b""
    assert (fresh.status_code, fresh.text) == (200, "ok")
    assert accepted == [1] and b.count == 0  # one connection, never failed over


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_205_is_relayed_without_content(engine: str) -> None:
    # RFC 9110 §15.3.6: a 205 has no content. One sent with a length is refused as a 204
    # with one is (above); one whose body is chunked (RFC 7231 let a zero-length chunked
    # body say "no content") or runs to the connection's close was relayed with what the
    # upstream put in it: the caller now gets the 205 with no content, as for a 204.
    for data in (
        b"HTTP/1.1 205 Reset Content\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 205 Reset Content\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 205 Reset Content\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 205 Reset Content\r\nconnection: close\r\n\r\nhello",
    ):
        result, accepted, _ = await run(answer(data), engine)
        assert isinstance(result, httpx.Response), result
        assert result.status_code == 205
        assert result.content == b"", data
        assert result.headers.get("content-length", "0") == "0"
        assert result.headers["x-gateway-attempts"] == "1"
        assert accepted == 1


def test_the_relayed_framing_is_the_gateways_own() -> None:
    """The response header filter never passes a length that could be stale."""
    from fallback_mw.security.answers import forwardable_response_headers as relayed

    chunked = [(b"Content-Length", b"100"), (b"Transfer-Encoding", b"chunked"), (b"x-a", b"1")]
    assert relayed(chunked) == [(b"x-a", b"1")]
    assert relayed([(b"content-length", b"5")], status=204) == []
    assert relayed([(b"content-length", b"5")], status=304) == []
    assert relayed([(b"Content-Length", b"5")]) == [(b"content-length", b"5")]


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_head_of_128_fields_is_relayed_on_either_engine(engine: str) -> None:
    fields = b"".join(b"x-h%d: v\r\n" % n for n in range(127))
    head = b"HTTP/1.1 200 OK\r\n" + fields + b"content-length: 2\r\n\r\nok"
    result, _, remaining = await run(answer(head), engine)
    assert isinstance(result, httpx.Response), result
    assert (result.status_code, result.text) == (200, "ok")
    assert result.headers["x-h126"] == "v"
    assert remaining == 0


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_large_response_field_is_relayed_on_either_engine(engine: str) -> None:
    # A 12 KB field (a long Content-Security-Policy, Link or Set-Cookie): httpx reads a
    # head up to 100 KiB, and aiohttp's own default (8190 bytes a field) made the same
    # answer a protocol failure, failed over and booked to the upstream's breaker.
    big = b"a" * 12_000
    head = b"HTTP/1.1 200 OK\r\nx-big: " + big + b"\r\ncontent-length: 2\r\n\r\nok"
    result, _, remaining = await run(answer(head), engine)
    assert isinstance(result, httpx.Response), result
    assert (result.status_code, result.text) == (200, "ok")
    assert result.headers["x-big"] == big.decode()
    assert result.headers["x-gateway-attempts"] == "1"
    assert remaining == 0


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_declared_length_of_19_digits_is_over_the_limit_before_the_commit(
    engine: str,
) -> None:
    # Past 18 digits the length read as "not declared": the head was relayed (200, a
    # 10**19-byte promise) and the body cut short at max_response_body, outcome aborted.
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 9999999999999999999\r\n\r\nok"
    result, accepted, remaining = await run(answer(head), engine)
    assert isinstance(result, httpx.Response), result
    assert result.status_code == 502
    assert result.json()["error"]["code"] == "response_too_large"
    assert accepted == 1
    assert remaining == 0


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_blank_line_after_an_answer_is_not_past_its_framing(engine: str) -> None:
    # Lenient servers end an answer with an extra CRLF; parsers skip it (RFC 9112 §2.2).
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok\r\n"
    result, accepted, _ = await run(answer(head), engine)
    assert isinstance(result, httpx.Response), result
    assert (result.status_code, result.text) == (200, "ok")
    assert result.headers["x-gateway-attempts"] == "1"
    assert accepted == 1


@pytest.mark.parametrize(
    ("data", "broken"),
    [
        (b"", False),
        (b"5", False),  # a size line not ended yet
        (b"5;name=value\r\nhel", False),  # a chunk not all here yet
        (b"5\r\nhello\r", False),
        (b"5\t\r\nhello\r\n0\r\nx-trailer: 1\r\n\r\n", False),
        (b"A\r\n0123456789\r\n0\r\n\r\n", False),
        (b"0\r\n\r\n", False),
        (b"z", True),
        (b"zz\r\nhello\r\n", True),
        (b"5\r\nhelloX", True),
        (b"5\r\nhello\r\n-1\r\n", True),
        (b"2\nok\n0\n\n", True),  # a size line ended by a bare LF never becomes one
        (b"5;name=value\n", True),
        (b"5\r\nhello\r\n3\nabc", True),
    ],
)
def test_the_httpx_engine_reads_chunk_framing_as_h11_does(data: bytes, broken: bool) -> None:
    from fallback_mw.upstream.httpx_framing import chunks_break_framing

    assert chunks_break_framing(data) is broken


# Framing fields on an interim answer. A 1xx ends at its empty line (RFC 9112 §6.3, first
# rule): one valid Content-Length on it frames nothing and is ignored on both engines. A
# repeated or invalid one (RFC 9110 §8.6: a recipient MAY reject repeated lengths as
# invalid) is refused by aiohttp's parser on every head, interim ones included, and cannot
# be told otherwise; h11 merged `Content-Length: 5, 5` on an interim answer and the httpx
# engine served the answer after it, where the aiohttp engine failed over. Both refuse it.
INTERIM_LENGTH = b"HTTP/1.1 103 Early Hints\r\ncontent-length: 5\r\n\r\n"
INTERIM_REPEATED_LENGTHS = {
    "interim-with-equal-lengths-in-one-field": b"HTTP/1.1 100 Continue\r\n"
    b"Content-Length: 5, 5\r\n\r\n",
    "interim-with-equal-lengths-in-two-fields": b"HTTP/1.1 100 Continue\r\n"
    b"content-length: 5\r\ncontent-length: 5\r\n\r\n",
    "interim-with-two-lengths": b"HTTP/1.1 100 Continue\r\ncontent-length: 5\r\n"
    b"content-length: 6\r\n\r\n",
    "interim-with-an-invalid-length": b"HTTP/1.1 100 Continue\r\ncontent-length: five\r\n\r\n",
}
FINAL = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


@pytest.mark.parametrize("engine", ENGINES)
async def test_an_interim_answers_one_length_is_ignored_on_both_engines(engine: str) -> None:
    result, _, remaining = await run(answer(INTERIM_LENGTH + FINAL), engine)
    assert isinstance(result, httpx.Response), result
    assert (result.status_code, result.text) == (200, "ok")
    assert result.headers["x-gateway-attempts"] == "1"
    assert remaining == 0


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(INTERIM_REPEATED_LENGTHS))
async def test_an_interim_answers_repeated_lengths_fail_over_on_both_engines(
    name: str, engine: str
) -> None:
    result, _, remaining = await run(answer(INTERIM_REPEATED_LENGTHS[name] + FINAL), engine)
    assert isinstance(result, httpx.Response), result
    assert (result.status_code, result.text) == (200, "backup")
    assert result.headers["x-gateway-attempts"] == "2"
    assert remaining == 0
