"""What httpx's HTTP/1.1 connection has read past an answer's framing: bytes after a body's
end, a chunked body that breaks its framing, a connection left with leftovers. Such a
connection is never pooled again, and such an answer is never relayed as complete."""

from __future__ import annotations

import re

from fallback_mw.extras import missing_extra

try:
    import h11
    import httpcore
    import httpx
    from h11 import _abnf as h11_abnf
except ImportError:
    raise missing_extra("httpx", 'engine = "httpx"') from None

from fallback_mw.upstream.httpx_backend import interim_lengths, raw_lengths


def http11_connection(response: httpx.Response) -> httpcore.AsyncHTTP11Connection | None:
    """httpcore's HTTP/1.1 connection an answer came on, found through its internals, read
    defensively: another shape (a handed transport's response) finds nothing."""
    bound = getattr(response.stream, "_stream", None)  # httpx's AsyncResponseStream
    pooled = getattr(bound, "_httpcore_stream", None)  # httpcore's PoolByteStream
    inner = getattr(pooled, "_stream", None)  # HTTP11ConnectionByteStream
    connection = getattr(inner, "_connection", None)
    return connection if isinstance(connection, httpcore.AsyncHTTP11Connection) else None


def head_as_written(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    """The response head's fields with its Content-Length fields as the upstream wrote them
    (upstream.httpx_backend.HeadRecorder): h11 merged `Content-Length: 2, 2` and two equal
    fields into one, which aiohttp's parser refuses; check_response_head now refuses both
    on this engine too (RFC 9112 §6.3: an invalid length in a response is unrecoverable)."""
    fields = list(response.headers.raw)
    connection = http11_connection(response)
    lengths = raw_lengths(getattr(connection, "_network_stream", None))
    if lengths is None:
        return fields
    kept = [(name, value) for name, value in fields if name.lower() != b"content-length"]
    return kept + [(b"content-length", value) for value in lengths]


def interim_lengths_repeated(response: httpx.Response) -> bool:
    """Whether an interim answer before this one carried repeated or invalid Content-Length
    fields. A 1xx ends at its empty line (RFC 9112 §6.3), so one valid length on it frames
    nothing; repeated ones a recipient may reject as invalid (RFC 9110 §8.6), and aiohttp's
    parser does, on every head: h11 merged `Content-Length: 5, 5` on a `100 Continue` and
    this engine served the answer after it, where the aiohttp engine failed over. Both
    refuse it now."""
    connection = http11_connection(response)
    return bool(interim_lengths(getattr(connection, "_network_stream", None)))


def h11_state(response: httpx.Response) -> h11.Connection | None:
    """The h11 state of the connection an HTTP/1.1 response came on (None: not found)."""
    state = getattr(http11_connection(response), "_h11_state", None)
    return state if isinstance(state, h11.Connection) else None


async def close_orphaned_connections(client: httpx.AsyncClient) -> None:
    """After a send that failed before its answer's head: close what httpcore left open.
    Cancelled while it waits for the head, httpcore closes the request's connection
    itself; a second cancellation a few loop iterations later (a client disconnect, the
    walk deadline or a hedge race due with the first-byte timer) cut that close short, and
    the connection stayed ACTIVE in the pool with no request for ever (its socket open, a
    pool slot lost). A connection in use always has its request in the pool (from its
    assignment until its response is closed), so one ACTIVE without any is such an orphan.
    A failed send only: a scan of the pool, none on a served request."""
    pool = getattr(getattr(client, "_transport", None), "_pool", None)
    if not isinstance(pool, httpcore.AsyncConnectionPool):
        return  # a handed transport: its own
    owned = {id(request.connection) for request in pool._requests}
    for connection in list(pool._connections):
        if id(connection) in owned or connection.is_idle() or connection.is_closed():
            continue
        await connection.aclose()


def never_pool_leftovers(response: httpx.Response) -> None:
    """Called as httpcore hands a finished HTTP/1.1 response's connection back to the pool.
    Bytes already read past the answer's framing (a body on an answer to HEAD, bytes past
    its Content-Length) would be read as the answer to the next request on the connection,
    another caller's: such a connection is closed instead (aiohttp's parser refuses it)."""
    state = h11_state(response)
    if state is not None and state.trailing_data[0]:
        state.send_failed()  # not DONE: httpcore closes the connection, never pools it


def read_what_has_arrived(response: httpx.Response) -> bool:
    """Whether the rest of an unread body had already arrived (held by h11, e.g. a short
    failover status's body that came with its head): read through to its end, the
    connection goes back to the pool as the response closes, as the aiohttp engine's does.
    A body still arriving is left: httpcore closes its connection (no wait for the
    upstream here). Nothing is read from the socket: h11 parses what it holds."""
    state = h11_state(response)
    if state is None or state.their_state is not h11.SEND_BODY:
        return False
    try:
        while True:
            event = state.next_event()
            if type(event) is h11.EndOfMessage:
                return True
            if type(event) is not h11.Data:
                return False  # NEED_DATA: the rest is still on its way
    except h11.RemoteProtocolError:
        return False  # bytes that break the framing: httpcore closes the connection


def chunks_break_framing(data: bytes) -> bool:
    """Whether chunked body bytes break their framing where h11 will read them (its own
    chunk-size line rule, and CRLF after each chunk's data); an incomplete end does not."""
    position = 0
    while position < len(data):
        line_end = data.find(b"\r\n", position)
        if line_end < 0:
            # h11 waits for the line's end: only what cannot begin a size line breaks it,
            # or a bare LF (no size line holds one: h11 waits for a CRLF that cannot end
            # it, where aiohttp's parser refuses it).
            return (
                _CHUNK_SIZE_START.match(data, position) is None or data.find(b"\n", position) >= 0
            )
        found = _CHUNK_HEADER.fullmatch(data, position, line_end + 2)
        if found is None:
            return True
        size = int(found["chunk_size"], 16)
        if size == 0:
            return False  # the last chunk: trailers, read as h11 reads them
        position = line_end + 2 + size
        footer = data[position : position + 2]
        if footer != b"\r\n"[: len(footer)]:
            return True
        position += 2
    return False


# h11's own chunk-size line (what its ChunkedReader validates), and how one can begin.
_CHUNK_HEADER = re.compile(h11_abnf.chunk_header.encode("ascii"))


_CHUNK_SIZE_START = re.compile(rb"[0-9A-Fa-f]")


def with_what_has_arrived(state: h11.Connection, chunk: bytes) -> tuple[bytes, bool]:
    """`chunk` and the body data h11 already holds after it, without waiting for more, and
    whether the body's end was read with it. h11 hands each chunk of a chunked body over
    as one event, so an upstream framing its answer in chunks of a byte or two made the
    relay run once per chunk (a 256 KB answer: 3 s of CPU, 550 times the same answer in
    1 KB chunks); what has arrived is relayed together, as the aiohttp engine does.
    Nothing past the body's end is read, and a body that breaks its framing is left to
    httpcore, which reads the same error next."""
    parts: list[bytes] | None = None
    ended = False
    while True:
        try:
            event = state.next_event()
        except h11.RemoteProtocolError:
            break
        if type(event) is h11.Data:
            if parts is None:
                parts = [chunk]
            parts.append(bytes(event.data))
            continue
        ended = type(event) is h11.EndOfMessage
        break  # NEED_DATA, or the end: nothing more has arrived
    return (chunk if parts is None else b"".join(parts)), ended


def past_its_framing(response: httpx.Response, method: str) -> bool:
    """Whether more bytes came with the response head than its framing allows: a body on
    an answer to HEAD, a 204 or a 304, or more than its Content-Length. Such an answer
    contradicts itself (SPEC §12): relayed, the caller got the first Content-Length bytes
    as a complete answer (aiohttp's parser refuses it before the head is used, and the
    aiohttp engine refuses a whole further answer it queued). Only what
    arrived with the head is seen, as on aiohttp; h11 holds it unparsed until the body is
    read (its buffer's length is read, not copied). A chunked body whose chunks, as far as
    they came with the head, break their framing (a size line that is not one, data not
    followed by CRLF) contradicts itself too: aiohttp's parser refused it before the head
    was used (a failover), where this engine relayed the head and then aborted the body.
    The head passed check_response_head: at most one Content-Length, of at most 20 digits;
    a Transfer-Encoding is `chunked`."""
    bodyless = method == "HEAD" or response.status_code in (204, 304)
    declared = None
    chunked = False
    if not bodyless:
        for name, value in response.headers.raw:
            lower = name.lower()
            if lower == b"content-length":
                declared = int(value)
                break
            if lower == b"transfer-encoding":
                chunked = True
                break
        else:
            return False  # close-delimited: no framing to break
    state = h11_state(response)
    buffered = getattr(state, "_receive_buffer", None)
    if state is None or buffered is None or len(buffered) <= (declared or 0):
        return False
    if chunked:
        return chunks_break_framing(state.trailing_data[0])
    # Blank lines after an answer are tolerated before the next (RFC 9112 §2.2; aiohttp's
    # parser skips them too): only other bytes contradict the framing.
    return bool(state.trailing_data[0][declared or 0 :].strip(b"\r\n"))
