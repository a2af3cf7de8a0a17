"""uvicorn's httptools protocol made to frame requests and answers as its h11 protocol does
(`serve`'s guarded protocol mixes these in, cli/server_limits.py): a chunked body's
trailers never taken as headers, an HTTP/1.0 client's answer ended by the close rather
than chunked, and whether the parser is inside a request's body."""

from __future__ import annotations

import functools
from typing import Any


class NoTrailersAsHeaders:
    """For uvicorn's httptools protocol, whose parser reports a chunked body's trailer
    fields through the same `on_header` callback as the head: appended to the request's
    header list, they would reach the app (and an upstream) as if they were headers.
    Trailers are dropped instead (uvicorn's h11 protocol ignores them too): once the head
    is parsed (the scope holds its list), `on_header` appends to a list nobody reads, and
    the next request's `on_message_begin` starts a new one. Nothing runs per header.
    An HTTP/1.0 request's answer is framed for it (`_close_delimited`)."""

    headers: list[tuple[bytes, bytes]]
    parser: Any

    def on_headers_complete(self) -> None:
        super().on_headers_complete()  # type: ignore[misc]
        if not self.parser.should_upgrade():  # an upgrade reads the head's list afterwards
            self.headers = []
            cycle = getattr(self, "cycle", None)
            if cycle is not None and cycle.scope.get("http_version") == "1.0":
                _close_delimited(cycle)


_NO_BODY = (204, 304)


def _close_delimited(cycle: Any) -> None:
    """An HTTP/1.0 client reads no chunked framing (RFC 9112 §6.1: a server must not send
    Transfer-Encoding to it), yet uvicorn's httptools protocol chunks every answer without
    a Content-Length, so such a client (ab, an old health check, a 1.0 proxy) got the chunk
    sizes inside its body. Such an answer is ended by closing the connection instead, as
    uvicorn's h11 protocol does (uvicorn never keeps an HTTP/1.0 connection alive). The
    cycle's `send` is this request's own, wrapped before its task first runs (`__wrapped__`
    names uvicorn's, which request/abort.py breaks a started response through)."""
    send = cycle.send
    delimited = False

    @functools.wraps(send)
    async def close_delimited_send(message: Any) -> None:
        nonlocal delimited
        kind = message["type"]
        if kind == "http.response.start" and not cycle.response_started:
            names = {name.lower() for name, _ in message.get("headers", ())}
            delimited = (
                b"content-length" not in names
                and b"transfer-encoding" not in names
                and cycle.scope["method"] != "HEAD"
                and message["status"] not in _NO_BODY
            )
            if delimited:
                cycle.chunked_encoding = False  # no `transfer-encoding: chunked` added
        elif delimited and kind == "http.response.body" and not cycle.response_complete:
            # uvicorn counts an unchunked body against a length: this chunk's, and one
            # byte more while more follow (the last one completes it, closing the
            # connection: keep-alive is off for HTTP/1.0).
            body = message.get("body", b"")
            cycle.expected_content_length = len(body) + (1 if message.get("more_body") else 0)
        await send(message)

    cycle.send = close_delimited_send


class MessageBounds:
    """For uvicorn's httptools protocol: whether the parser is inside a request's body, from
    its head's end to the message's end (h11 says so itself: `their_state`)."""

    _in_body = False

    def on_headers_complete(self) -> None:
        self._in_body = True
        super().on_headers_complete()  # type: ignore[misc]

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()  # type: ignore[misc]
