"""The default engine: aiohttp, one pooled ClientSession per gateway runtime. Its errors are
read by upstream/aiohttp_errors.py; its connector is upstream/aiohttp_connector.py; each
request goes out through upstream/aiohttp_request.py (aiohttp's request, connector and
parser, without ClientSession._request); the usual attempt through upstream/aiohttp_lean.py
(aiohttp's connector and parser alone)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from typing import Any, Final, SupportsIndex

import aiohttp
from yarl import URL

from fallback_mw.injected import count_option, path_option
from fallback_mw.loops import CloseAtLoopEnd, close_on_its_loop
from fallback_mw.timers import deadline_after
from fallback_mw.upstream import aiohttp_request
from fallback_mw.upstream.aiohttp_connector import ARM_ON_CONNECT, GuardedConnector, Sending
from fallback_mw.upstream.aiohttp_errors import answer_began, raise_mapped
from fallback_mw.upstream.aiohttp_lean import ONE_WRITE_MAX, Answer, Target, eligible
from fallback_mw.upstream.aiohttp_lean import request as lean_request
from fallback_mw.upstream.aiohttp_lean import target as lean_target
from fallback_mw.upstream.aiohttp_request import SKIP_AUTO_HEADERS, bytes_data
from fallback_mw.upstream.base import (
    MAX_RESPONSE_FIELD,
    MAX_RESPONSE_FIELDS,
    STALE_RESENDS,
    FirstByteTimer,
    UpstreamError,
    UpstreamRequest,
    ascii_target,
    check_proxy_answer,
    check_request_headers,
    check_response_head,
    resend_on_new_connection,
    unrelayable,
)
from fallback_mw.upstream.caps import ConnectionCaps, Release, uncapped
from fallback_mw.upstream.guard import GuardedResolver, LiteralChecks
from fallback_mw.upstream.tls import ssl_context

# The longest response status line and header field read (aiohttp's default is 8190 bytes:
# a long Content-Security-Policy, Link or Set-Cookie became a protocol failure, booked to
# the upstream, where the httpx engine reads a head up to 100 KiB). aiohttp's count of
# fields (128, passed explicitly) stays, so a head read is still bounded (about 8 MiB at
# most); one relayed, as on the httpx engine, is at most 100 KiB (base.MAX_RESPONSE_HEAD),
# and both engines hold this field length and that count (base.check_response_head).
_MAX_RESPONSE_FIELD: Final = MAX_RESPONSE_FIELD


class AiohttpResponse:
    def __init__(
        self,
        response: Answer,
        headers: list[tuple[bytes, bytes]],
        idle_timeout: float,
        release: Release,
    ) -> None:
        self._response = response
        self._idle = idle_timeout
        self._release = release
        self.status = response.status
        self.headers = headers  # its raw fields, names lowercased (check_response_head)
        self._finished = False

    def iter_chunks(self) -> _Chunks:
        return _Chunks(self)

    def _reset_before_its_end(self) -> bool:
        """Whether the end just read is a reset, not the body's end. aiohttp ends a body
        without Content-Length or chunked framing (it ends with the connection, RFC 9112
        §6.3) the same way on a clean close and on a reset, which is only seen on the
        connection (httpx raises a ReadError): relayed as complete, a stream cut short read
        as whole to the client. A framed body's end is its own, whatever followed it."""
        response = self._response
        protocol = response._protocol
        lost = None if protocol is None else protocol.exception()
        if lost is None or isinstance(lost, aiohttp.ServerDisconnectedError):
            return False  # the connection is open, or closed cleanly
        if response.method == "HEAD" or self.status in (204, 304):
            return False  # no body follows these heads
        return not any(
            name in (b"content-length", b"transfer-encoding") for name, _ in self.headers
        )

    def __del__(self) -> None:
        # A response dropped without aclose (a cancellation between send and its owner)
        # still gives its slot under the connection cap back (release is idempotent).
        self._release()

    async def aclose(self) -> None:
        # No await point: cannot be interrupted by a cancellation.
        self._release()
        if self._finished:
            self._response.release()
        else:
            # An unread body: the connection cannot be reused safely.
            self._response.close()


class _Chunks:
    """`AiohttpResponse.iter_chunks`: an async iterator class, not an async generator, so
    this module compiles with mypyc (scripts/compile.py). Once ended or raised, it ends
    for good, as a generator does."""

    __slots__ = ("_content", "_ended", "_response")

    def __init__(self, response: AiohttpResponse) -> None:
        self._response = response
        self._content = response._response.content
        self._ended = False

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        if self._ended:
            raise StopAsyncIteration
        content = self._content
        try:
            # What has already arrived (often the whole of a small body, with the head)
            # is taken without arming an idle timer; only a wait is timed.
            chunk = content.read_nowait()
            if not chunk and not content.is_eof():
                with deadline_after(self._response._idle):
                    chunk = await content.readany()
        except BaseException as exc:
            self._ended = True
            if isinstance(exc, Exception):
                raise_mapped("body", exc)
            raise
        if chunk:
            return chunk
        self._ended = True
        response = self._response
        if response._reset_before_its_end():
            raise UpstreamError(
                "transport", "body", "the connection was reset before the body ended"
            )
        response._finished = True
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self._ended = True


