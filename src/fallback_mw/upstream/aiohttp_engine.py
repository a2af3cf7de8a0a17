"""The default engine: aiohttp, one pooled ClientSession per gateway runtime."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import warnings
from collections.abc import AsyncIterator, Sequence
from contextvars import ContextVar
from typing import Any

import aiohttp
from aiohttp.abc import ResolveResult
from multidict import CIMultiDict
from yarl import URL

from fallback_mw.loops import CloseAtLoopEnd, close_on_its_loop
from fallback_mw.timers import deadline_after
from fallback_mw.upstream.base import (
    MAX_RESPONSE_FIELD,
    MAX_RESPONSE_FIELDS,
    NOT_HTTP,
    STALE_RESENDS,
    ConnectionCaps,
    FirstByteTimer,
    Phase,
    Release,
    UpstreamError,
    UpstreamRequest,
    ascii_target,
    check_proxy_answer,
    check_request_headers,
    check_response_head,
    host_limit,
    proxy_refused,
    resend_on_new_connection,
    unrelayable,
)
from fallback_mw.upstream.guard import GuardedResolver, LiteralChecks, UnsafeAddressError
from fallback_mw.upstream.tls import (
    HANDSHAKE_CLOSED,
    TLS_FAILED,
    closed_in_handshake,
    is_certificate_error,
    ssl_context,
    tls_problem,
)

# aiohttp would otherwise add these; the upstream sees only what the gateway decided.
_SKIP_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")

# The longest response status line and header field read (aiohttp's default is 8190 bytes:
# a long Content-Security-Policy, Link or Set-Cookie became a protocol failure, booked to
# the upstream, where the httpx engine reads a head up to 100 KiB). aiohttp's count of
# fields (128, passed explicitly) stays, so a head read is still bounded (about 8 MiB at
# most); one relayed, as on the httpx engine, is at most 100 KiB (base.MAX_RESPONSE_HEAD),
# and both engines hold this field length and that count (base.check_response_head).
_MAX_RESPONSE_FIELD = MAX_RESPONSE_FIELD


class _ErrorMap:
    """The one place aiohttp's exceptions become failure kinds: `with map_errors(phase):`.
    Class-based and stateless (one instance per phase): it runs several times per request."""

    __slots__ = ("phase",)

    def __init__(self, phase: Phase) -> None:
        self.phase: Phase = phase

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, UpstreamError):
            return  # nothing raised, or a cancellation / an UpstreamError: as they are
        phase = self.phase
        if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
            if isinstance(exc, aiohttp.ConnectionTimeoutError):
                phase = "connect"  # its sock_connect (connect_timeout_ms), not the head's wait
            raise UpstreamError("timeout", phase, f"timed out during {phase}") from exc
        if isinstance(exc, OSError):  # ClientOSError, ClientConnectorError and the bare kind
            limited = host_limit(exc, phase)  # the gateway's own host, not the upstream
            if limited is not None:
                raise limited from None
        tls = _tls_failure(exc)
        if tls is not None:
            raise UpstreamError("tls", phase, TLS_FAILED, detail=tls) from None
        if isinstance(exc, aiohttp.ClientHttpProxyError):
            refused = proxy_refused(exc.status)
            raise UpstreamError("transport", phase, refused, detail=refused) from None
        if isinstance(exc, aiohttp.ClientConnectorError):
            if isinstance(exc.os_error, UnsafeAddressError):
                raise UpstreamError("unsafe_address", phase, str(exc.os_error)) from None
            raise UpstreamError("refused", phase, "could not connect") from None
        if isinstance(exc, UnsafeAddressError):
            raise UpstreamError("unsafe_address", phase, str(exc)) from None
        if isinstance(exc, aiohttp.InvalidURL | ValueError):
            # What aiohttp refuses to build or write (a URL, a header value, an encoding):
            # nothing reached the upstream.
            raise UpstreamError("local", phase, type(exc).__name__) from None
        if isinstance(exc, aiohttp.ClientResponseError | aiohttp.ClientPayloadError):
            raise UpstreamError("protocol", phase, type(exc).__name__, detail=NOT_HTTP) from None
        if isinstance(exc, aiohttp.ClientError | OSError):
            raise UpstreamError("transport", phase, type(exc).__name__) from None


def _tls_failure(exc: Exception) -> str | None:
    """What failed in the TLS exchange (upstream/tls.tls_problem), None for another error:
    also an ssl error aiohttp reports as a plain ClientOSError (TLS 1.3 tells a client the
    server wanted its certificate on the first read, after the handshake), and a reset while
    connecting an https:// url (the handshake broken off; the httpx engine, on the same
    server, saw the end of stream as an ssl error: one upstream, one failure kind)."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return tls_problem(exc.certificate_error) or tls_problem(exc)
    if isinstance(exc, aiohttp.ClientSSLError):
        # aiohttp's own ssl error class carries no reason: the one it wraps does.
        return tls_problem(exc.os_error) or HANDSHAKE_CLOSED
    if is_certificate_error(exc):
        return tls_problem(exc) or HANDSHAKE_CLOSED
    if (
        isinstance(exc, aiohttp.ClientConnectorError)
        and isinstance(exc.ssl, ssl.SSLContext)
        and closed_in_handshake(exc.os_error)
    ):
        return HANDSHAKE_CLOSED
    return None


