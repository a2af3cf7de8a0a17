"""Reading the request body, once per request, for every layer that needs it.

A body that fits in `replay_buffer` is buffered and may be replayed. A larger body with a
declared `Content-Length` (within `max_request_body`) streams to one attempt only, read as
it is sent. A larger body without a declared length is read up to `max_request_body`
before any upstream is contacted, so a chunked body over the limit gets its 413 with no
upstream contacted (the memory this costs is bounded by `max_request_body`). A streamed
body is held to its declared length as it is read (the upstream gets that length): one
shorter or longer is the caller's 400 (a lenient host server, an app driving the gateway
in-process, can hand on such a body). Reading counts
against the route deadline, and a gap over `header_timeout_ms` between the caller's chunks
ends it: a body that does not arrive in time is the caller's 408.

The result is kept in the request context, so the budget guard (which needs the body for
its estimate) and the walker share one read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from fallback_mw.config.views import AnySettings
from fallback_mw.request.context import RequestBody, RequestContext, host_refused
from fallback_mw.request.types import Receive, Scope
from fallback_mw.security.fields import name_forms
from fallback_mw.timers import Deadline, deadline_after


def content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """The Content-Length of an upstream response: ASCII digits only, at most 20 of them
    (the engines refuse any other, `upstream.base.check_response_head`), read exactly: a
    declared 10**19 bytes is over max_response_body, never "not declared" (it was, past
    18 digits, and the head was relayed and then cut short)."""
    for key, value in headers:
        if key.lower() == b"content-length":
            text = value.strip()
            return int(text) if text.isdigit() and len(text) <= 20 else None
    return None


def _length(value: bytes) -> int | None:
    text = value.strip()
    return int(text) if text.isdigit() and len(text) <= 18 else None


def declared_length(scope: Scope) -> int | None:
    """The caller's Content-Length, None beside a Transfer-Encoding: the server framed the
    body by its coding (RFC 9112 §6.3: it overrides the length, which an intermediary must
    not forward), so the length says nothing about the bytes that will arrive."""
    length: int | None = None
    seen = False
    # Typed: compiled, each field is then read as a tuple, not through an iterator (the
    # resolver made the head tuples of two bytes: `layers.limits.byte_fields`).
    headers: Sequence[tuple[bytes, bytes]] = scope.get("headers", ())
    for key, value in headers:  # one pass: this is every request's
        lower = name_forms(key)[0]
        if lower == b"transfer-encoding":
            return None
        if lower == b"content-length" and not seen:  # the first, as `content_length` reads
            seen = True
            length = _length(value)
    return length


async def read_body(
    context: RequestContext, scope: Scope, receive: Receive, settings: AnySettings
) -> RequestBody:
    """The request's body, read the first time it is asked for."""
    if context.body is not None:
        return context.body
    body = context.body = RequestBody()
    limit = settings.max_request_body
    declared = body.declared = declared_length(scope)
    if declared is not None and declared > limit:
        body.too_large = True
        return body
    # Without a declared length, read everything (up to the limit) before any upstream.
    head_limit = settings.replay_buffer if declared is not None else limit
    # The body's first chunk, then from a second one on all of them in one buffer: a list
    # of the chunks held some 40 bytes a chunk (a body sent two bytes a read: 20 times its
    # size, up to max_request_body).
    first = b""
    more = bytearray()
    size = 0
    gap = settings.header_timeout_ms / 1000  # the caller's idle gap (SPEC §12)
    # One timer for both bounds (either ends the read the same way): the walk deadline and
    # the gap before the next chunk, whichever is sooner, moved on after each chunk.
    loop = asyncio.get_running_loop()
    now = loop.time()
    deadline = now + max(context.remaining, 0.0)
    try:
        with Deadline(min(deadline, now + gap)) as timer:
            while True:
                try:
                    message = await receive()
                except TimeoutError:
                    raise
                except Exception:
                    host_refused(context)  # a middleware in front refused it: the host's
                    raise  # exception, for the host to answer
                if message["type"] == "http.disconnect":
                    body.client_gone = context.client_disconnected = True
                    return body
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    body.too_large = True
                    return body
                if size == len(chunk):  # nothing before it
                    first = chunk
                else:
                    if not more:
                        more += first
                    more += chunk
                if not message.get("more_body", False):
                    body.finish()
                    data = bytes(more) if more else first
                    if size <= settings.replay_buffer:
                        body.buffered = data
                    else:  # larger than replay_buffer, read whole: sent once, not replayable
                        body.stream = _Once(data)
                        body.length = size
                    return body
                if size > head_limit:
                    if declared is not None and size > declared:
                        body.misframed = True  # over its Content-Length already
                        return body
                    body.length = declared
                    body.stream = _StreamRest(
                        bytes(more) if more else first, size, body, context, receive, limit, gap
                    )
                    return body
                timer.reschedule(min(deadline, loop.time() + gap))
    except TimeoutError:
        body.timed_out = True
        return body


