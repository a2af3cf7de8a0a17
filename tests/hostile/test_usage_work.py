"""A hostile upstream's answer costs the usage meter work in proportion to its size,
however it is cut into chunks and lines: an answer a few bytes a read, or of many tiny
lines, must not cost the gateway the square of its length (CPU that every other request
on the process waits for)."""

from __future__ import annotations

import asyncio
import re
import tracemalloc

import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.request import codings, usage
from fallback_mw.request.context import Usage
from tests.helpers import client_for
from tests.hostile.test_usage_reading import ENGINES, FULL_COST, USAGE, sse
from tests.test_budget_guard import gateway_config, status_of
from tests.upstreams import Handler, host_app, upstream

pytestmark = pytest.mark.anyio


def paced(pieces: list[bytes], content_type: str) -> Handler:
    """An upstream sending its answer a piece at a time, yielding after each one, so the
    gateway reads it in many small chunks."""

    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": content_type})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(0)
        await response.write_eof()
        return response

    return handle


async def charged_for_pieces(pieces: list[bytes], content_type: str, engine: str) -> object:
    async with upstream(paced(pieces, content_type)) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1000")
        conf["gateway"]["engine"] = engine
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=b'{"model":"gpt-test"}')
            assert response.status_code == 200
            assert response.content == b"".join(pieces)  # relayed as it came
            spent, held = await status_of(gateway)
            assert held == 0
            return spent
        finally:
            await gateway.aclose()