_ERROR_MAPS: dict[str, _ErrorMap] = {
    phase: _ErrorMap(phase) for phase in ("connect", "first_byte", "body")
}


def map_errors(phase: Phase) -> _ErrorMap:
    return _ERROR_MAPS[phase]


# The first-byte timer of the request being sent in this task, and whether its body is
# streamed: for a buffered body the connector arms it once it has a connection, just before
# the request head and its body go out (from then on the time is the upstream's); an egress
# proxy's answer to CONNECT is timed by it whatever the body; and its connect timeout, which
# also holds the lookup of the upstream's name (`_Connector._resolve_host`). A context
# variable rather than an aiohttp trace hook: traces cost a handful of signal sends on every
# request.
class _Sending:
    """One send's facts for the connector: its first-byte timer, whether its body is
    streamed, its connect timeout, and whether the connection it got was made for it
    (`fresh`) rather than taken from the pool (resend_on_new_connection)."""

    __slots__ = ("connect", "fresh", "streamed", "timer")

    def __init__(self, timer: FirstByteTimer, streamed: bool, connect: float) -> None:
        self.timer = timer
        self.streamed = streamed
        self.connect = connect
        self.fresh = False


_ARM_ON_CONNECT: ContextVar[_Sending | None] = ContextVar(
    "fallback_mw_arm_on_connect", default=None
)