class _Once:
    """A body read whole, over replay_buffer: its one chunk, sent once. The streamed bodies
    are async iterator classes, not async generators, so this module compiles with mypyc
    (scripts/compile.py); each ends for good once it has ended or raised, as a generator
    does, and `aclose` ends it."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    def __aiter__(self) -> _Once:
        return self

    async def __anext__(self) -> bytes:
        data, self._data = self._data, None
        if data is None:
            raise StopAsyncIteration
        return data

    async def aclose(self) -> None:
        self._data = None


class _StreamRest:
    """Over replay_buffer: the body goes to one attempt only, read as it is sent. The
    upload is the caller's time (SPEC §12): a gap longer than `gap` between its chunks
    ends it as the caller's 408 (the walk deadline bounds the whole), and the engines
    run no upstream timer while a chunk is awaited here.

    The upstream is told the declared length (`body.length`): bytes past it, or an end
    short of it, end the body as the caller's 400 (else the upstream got a body cut short,
    or waited for bytes that never came: a first-byte timeout on its breaker). The bytes
    that complete the length are held until the caller's end is seen, so an upstream
    never gets a whole request that the caller then overruns."""

    __slots__ = (
        "_body",
        "_context",
        "_declared",
        "_ended",
        "_gap",
        "_held",
        "_last",
        "_limit",
        "_receive",
        "_size",
        "_start",
    )

    def __init__(
        self,
        head: bytes,
        size: int,
        body: RequestBody,
        context: RequestContext,
        receive: Receive,
        limit: int,
        gap: float,
    ) -> None:
        declared = body.length
        assert declared is not None  # only a body with a Content-Length streams
        self._declared = declared
        self._size = size
        self._body = body
        self._context = context
        self._receive = receive
        self._limit = limit
        self._gap = gap
        self._ended = self._last = False
        # The head is the first chunk unless it completes the length already: then held.
        self._start = head if size < declared else b""
        self._held = b"" if size < declared else head

    def __aiter__(self) -> _StreamRest:
        return self

    async def aclose(self) -> None:
        self._ended = True

    async def __anext__(self) -> bytes:
        if self._ended:
            raise StopAsyncIteration
        if self._last:  # the last chunk was taken: the body is sent whole
            self._ended = True
            self._body.finish()
            raise StopAsyncIteration
        start, self._start = self._start, b""
        if start:
            return start
        try:
            return await self._next()
        except BaseException:
            self._ended = True  # raised (or ended): it ends for good, as a generator does
            raise

    async def _next(self) -> bytes:
        body = self._body
        declared = self._declared
        while True:
            try:
                with deadline_after(self._gap):
                    message = await self._receive()
            except TimeoutError:
                body.timed_out = True
                raise BodyAborted("request body stalled") from None
            except Exception as exc:
                # The host refused the body (a middleware in front): the walk ends sending
                # nothing and raises this to the host; the engine, which may wrap what the
                # body raised in a connection error, never books it to the upstream.
                body.host_refusal = exc
                raise BodyAborted("the host refused the request body") from exc
            if message["type"] == "http.disconnect":
                body.client_gone = self._context.client_disconnected = True
                raise BodyAborted("client disconnected")
            chunk: bytes = message.get("body", b"")
            size = self._size = self._size + len(chunk)
            if size > declared:  # declared <= limit: one comparison bounds both
                if size > self._limit:
                    body.too_large = True
                    raise BodyAborted("request body over max_request_body")
                body.misframed = True
                raise BodyAborted("request body longer than its Content-Length")
            if not message.get("more_body", False):
                if size < declared:
                    body.misframed = True
                    raise BodyAborted("request body shorter than its Content-Length")
                last = self._held or chunk  # one of them is empty: the length is exact
                if last:
                    self._last = True  # done once the engine asks past it (`__anext__`)
                    return last
                self._ended = True
                body.finish()
                raise StopAsyncIteration
            if size < declared:
                if chunk:
                    return chunk
            elif chunk:
                self._held = chunk


class BodyAborted(Exception):
    """The streamed request body ended badly (its RequestBody flags say why)."""