class CountingSplit:
    """Stands in for the meter's line-end pattern, counting the bytes it is asked to
    search."""

    def __init__(self, pattern: re.Pattern[bytes]) -> None:
        self.pattern = pattern
        self.searched = 0

    def split(self, data: bytes) -> list[bytes]:
        self.searched += len(data)
        return self.pattern.split(data)


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_long_sse_line_sent_a_little_at_a_time_is_searched_once(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One `data:` line of 1.5 MB sent 1 KiB at a time: the meter joined the pending line
    # with each chunk and searched it all again for a line end, the square of its length
    # (a 1 MB line read 256 bytes a time cost some 5 s of CPU, 4 MB 20 s: an upstream
    # pacing its answer held a core). Each byte is now searched a bounded number of times,
    # and the usage after the line is still read.
    counting = CountingSplit(usage._LINE_END)
    monkeypatch.setattr(usage, "_LINE_END", counting)
    long = b"data: " + b"x" * 1_500_000 + b"\n\n"
    pieces = [long[i : i + 1024] for i in range(0, len(long), 1024)]
    pieces += [sse(USAGE, b"[DONE]")]
    size = sum(map(len, pieces))
    assert await charged_for_pieces(pieces, "text/event-stream", engine) == FULL_COST
    assert counting.searched <= 3 * size, (counting.searched, size)


def test_tiny_data_lines_of_an_event_too_large_to_parse_cost_no_tail_copy_each() -> None:
    # An event over json_cap keeps only its tail, for its usage: each further `data:x`
    # line (7 bytes) copied the whole 64 KiB tail again (45 MB of such lines: 18 s of CPU,
    # against 3 s for 45 MB of an ordinary stream). The tail is now trimmed once per 64 KiB
    # added, and the usage at the event's end is read as before.
    trimmed: list[int] = []
    trim = usage._Tail._trim

    def counting_trim(buffer: bytearray) -> None:
        trimmed.append(len(buffer))
        trim(buffer)

    meter = usage.UsageMeter(Usage())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(usage._Tail, "_trim", staticmethod(counting_trim))
        body = b"data: " + b"y" * (usage.DEFAULT_JSON_CAP + 1) + b"\n"
        body += b"data:x\n" * 300_000 + b"data: " + USAGE + b"\n\n"
        for start in range(0, len(body), 4096):
            meter.observe(body[start : start + 4096], b"text/event-stream")
        meter.finish()
    assert meter.target.output_tokens == 20000
    # Each trim keeps 64 KiB and drops at least as much: at most one per 64 KiB added.
    assert len(trimmed) <= len(body) // (64 * 1024) + 1, len(trimmed)


def test_a_long_sse_line_sent_two_bytes_at_a_time_is_held_in_little_more_than_its_size() -> None:
    # The pending line is grown in place: kept as the pieces it came in, a line sent two
    # bytes a read would have held some 20 bytes of memory per byte until its end.
    line = b"data: " + b"x" * 300_000
    meter = usage.UsageMeter(Usage())
    tracemalloc.start()
    try:
        for index in range(0, len(line), 2):
            meter.observe(line[index : index + 2], b"text/event-stream")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    meter.observe(b"\n\ndata: " + USAGE + b"\n\n", b"text/event-stream")
    meter.finish()
    assert meter.target.output_tokens == 20000
    assert peak < 3 * len(line), peak


class CountingField(bytes):
    """A field value that counts the bytes made by concatenating it."""

    made = 0

    def __add__(self, other: bytes) -> bytes:  # type: ignore[override]
        joined = bytes(self) + other
        CountingField.made += len(joined)
        return joined

    def __radd__(self, other: bytes) -> bytes:
        joined = other + bytes(self)
        CountingField.made += len(joined)
        return joined


def test_many_content_encoding_fields_are_joined_once() -> None:
    # Several Content-Encoding fields are one list (RFC 9110 §5.3): each was appended to
    # the list so far, the square of their number (a caller's 10,000 fields, which
    # max_header_count allows, on the estimate's path). Joined once, as they were read.
    fields = [(b"content-encoding", CountingField(b"identity"))] * 5000
    CountingField.made = 0
    content_type, coding = codings.body_coding([(b"content-type", b"text/plain"), *fields])
    assert content_type == b"text/plain"
    assert coding == b",".join([b"identity"] * 5000)
    assert CountingField.made <= len(coding), CountingField.made
    assert codings.body_coding([(b"Content-Encoding", b"gzip")]) == (None, b"gzip")
    assert codings.body_coding([(b"content-encoding", b"gzip"), (b"content-encoding", b"br")]) == (
        None,
        b"gzip,br",
    )


def test_an_event_of_many_tiny_data_lines_is_held_in_about_its_size() -> None:
    # An event's data lines were kept in a list until its end, some 40 bytes each: 4 MB
    # of `data: ab` lines without a blank line held 19 MB (the event stops growing at
    # json_cap of data, 22 MB), and lines of `data:` alone (which add no data) 8 bytes
    # each without bound. They are joined as they come, as the SDKs join them.
    body = b"data: ab\n" * 450_000 + b"\n" + b"data:\n" * 700_000
    meter = usage.UsageMeter(Usage())
    tracemalloc.start()
    try:
        for start in range(0, len(body), 16384):
            meter.observe(body[start : start + 16384], b"text/event-stream")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4_000_000, peak  # the joined event (1.35 MB) and its copy to parse
    # An event's lines are still read as one document, joined with "\n".
    meter.observe(b'\n\ndata: {"model": "gpt-test",\ndata: ' + USAGE[1:] + b"\n\n", None)
    meter.finish()
    assert meter.target.output_tokens == 20000


def test_a_json_answer_read_two_bytes_at_a_time_is_held_in_about_its_size() -> None:
    # A JSON answer is kept until it ends (to be parsed whole, up to json_cap): kept as
    # the list of chunks it came in, a 1 MB answer read two bytes a read held 22 MB.
    body = b'{"x":"' + b"a" * 1_000_000 + b'",' + USAGE[1:]
    meter = usage.UsageMeter(Usage())
    tracemalloc.start()
    try:
        for start in range(0, len(body), 2):
            meter.observe(body[start : start + 2], b"application/json")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    meter.finish()
    assert meter.target.output_tokens == 20000
    assert peak < 3 * len(body), peak
