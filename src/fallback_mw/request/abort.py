"""Breaking a started response, whichever server runs the gateway (SPEC §5: a failure
after the commit point aborts the client response; it is never ended as if complete).

ASGI has no message that says "abort this response": a server is expected to close the
connection when the application returns, or raises, before `more_body: False`. What the
servers actually do differs, so the Gateway (and the Django adapter) call `break_response`
once a response they started could not be finished. It acts on the server's own `send`,
found as the one the server called the outermost app with (`server_send`: behind
Starlette's middleware or Django's handler the gateway is handed a wrapper):

* uvicorn closes the connection, but logs an ERROR ("ASGI callable returned without
  completing response"), and a traceback if the application raises instead. Here the
  transport is closed first and the cycle marked disconnected, so uvicorn says nothing
  more: the gateway's own WARNING request line is the one line.
* hypercorn, HTTP/1.1: closes the connection, quietly (here it is closed at once: behind
  a middleware that ends the response itself, below, hypercorn would not). HTTP/2 (h2 and
  h2c): ends the stream without a RST_STREAM, so the client waits for the connection's
  idle timeout. Here the stream is reset.
* daphne keeps the connection open (the client waits for its own timeout, 60 s in curl,
  10 minutes in the openai SDK); a raise logs a traceback and then fails to send a 500.
  Here twisted's channel is closed (HTTP/1.1: what was written is flushed first, the
  chunked body is left unterminated) or the stream is reset with INTERNAL_ERROR (HTTP/2:
  twisted's own abort resets it with NO_ERROR, which RFC 9113 §8.1 keeps for a complete
  response, and curl read the cut answer as whole).
* granian closes the connection, quietly.

An HTTP/1.0 caller's answer has no chunked framing: without a length it ends where the
connection closes, so a plain close reads as the whole answer (nginx proxies as HTTP/1.0
by default and then ends its own client's answer as complete). For such a request the
connection is reset instead (SO_LINGER 0) under uvicorn, hypercorn and daphne; granian,
which offers no handle, closes it plainly, as does a Unix socket (it has no reset).

Behind Starlette's `BaseHTTPMiddleware` (FastAPI's `@app.middleware("http")`) the gateway
runs in a task of the middleware's, and the middleware ends the response as complete when
the gateway returns: only the server's own connection, broken first, keeps the client from
reading a complete answer. granian offers no handle on its connection: behind such a
middleware it sends the response as the middleware ended it.

Anything else (another server, or a shape this code does not recognise): nothing is done
here and the application returns; the server does what ASGI asks of it. Every branch
only calls what the server itself calls to close a connection, and a failure in it is
never an error for the request."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import struct
import sys
from types import FrameType
from typing import Any, Final

from fallback_mw.request.types import Scope, Send

logger: Final = logging.getLogger("fallback_mw")


async def break_response(send: Send, scope: Scope | None = None) -> None:
    """Make the server break the client's response now (see the module docstring).
    `send` is the one the gateway was handed; with `scope`, the server's own is looked up
    first, so this works behind other middleware (Starlette's, Django's handler) too."""
    try:
        send = _unwrapped((server_send(scope) if scope is not None else None) or send)
        server = _server_of(send)
        # An HTTP/1.0 answer without a length ends where the connection closes: a plain
        # close would read as the whole answer (nginx proxies as HTTP/1.0 by default, and
        # ends its own client's answer as complete). The connection is reset instead.
        reset = scope is not None and scope.get("http_version") == "1.0"
        if server == "daphne":
            assert isinstance(send, functools.partial)
            _daphne(send, reset)
        elif server == "uvicorn":
            _uvicorn(getattr(send, "__self__", None), reset)
        elif server == "hypercorn":
            await _hypercorn(getattr(send, "__self__", None), reset)
    except Exception as exc:  # the server's internals changed: fall back to ASGI's way
        logger.debug("could not break the response directly (%s)", type(exc).__name__)


def server_send(scope: Scope) -> Send | None:
    """The server's own `send` for the request whose ASGI scope is `scope`: the one in
    the outermost frame, among the running tasks' coroutines, that was called with this
    very scope object (middleware pass the scope on; a server calls its app once). None
    when there is no such frame (e.g. an in-process test client).

    Several tasks can hold such frames: a middleware that runs the app behind it in a
    task of its own (Starlette's `BaseHTTPMiddleware`) passes the scope on to it. A send
    this module knows as a server's wins, whichever task the search meets first; else
    the first one found.

    The calling task's own coroutine chain (`cr_await`) can stop at a frame that is
    executing rather than suspended (a body cut at max_response_body with no await in
    between stopped it at uvicorn's run_asgi, behind FastAPI): when no task shows the
    frame, the calling task's stack is read instead. The tasks come first because the
    Django adapter runs the gateway in a task of its own, whose outermost such frame is
    the adapter's, not the server's."""
    first: Send | None = None
    for task in asyncio.all_tasks():
        coroutine: Any = task.get_coro()
        while coroutine is not None:
            frame = getattr(coroutine, "cr_frame", None)
            if frame is not None and frame.f_locals.get("scope") is scope:
                send: Send | None = frame.f_locals.get("send")
                if callable(send):
                    if _server_of(send) is not None:
                        return send
                    first = first or send
                break  # this task's outermost frame with the scope
            coroutine = getattr(coroutine, "cr_await", None)
    if first is not None:
        return first
    found: FrameType | None = None
    caller: FrameType | None = sys._getframe(1)
    while caller is not None:
        if caller.f_locals.get("scope") is scope:
            found = caller  # keep going: the outermost one is the server's call
        caller = caller.f_back
    if found is None:
        return None
    send = found.f_locals.get("send")
    return send if callable(send) else None


def _unwrapped(send: Any) -> Any:
    """The server's own `send` behind wrappers that name it (`functools.wraps`: serve's
    HTTP/1.0 framing wraps uvicorn's)."""
    while (inner := getattr(send, "__wrapped__", None)) is not None:
        send = inner
    return send


def _server_of(send: Any) -> str | None:
    """Which server `send` belongs to ("uvicorn", "hypercorn", "daphne"), if any known."""
    send = _unwrapped(send)
    if isinstance(send, functools.partial):
        owner = getattr(send.func, "__self__", None)
        return "daphne" if type(owner).__module__.startswith("daphne.") else None
    owner = getattr(send, "__self__", None)
    module = type(owner).__module__ if owner is not None else ""
    for server in ("uvicorn", "hypercorn"):
        if module.startswith(server + "."):
            return server
    return None


def _reset_on_close(sock: Any) -> None:
    # SO_LINGER on with a zero timeout: closing the socket sends a reset, not a FIN.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _uvicorn(cycle: Any, reset: bool) -> None:
    transport = cycle.transport
    if reset:
        _reset_on_close(transport.get_extra_info("socket"))
    transport.close()  # what uvicorn itself does; buffered bytes are flushed first
    cycle.disconnected = True  # as its connection_lost would: no "without completing" line


async def _hypercorn(stream: Any, reset: bool) -> None:
    protocol = stream.send.__self__  # H11Protocol / H2Protocol .stream_send
    if str(stream.scope.get("http_version", "")).startswith("2"):
        protocol.connection.reset_stream(stream.stream_id, error_code=2)  # INTERNAL_ERROR
        await protocol._flush()
    elif reset:  # its Closed() would half-close (a FIN) first
        transport = protocol.send.__self__.writer.transport  # hypercorn's TCPServer
        _reset_on_close(transport.get_extra_info("socket"))
        transport.abort()
    else:
        from hypercorn.events import Closed  # only ever under hypercorn

        await protocol.send(Closed())  # what it sends itself for an unfinished response


def _daphne(send: functools.partial[Any], reset: bool) -> None:
    owner = getattr(send.func, "__self__", None)
    if owner is None or not type(owner).__module__.startswith("daphne."):
        return
    request = send.args[0]  # daphne's WebRequest (a twisted.web Request)
    channel = request.channel
    if channel is None:
        return
    if type(channel).__name__ == "H2Stream":
        try:
            _reset_twisted_stream(channel)
        except AttributeError:  # a twisted whose internals moved: its own abort still resets
            channel.abortConnection()
    elif reset:
        channel.transport.abortConnection()  # twisted closes with a reset
    else:
        channel.loseConnection()  # HTTPChannel: flush, then close
    # As daphne records a connection lost: what a middleware in front still sends (the
    # end of the body, as if complete) is dropped, not flushed before the close.
    owner.protocol_disconnected(request)


def _reset_twisted_stream(stream: Any) -> None:
    """twisted's H2Stream.abortConnection (H2Connection.abortRequest) with an error code:
    its reset_stream's default is NO_ERROR, which a client (curl, nghttp2) reads as the
    end of a complete response."""
    connection = stream._conn
    connection.conn.reset_stream(stream.streamID, error_code=2)  # INTERNAL_ERROR
    if connection._tryToWriteControlData():
        connection._requestDone(stream.streamID)