def _close_on(loop: asyncio.AbstractEventLoop, session: aiohttp.ClientSession) -> None:
    """Close a session of another event loop: on that loop while it runs; once it is
    closed, nothing can close its connections (the garbage collector drops them), so the
    session and its connector are only marked closed (else each logs "Unclosed ...")."""
    if close_on_its_loop(loop, session.close):
        return
    connector = session.connector
    session.detach()
    if connector is not None:
        with contextlib.suppress(Exception):
            connector._close()  # on a closed loop: marks it closed, touches no transport


# The methods aiohttp's own retry resent once whatever the connection (its
# IDEMPOTENT_METHODS), kept for a replayable request of these (AiohttpClient.send).
_RESENT_BY_AIOHTTP: Final = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


def _checked(response: Answer, proxy: str | None) -> list[tuple[bytes, bytes]]:
    """The answer's head checked (check_response_head, check_proxy_answer, its framing),
    its fields returned with names lowercased; an answer the relay cannot carry is closed
    unread and raises UpstreamError."""
    try:
        headers = check_response_head(response.status, response.raw_headers)
        check_proxy_answer(response.status, proxy)
        protocol = response._protocol
        if protocol is not None and len(protocol):
            # A whole further answer came with this one, past its framing (after its
            # Content-Length, a 204's head): aiohttp's parser queued it as the next message
            # (bytes that are no answer it refuses). The answer contradicts itself, as the
            # httpx engine reads it (_past_its_framing).
            raise unrelayable("the answer breaks its own framing")
    except BaseException:
        response.close()
        raise
    return headers


