"""What `fallback-mw serve` sets on uvicorn so the server itself refuses a hostile request
head before buffering it: a head over `max_header_bytes` (plus room for its request line)
gets 431 `headers_too_large`, a head not received within `header_timeout_ms` gets 408
`request_timeout`, a head the parser
cannot read gets 400 `bad_request` (405 `method_not_allowed` when all it could not read is an
unknown method token: uvicorn's httptools parser knows a fixed list), all before any ASGI
app runs, in the gateway's JSON error shape with its `rule`, with the connection closed.

uvicorn exposes `h11_max_incomplete_event_size` for its h11 parser only; its httptools
parser buffers a whole header value (8 MiB included) and has no head timeout at all. So
`serve` runs uvicorn's own protocol classes with a small guard around `data_received`: it
counts the bytes of each request head as they arrive and arms a timer from the first
byte of a head (or from the connection's start) until uvicorn has parsed it. The clock is
a timestamp per head; the timer is one per connection, re-armed for what is left when it
fires early (a new head started since), so a keep-alive connection's requests arm none."""

from __future__ import annotations

import asyncio
import json
import re
import weakref
from typing import Any, cast

from fallback_mw.cli.head_with_body import HeadWithBody, StepFlusher
from fallback_mw.cli.httptools_framing import MessageBounds, NoTrailersAsHeaders
from fallback_mw.config import DEFAULT_METHODS, GatewaySettings
from fallback_mw.request.connection_loss import SCOPE_KEY as LOSS_KEY
from fallback_mw.request.connection_loss import ConnectionLoss

# h11 keeps at most this much beyond max_header_bytes (our count runs after each read,
# which may be up to a few hundred KiB with uvloop); with httptools the guard alone bounds it.
_H11_SLACK = 512 * 1024
# max_header_bytes counts header fields (name + value + 4 each, layers/limits.py); a head
# also has its request line and closing CRLF. The server lets a head through with room for
# a request line of up to 8 KiB, so fields exactly at the limit reach the gateway's own
# exact check, and refuses anything larger before buffering it.
_REQUEST_LINE_ROOM = 8 * 1024 + 2
_LINGER_SECONDS = 2.0
_REASONS = {
    400: b"Bad Request",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
}
# The head's end: CRLF CRLF, or the bare LF LF a lenient parser also accepts.
_HEAD_END = re.compile(rb"\r?\n\r?\n")
# A request line whose method is a token (RFC 9110) the parser may not know.
_REQUEST_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}) [^ \r\n]+ HTTP/1\.[01]\r?\n")
_ALLOW = ", ".join(DEFAULT_METHODS).encode()


def _refusal(status: int, code: str, message: str, rule: str, extra: bytes = b"") -> bytes:
    body = json.dumps(
        {
            "error": {
                "type": "gateway_error",
                "code": code,
                "message": message,
                "route": None,
                "attempts": 0,
                "rule": rule,
            }
        },
        separators=(",", ":"),
    ).encode()
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"cache-control: no-store\r\nconnection: close\r\n%s\r\n"
        % (status, _REASONS[status], len(body), extra)
    )
    return head + body


def _unreadable(request_line: bytes) -> bytes:
    """The answer to a head the parser refused. A well-formed request line with a method
    the parser does not know is SPEC §12's 405 (no route forwards it); anything else 400."""
    line = _REQUEST_LINE.match(request_line)
    if line is not None and line.group(1).decode() not in DEFAULT_METHODS:
        # The token is not quoted: it can be the caller's credential (the gateway's own 405
        # redacts one, request/secrets.py), and this guard has not read the headers.
        return _refusal(
            405, "method_not_allowed",
            "this method is not forwarded: a route without methods forwards "
            f"{', '.join(DEFAULT_METHODS)}, and this server's HTTP parser reads no method "
            "outside its own list",
            "methods", b"allow: %s\r\n" % _ALLOW,
        )  # fmt: skip
    return _refusal(
        400, "bad_request", "malformed HTTP request: the server could not parse it",
        "malformed_request",
    )  # fmt: skip