class _Connector(aiohttp.TCPConnector):
    async def connect(
        self,
        req: aiohttp.ClientRequest,
        traces: list[Any],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 (aiohttp's signature)
    ) -> Any:
        armed = _ARM_ON_CONNECT.get()
        if armed is not None:
            armed.fresh = False
        connection = await super().connect(req, traces, timeout)
        # A pooled connection on which the upstream wrote while it sat idle (a late or
        # repeated answer, another caller's) holds that answer parsed and queued, and
        # aiohttp hands it out as is: the next request on it, another caller's, would be
        # answered with it. Such a connection is closed and another taken; the pool holds
        # at most `limit` of them, so a fresh connection ends the loop.
        for _ in range((self.limit or 1024) + 1):
            protocol = connection.protocol
            if protocol is None or not protocol.should_close:
                break
            connection.close()
            connection = await super().connect(req, traces, timeout)
        if armed is not None and not armed.streamed:
            armed.timer.arm()
        return connection

    async def _create_connection(
        self,
        req: aiohttp.ClientRequest,
        traces: list[Any],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 (aiohttp's signature)
    ) -> Any:
        armed = _ARM_ON_CONNECT.get()
        if armed is not None:
            armed.fresh = True  # made for this send, never a kept-alive one
        return await super()._create_connection(req, traces, timeout)

    async def _resolve_host(
        self, host: str, port: int, traces: Sequence[Any] | None = None
    ) -> list[ResolveResult]:
        # aiohttp's sock_connect starts once an address is known: a resolver that hangs
        # (a DNS server gone) held every attempt to the walk deadline, a 504 that never
        # reached the fallback. The lookup is part of the connect (as for curl and httpx):
        # held to connect_timeout_ms, a `timeout` of the connect. Only this request's wait
        # ends; a lookup other requests share goes on (aiohttp shields it).
        armed = _ARM_ON_CONNECT.get()
        if armed is None:
            return await super()._resolve_host(host, port, traces=traces)
        seconds = armed.connect
        try:
            async with asyncio.timeout(seconds):
                return await super()._resolve_host(host, port, traces=traces)
        except TimeoutError:
            raise aiohttp.ConnectionTimeoutError(
                f"no address for the upstream's host within {seconds:g} s"
            ) from None

    async def _create_proxy_connection(
        self,
        req: aiohttp.ClientRequest,
        traces: list[Any],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 (aiohttp's signature)
    ) -> Any:
        # aiohttp times the TCP connect to the egress proxy and the TLS handshake through
        # it, not the proxy's answer to CONNECT: a proxy that accepted and never answered
        # held every attempt until the walk deadline (a 504, no breaker mark, no time left
        # for a fallback), where the httpx engine's first-byte timer (armed as the CONNECT
        # goes out) ended it. The upstream's first-byte timer runs from here, as there;
        # `connect` re-arms it once the connection is made (a buffered body), or it waits
        # for the body's first chunk (a streamed one: until the tunnel was up, the body
        # went nowhere, and the walk deadline ran out as the caller's 408).
        armed = _ARM_ON_CONNECT.get()
        if armed is None:
            return await super()._create_proxy_connection(req, traces, timeout)
        timer, streamed = armed.timer, armed.streamed
        timer.arm()
        try:
            return await super()._create_proxy_connection(req, traces, timeout)
        finally:
            if streamed:
                timer.pause()


class AiohttpResponse:
    def __init__(
        self, response: aiohttp.ClientResponse, idle_timeout: float, release: Release
    ) -> None:
        self._response = response
        self._idle = idle_timeout
        self._release = release
        self.status = response.status
        self.headers = [(k.lower(), v) for k, v in response.raw_headers]
        self._finished = False

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        content = self._response.content
        while True:
            with map_errors("body"):
                # What has already arrived (often the whole of a small body, with the
                # head) is taken without arming an idle timer; only a wait is timed.
                chunk = content.read_nowait()
                if not chunk and not content.is_eof():
                    with deadline_after(self._idle):
                        chunk = await content.readany()
            if not chunk:
                if self._reset_before_its_end():
                    raise UpstreamError(
                        "transport", "body", "the connection was reset before the body ended"
                    )
                self._finished = True
                return
            yield chunk

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


def _answer_began(error: UpstreamError) -> bool:
    """Whether the connection a send failed on had received bytes of an answer before it
    ended (a status line or head cut short): the upstream took the request and began to
    answer, so it was not lost unanswered, and is not sent again (resend_on_new_connection;
    the httpx engine names such bytes a parser refusal). aiohttp's ServerDisconnectedError
    carries the message its parser had begun then (its own words when no byte came)."""
    lost = error.__context__
    return isinstance(lost, aiohttp.ServerDisconnectedError) and not isinstance(
        lost.message, str | None
    )


# The methods aiohttp's own retry resent once whatever the connection (its
# IDEMPOTENT_METHODS), kept for a replayable request of these (AiohttpClient.send).
_RESENT_BY_AIOHTTP = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})

_LARGE_BYTES = 1 << 20  # aiohttp's TOO_LARGE_BYTES_BODY


def _bytes_payload(body: bytes) -> aiohttp.payload.BytesPayload:
    """A buffered body over 1 MiB (a `replay_buffer` raised above its default), as aiohttp
    would wrap it, without its ResourceWarning ("might lock the event loop": the body is
    already in memory, and one transport write copies it). A host that runs with warnings
    as errors (its test suite) had the request end in that warning, raised out of the
    gateway. Constructing the payload does not await: no other task sees the filter."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        return aiohttp.payload.BytesPayload(body)


class AiohttpClient:
    def __init__(
        self,
        *,
        allow_hosts: Sequence[str] = (),
        max_connections: int = 512,
        ca_file: str | None = None,
    ) -> None:
        self._allow_hosts = tuple(allow_hosts)
        self._ca_file = ca_file
        self._limit = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the one the session runs on
        self._at_loop_end: CloseAtLoopEnd | None = None  # closes the session there
        self._literals = LiteralChecks(allow_hosts)  # IP-literal hosts skip the resolver
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}  # per connect timeout
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
            connector = _Connector(
                limit=self._limit,
                limit_per_host=0,
                resolver=GuardedResolver(self._allow_hosts),
                ttl_dns_cache=10,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=_SKIP_AUTO_HEADERS,
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
        return self._session

    async def send(self, request: UpstreamRequest) -> AiohttpResponse:
        with map_errors("connect"):
            check_request_headers(request.headers)
        session = self._get_session()
        with map_errors("connect"):
            self._literals.check(request.url)
            # An egress proxy written as an IP literal skips the resolver too (aiohttp
            # connects to a literal as it is): checked here, once per proxy URL.
            if request.proxy is not None:
                self._literals.check(request.proxy, whole=True)
        # Waiting for a slot under the upstream's connection cap is the gateway's own queue
        # (bounded by the walk deadline around this call), never the upstream's time.
        release = await self._caps.acquire(request)
        try:
            for resends in range(STALE_RESENDS + 1):
                # No timer while connecting (the socket connect has its own) or while the
                # caller's body is still arriving (the caller's time): see FirstByteTimer.
                timeouts = request.timeouts
                sending = _Sending(
                    FirstByteTimer(timeouts.first_byte),
                    not isinstance(request.body, bytes),
                    timeouts.connect,
                )
                try:
                    response = await self._send(session, request, sending)
                    break
                except UpstreamError as exc:
                    # aiohttp's own rule is kept for what it covered, a replayable GET,
                    # HEAD, OPTIONS, TRACE, PUT or DELETE: one resend whatever the
                    # connection (RFC 9112 §9.3.1); a kept-alive one lost under any
                    # replayable request is resent by the engines' common rule.
                    reused = not sending.fresh or (
                        resends == 0 and request.method in _RESENT_BY_AIOHTTP
                    )
                    if (
                        resends == STALE_RESENDS
                        or not resend_on_new_connection(request, exc, reused)
                        or _answer_began(exc)
                    ):
                        raise
        except BaseException:
            release()
            raise
        return AiohttpResponse(response, request.timeouts.idle, release)

    async def _send(
        self, session: aiohttp.ClientSession, request: UpstreamRequest, sending: _Sending
    ) -> aiohttp.ClientResponse:
        timeouts = request.timeouts
        timer = sending.timer
        body = request.body
        if isinstance(body, bytes):
            data: Any = _bytes_payload(body) if len(body) > _LARGE_BYTES else (body or None)
        else:
            data = timer.timed_body(body)
        armed = _ARM_ON_CONNECT.set(sending)
        try:
            with map_errors("first_byte"), timer.running():
                response = await session.request(
                    request.method,
                    # encoded=True: the path and query go out byte for byte as the walker
                    # built them (yarl would otherwise decode %3F, %2F, %7e... and re-encode).
                    URL(ascii_target(request.url), encoded=True),
                    headers=CIMultiDict(request.headers),
                    data=data,
                    allow_redirects=False,
                    timeout=self._client_timeout(timeouts.connect),
                    # The same trust on both engines (upstream/tls.py); plain http needs none.
                    ssl=ssl_context(request.ca_file or self._ca_file)
                    if request.url.startswith("https:")
                    else True,
                    proxy=request.proxy,
                )
        finally:
            _ARM_ON_CONNECT.reset(armed)
        try:
            with map_errors("first_byte"):
                check_response_head(response.status, response.raw_headers)
                check_proxy_answer(response.status, request.proxy)
                protocol = response._protocol
                if protocol is not None and len(protocol):
                    # A whole further answer came with this one, past its framing (after
                    # its Content-Length, a 204's head): aiohttp's parser queued it as the
                    # next message (bytes that are no answer it refuses). The answer
                    # contradicts itself, as the httpx engine reads it (_past_its_framing).
                    raise unrelayable("the answer breaks its own framing")
        except UpstreamError:
            response.close()
            raise
        return response

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