class AiohttpClient:
    checks_response_heads = True  # check_response_head, on every answer it returns

    def __init__(
        self,
        *,
        allow_hosts: Sequence[str] = (),
        max_connections: SupportsIndex = 512,
        ca_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self._allow_hosts = tuple(allow_hosts)
        # Checked alike in both builds (injected.py), a pathlib.Path taken as its text.
        self._ca_file = path_option(ca_file, parameter="ca_file", owner="AiohttpClient")
        self._limit = count_option(
            max_connections, parameter="max_connections", owner="AiohttpClient"
        )
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the one the session runs on
        self._at_loop_end: CloseAtLoopEnd | None = None  # closes the session there
        self._literals = LiteralChecks(allow_hosts)  # IP-literal hosts skip the resolver
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}  # per connect timeout
        self._urls: dict[str, URL] = {}  # per target without a query (`_url`)
        self._targets: dict[Any, Target] = {}  # per origin and TLS setting (aiohttp_lean)
        self._params: dict[str, Any] = {}  # the session's response_params (aiohttp_lean)
        self._caps = ConnectionCaps()

    def _follow_loop(self) -> None:
        """Called from another event loop than the session's (Starlette's TestClient runs
        each request on a new one when used without `with`, the last one closed): its
        pooled connections belong to that loop and cannot be used from this one. The old
        session is closed on its own loop; a new one, and new connection caps (their
        semaphores are bound to a loop too), are made for this loop."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._session is not None and self._loop is not None:
                _close_on(self._loop, self._session)
            self._session, self._loop, self._caps = None, loop, ConnectionCaps()
            self._at_loop_end = None

    def _get_session(self) -> aiohttp.ClientSession:
        self._follow_loop()
        if self._session is None or self._session.closed:
            connector = GuardedConnector(
                limit=self._limit,
                limit_per_host=0,
                resolver=GuardedResolver(self._allow_hosts),
                ttl_dns_cache=10,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=SKIP_AUTO_HEADERS,
                timeout=aiohttp.ClientTimeout(total=None),
                cookie_jar=aiohttp.DummyCookieJar(),
                max_line_size=_MAX_RESPONSE_FIELD,
                max_field_size=_MAX_RESPONSE_FIELD,
                max_headers=MAX_RESPONSE_FIELDS,
            )
            if hasattr(self._session, "_retry_connection"):
                # aiohttp's own retry sent every GET, PUT and DELETE again when a
                # connection ended unanswered: a PUT or DELETE the route does not list as
                # replayable went twice. The engine resends only a replayable request
                # (`send`, resend_on_new_connection).
                self._session._retry_connection = False
            self._at_loop_end = CloseAtLoopEnd(self._session.close)
            self._params = aiohttp_request.response_params(self._session)
        return self._session

    async def send(self, request: UpstreamRequest) -> AiohttpResponse:
        # One coroutine (each frame an await passes through costs every suspension), and
        # aiohttp's errors read in `except` clauses (raise_mapped), which cost nothing while
        # nothing is raised, rather than a `with` scope entered per phase.
        request.slot_taken = False  # nothing of it has left the gateway yet
        session = self._session
        if session is None or session.closed or self._loop is not asyncio.get_running_loop():
            session = self._get_session()  # the first send, or another loop's (_follow_loop)
        try:
            check_request_headers(request.headers)
            self._literals.check(request.url)
            # An egress proxy written as an IP literal skips the resolver too (aiohttp
            # connects to a literal as it is): checked here, once per proxy URL.
            if request.proxy is not None:
                self._literals.check(request.proxy, whole=True)
        except Exception as exc:
            raise_mapped("connect", exc)
            raise
        # Waiting for a slot under the upstream's connection cap is the gateway's own queue
        # (bounded by the walk deadline around this call), never the upstream's time.
        release = uncapped(request) or await self._caps.acquire(request)
        try:
            timeouts = request.timeouts
            body = request.body
            buffered = isinstance(body, bytes)
            # encoded=True: the path and query go out byte for byte as the walker built
            # them (yarl would otherwise decode %3F, %2F, %7e... and re-encode).
            url = self._urls.get(request.url)
            if url is None:
                url = self._url(request.url)
            client_timeout = self._timeouts.get(timeouts.connect) or self._client_timeout(
                timeouts.connect
            )
            # The same trust on both engines (upstream/tls.py); plain http needs none.
            ssl: Any = True
            if request.url.startswith("https:"):
                ssl = ssl_context(request.ca_file or self._ca_file)
            # The usual attempt goes out through the lean request (aiohttp_lean), its body
            # None when empty as bytes_data has it; any other through aiohttp_request. The
            # engine's connector never forces a close, which the lean request does not write.
            target: Target | None = None
            lean_body: bytes | None = None
            if (
                isinstance(body, bytes)
                and len(body) <= ONE_WRITE_MAX
                and request.proxy is None
                and aiohttp_request.supported()
            ):
                lean_body = body or None
                if eligible(request.method, request.headers):
                    target = lean_target(self._targets, url, ssl)
            for resends in range(STALE_RESENDS + 1):
                # No timer while connecting (the socket connect has its own) or while the
                # caller's body is still arriving (the caller's time): see FirstByteTimer.
                timer = FirstByteTimer(timeouts.first_byte)
                sending = Sending(timer, not buffered, timeouts.connect)
                data = bytes_data(body) if isinstance(body, bytes) else timer.timed_body(body)
                armed = ARM_ON_CONNECT.set(sending)
                answered = False
                try:
                    with timer.running():
                        response: Answer
                        if target is not None:
                            response = await lean_request(
                                session.connector,
                                target,
                                request.method,
                                url,
                                request.headers,
                                lean_body,
                                client_timeout,
                                self._params,
                                session._loop,
                                sending,
                            )
                        else:
                            response = await aiohttp_request.request(
                                session,
                                request.method,
                                url,
                                headers=request.headers,
                                data=data,
                                client_timeout=client_timeout,
                                ssl=ssl,
                                proxy=request.proxy,
                            )
                    # An answer the relay cannot carry is no lost connection: never resent.
                    headers = _checked(response, request.proxy)
                    answered = True
                except Exception as exc:
                    try:
                        raise_mapped("first_byte", exc)
                        raise
                    except UpstreamError as error:
                        # aiohttp's own rule is kept for what it covered, a replayable GET,
                        # HEAD, OPTIONS, TRACE, PUT or DELETE: one resend whatever the
                        # connection (RFC 9112 §9.3.1); a kept-alive one lost under any
                        # replayable request is resent by the engines' common rule.
                        reused = not sending.fresh or (
                            resends == 0 and request.method in _RESENT_BY_AIOHTTP
                        )
                        if (
                            resends == STALE_RESENDS
                            or not resend_on_new_connection(request, error, reused)
                            or answer_began(error)
                        ):
                            raise
                finally:
                    ARM_ON_CONNECT.reset(armed)
                if answered:  # not a `break` in the `try` (mypyc does not implement it)
                    break
        except BaseException:
            release()
            raise
        return AiohttpResponse(response, headers, timeouts.idle, release)

    def _url(self, text: str) -> URL:
        """yarl's URL of an attempt's target (about a microsecond to make), kept for the
        next attempts at it: at most 256, and none with a query (a caller's query string
        is kept no longer than its request)."""
        url = URL(ascii_target(text), encoded=True)
        if len(self._urls) < 256 and "?" not in text:
            self._urls[text] = url
        return url

    def _client_timeout(self, connect: float) -> aiohttp.ClientTimeout:
        # aiohttp's `connect` includes waiting for a free pooled connection: the gateway's
        # own queue, not the upstream's slowness. Only the socket connect is the
        # upstream's; the wait is bounded by the walk deadline around `send`.
        found = self._timeouts.get(connect)
        if found is None:
            found = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=connect)
            if len(self._timeouts) < 256:
                self._timeouts[connect] = found
        return found

    async def aclose(self) -> None:
        self._follow_loop()  # a session of another loop is closed on that loop
        if self._session is not None:
            await self._session.close()
            self._session = None
        at_loop_end, self._at_loop_end = self._at_loop_end, None
        if at_loop_end is not None:
            await at_loop_end.aclose()