class _HeadGuard:
    """Mixed in before a uvicorn HTTP protocol class (H11Protocol, HttpToolsProtocol).
    Relies only on what both share: `cycle` (replaced when a request head has been
    parsed), `transport`, `loop`, `connection_made`, `data_received`."""

    max_head_bytes: int = 65_536 + _REQUEST_LINE_ROOM
    max_header_bytes: int = 65_536  # the setting, for the message
    head_timeout: float = 10.0
    flusher: StepFlusher | None = None  # set per class (each server's) at its first connection

    # Attributes of the uvicorn protocol this is mixed into.
    cycle: Any
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: asyncio.Transport) -> None:
        flusher = type(self).flusher  # one for the server's connections, on its loop
        if flusher is None or flusher.loop is not self.loop:
            flusher = type(self).flusher = StepFlusher(self.loop)
        self._writes = HeadWithBody(transport, flusher)  # an answer's head with its body
        super().connection_made(cast(asyncio.Transport, self._writes))  # type: ignore[misc]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_since: float | None = None  # when the head being timed started
        self._lingering = False
        self._request_line = b""  # the start of the head being read (for send_400_response)
        self._head_tail = b""  # the last bytes of the head so far: its end may straddle reads
        # Told to the request in flight when the connection goes (request/connection_loss.py).
        self._loss = ConnectionLoss()
        self._start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head()
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)  # type: ignore[misc]
        self._loss.connection_lost()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # refused: the rest of the request is read and dropped, never buffered
        if not self._counting and self._expecting_head():
            self._start_head()
        if self._counting:
            if self._rest_of_answered_body():
                # What is left of a body its request was answered without (an early 413):
                # uvicorn reads and drops it; it is no head. Timed from here as a head
                # would be (a timeout closes the connection, answering nothing).
                self._draining = True
                super().data_received(data)  # type: ignore[misc]
                return
            if self._draining:  # that body has ended: the next head starts now
                self._draining = False
                self._time_head()
            if self._head_bytes == 0:
                self._request_line = data[:256]
            if self._head_too_large(data):
                # Refused before the parser sees it: a head that arrives in one read (up to
                # 256 KiB with uvloop) would otherwise be parsed whole and reach the app.
                self._refuse_large_head()
                return
            self._head_bytes += len(data)
            if self._head_since is None and self._between_requests():
                self._time_head()
        super().data_received(data)  # type: ignore[misc]
        if not self._counting:
            return
        if self._head_done():
            self._stop_head()
            self._writes.hold_next()
            cycle = self.cycle
            if cycle is not None:  # its app has not run yet: the task starts on the loop
                cycle.scope[LOSS_KEY] = self._loss
            if cycle is not None and cycle.more_body and not cycle.response_complete:
                # A body still to come: should uvicorn close the connection once it has
                # answered (an early 413 to a request that said `Connection: close`, or
                # HTTP/1.0), the rest is read first (_ClosedOnceRead).
                cycle.transport = _ClosedOnceRead(self, cycle)
        elif self._head_bytes > self.max_head_bytes:
            self._refuse_large_head()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse (both its h11 and httptools
        protocols call this), in the gateway's JSON error shape instead of plain text. The
        parser's message is not echoed: it may quote the caller's bytes."""
        self._stop_head()
        if self.transport.is_closing():
            return
        self.transport.write(_unreadable(self._request_line))
        self.transport.close()

    # --- internals --------------------------------------------------------------------

    def _head_too_large(self, data: bytes) -> bool:
        """Would the head being read, with `data`, be over max_head_bytes? Counts only up to
        the head's end when `data` holds it (a body or a pipelined request may follow). The
        usual read, head and body well under the limit, costs one comparison and a slice."""
        if self._head_bytes + len(data) <= self.max_head_bytes:
            # All of it fits, head or not. Kept: the bytes a later read's search needs
            # when the head's end straddles two reads.
            tail = data[-3:] if len(data) >= 3 else (self._head_tail + data)[-3:]
            self._head_tail = tail
            return False
        window = self._head_tail + data
        end = _HEAD_END.search(window)
        if end is None:
            self._head_tail = window[-3:]
            head = self._head_bytes + len(data)
        else:
            self._head_tail = b""
            head = self._head_bytes + max(end.end() - len(window) + len(data), 0)
        return head > self.max_head_bytes

    def _between_requests(self) -> bool:
        return self.cycle is None or bool(self.cycle.response_complete)

    def _expecting_head(self) -> bool:
        # Between requests, or the request in flight has its whole body: whatever comes
        # next is a (pipelined) request head.
        return self._between_requests() or not self.cycle.more_body

    def _rest_of_answered_body(self) -> bool:
        # Once the answer is complete uvicorn no longer updates `more_body`: the parser says
        # whether the body is still arriving.
        cycle = self.cycle
        return (
            cycle is not None
            and cycle.response_complete
            and cycle.more_body
            and self._parser_in_body()
        )

    def _parser_in_body(self) -> bool:
        conn = getattr(self, "conn", None)  # uvicorn's h11 connection; httptools has none
        if conn is None:
            return bool(getattr(self, "_in_body", False))  # kept by _MessageBounds
        import h11

        return bool(conn.their_state is h11.SEND_BODY)

    def _head_done(self) -> bool:
        # A parsed head replaces `cycle`; a websocket upgrade swaps the protocol.
        return (
            self.cycle is not self._head_cycle
            or self.transport.is_closing()
            or self.transport.get_protocol() is not cast(object, self)
        )

    def _start_head(self) -> None:
        self._counting = True
        self._draining = False
        self._head_bytes = 0
        self._head_tail = b""
        self._head_cycle = self.cycle
        if self._between_requests():
            self._time_head()

    def _stop_head(self) -> None:
        self._counting = False
        self._draining = False
        self._head_since = None  # the connection's timer, if armed, finds nothing to time

    def _time_head(self) -> None:
        self._head_since = self.loop.time()
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._timed_out)

    def _timed_out(self) -> None:
        self._head_timer = None
        since = self._head_since
        if not self._counting or since is None:
            return  # no head being timed: the next one arms the timer again
        if self._head_done() or not self._between_requests():
            self._head_since = None  # a response in flight: its own timeouts govern
            return
        left = since + self.head_timeout - self.loop.time()
        if left > 0:  # a later head than the one the timer was armed for
            self._head_timer = self.loop.call_later(left, self._timed_out)
            return
        if self._head_bytes == 0:
            self._stop_head()
            self.transport.close()  # never said anything: nothing to answer
            return
        self._refuse(
            408,
            "request_timeout",
            f"request head not received within {self.head_timeout:g} s (header_timeout_ms)",
            "header_timeout_ms",
        )

    def _refuse_large_head(self) -> None:
        self._refuse(
            431, "headers_too_large",
            f"request head larger than {self.max_header_bytes} bytes of header fields and "
            f"a {_REQUEST_LINE_ROOM - 2}-byte request line (max_header_bytes)",
            "max_header_bytes",
        )  # fmt: skip

    def _refuse(self, status: int, code: str, message: str, rule: str) -> None:
        self._stop_head()
        if self.transport.is_closing():
            return
        if not self._between_requests():
            # A response is still being written: the connection is cut instead.
            self.transport.close()
            return
        self.transport.write(_refusal(status, code, message, rule))
        self._linger(_LINGER_SECONDS)

    def _linger(self, seconds: float) -> None:
        """Lingering close: closing with unread request bytes would reset the connection
        and the client might never read the answer. Stop writing, drop what still arrives,
        close after `seconds` (or when the client closes its side)."""
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(seconds, self.transport.close)

    def _close_once_read(self, answered: bool) -> None:
        """uvicorn closing the connection after a request's answer (`answered`: complete):
        at once, unless the request's body is still arriving (answered before it was read:
        an early 413).
        Closed then, the unread bytes made the kernel reset the connection, and a client
        that reads only once it has sent the whole body (nginx with
        `proxy_request_buffering off`) never read the answer: nginx's caller got its 502
        page. The rest of the body is read and dropped, for up to header_timeout_ms."""
        if answered and self._parser_in_body() and not self._lingering:
            self._linger(self.head_timeout)
        else:
            self.transport.close()


class _ClosedOnceRead:
    """A request cycle's transport whose `close` (uvicorn's, once it has answered a request
    it will not keep the connection for) waits for the rest of an unread request body
    (`_HeadGuard._close_once_read`); everything else is the transport's own. Set only on a
    cycle whose head arrived without all its body."""

    def __init__(self, protocol: _HeadGuard, cycle: Any) -> None:
        transport = cycle.transport
        self._transport = transport
        self._protocol = protocol
        # Weak: the cycle holds this as its transport. A strong reference made a reference
        # cycle of every request whose body came after its head, and its scope, context
        # and body (parsed as JSON: many times its size) waited for the cyclic collector,
        # which serve runs rarely (`tune_gc`): 60 1 MiB POSTs grew serve to 1.5 GB.
        self._cycle = weakref.ref(cycle)
        # What uvicorn calls per chunk, bound here: no lookup through __getattr__.
        self.write = transport.write
        self.is_closing = transport.is_closing

    def close(self) -> None:
        cycle = self._cycle()
        # A cycle gone is a request over: its answer was complete, or never will be.
        self._protocol._close_once_read(cycle is None or bool(cycle.response_complete))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def guarded_protocol(base: type[asyncio.Protocol], settings: GatewaySettings) -> type[Any]:
    """`base` (a uvicorn HTTP protocol class) with the head guard, for these settings."""
    extra: tuple[type, ...] = (
        (NoTrailersAsHeaders, MessageBounds) if hasattr(base, "on_header") else ()
    )
    return type(
        f"Guarded{base.__name__}",
        (_HeadGuard, *extra, base),
        {
            "max_head_bytes": settings.max_header_bytes + _REQUEST_LINE_ROOM,
            "max_header_bytes": settings.max_header_bytes,
            "head_timeout": settings.header_timeout_ms / 1000,
        },
    )


def uvicorn_limits(settings: GatewaySettings, http: str = "auto") -> dict[str, Any]:
    """Keyword arguments for `uvicorn.run` / `uvicorn.Config` that protect the server:
    the guarded protocol class for `http` ("auto", "httptools" or "h11"), h11's own
    buffer bound, and no `server` header (the gateway does not advertise its software;
    the upstream's is dropped too)."""
    base: type[asyncio.Protocol]
    if http == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = H11Protocol
    elif http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    else:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    return {
        "http": guarded_protocol(base, settings),
        "h11_max_incomplete_event_size": settings.max_header_bytes + _H11_SLACK,
        "server_header": False,
    }
