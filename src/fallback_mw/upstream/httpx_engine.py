"""The httpx engine: supported for compatibility and handy in tests (custom transports)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import socket
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from http.cookiejar import CookieJar, DefaultCookiePolicy

from fallback_mw.extras import missing_extra
from fallback_mw.loops import CloseAtLoopEnd, close_on_its_loop

try:
    import h11
    import httpcore
    import httpx
    from h11 import _abnf as h11_abnf
except ImportError:
    raise missing_extra("httpx", 'engine = "httpx"') from None

from fallback_mw.timers import deadline_after
from fallback_mw.upstream.base import (
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
    encode_request_headers,
    host_limit,
    proxy_refused,
    resend_on_new_connection,
    unrelayable,
)
from fallback_mw.upstream.guard import LiteralChecks, UnsafeAddressError
from fallback_mw.upstream.httpx_backend import GuardedNetworkBackend
from fallback_mw.upstream.httpx_pool import Pool, ProxyPool
from fallback_mw.upstream.tls import (
    HANDSHAKE_CLOSED,
    TLS_FAILED,
    closed_in_handshake,
    ssl_context,
    tls_problem,
)

MAX_CONNECTIONS = 512
# How often pooled connections are swept while any are kept (HttpxClient._watch_idle):
# httpx's keep-alive expiry.
IDLE_SWEEP_SECONDS = 5.0


# httpx logs each request's full URL, query string included (INFO), and httpcore logs
# response header values (DEBUG). Neither may be recorded for the gateway's upstream calls,
# so records emitted while this engine is working are dropped; other httpx use in the host
# process logs as before.
_ENGINE_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fallback_mw_httpx_engine_active", default=False
)
_CHATTY_LOGGERS = (
    "httpx",
    "httpcore.connection",
    "httpcore.http11",
    "httpcore.http2",
    "httpcore.proxy",
    "httpcore.socks",
)


class _DropEngineRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _ENGINE_ACTIVE.get()


_DROP_ENGINE_RECORDS = _DropEngineRecords()


def _silence_engine_logs() -> None:
    for name in _CHATTY_LOGGERS:
        logger = logging.getLogger(name)
        if _DROP_ENGINE_RECORDS not in logger.filters:
            logger.addFilter(_DROP_ENGINE_RECORDS)


# What httpx/h11 refuse to build or send (a header value, a URL, an encoding; a body that
# is not its Content-Length, which h11 refuses as it is written and httpcore passes on
# unmapped): nothing the upstream could act on.
_REFUSED_LOCALLY = (
    httpx.LocalProtocolError,
    h11.LocalProtocolError,
    httpx.InvalidURL,
    httpx.UnsupportedProtocol,
    ValueError,
)


# httpcore's own words (its `_receive_event`) for a connection that ended before an
# answer's head was whole, raised as a RemoteProtocolError.
_CLOSED_UNANSWERED = "Server disconnected without sending a response."


def _nothing_arrived(exc: BaseException) -> bool:
    """Whether the connection httpcore raised `exc` on had received no byte at all (its h11
    state holds none): a close before any answer, not bytes that never became one (an
    HTTP/0.9 reply, a status line cut short, which httpcore words the same way). Read from
    the failing frame (httpcore's connection, defensively: another shape says no), only
    on this failure path."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    tb = cause.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, httpcore.AsyncHTTP11Connection):
            buffered = getattr(getattr(owner, "_h11_state", None), "_receive_buffer", None)
            return buffered is not None and len(buffered) == 0
        tb = tb.tb_next
    return False


@contextmanager
def map_errors(phase: Phase) -> Iterator[None]:
    """The one place httpx's exceptions become failure kinds (and httpx logging is muted)."""
    token = _ENGINE_ACTIVE.set(True)
    try:
        yield
    except UpstreamError:
        raise
    except (TimeoutError, httpx.TimeoutException) as exc:
        if isinstance(exc, httpx.ConnectTimeout):
            phase = "connect"  # connect_timeout_ms, not the wait for the head
        raise UpstreamError("timeout", phase, f"timed out during {phase}") from exc
    except UnsafeAddressError as exc:
        raise UpstreamError("unsafe_address", phase, str(exc)) from None
    except socket.gaierror:
        # A name that does not resolve (the guarded backend resolves it itself, and httpcore
        # passes the error on unwrapped): no connection made, as aiohttp says
        # (ClientConnectorDNSError), and the message points at the url.
        raise UpstreamError("refused", phase, "could not connect") from None
    except httpx.ConnectError as exc:
        limited = host_limit(exc, phase)  # the gateway's own host, not the upstream
        if limited is not None:
            raise limited from None
        tls = tls_problem(exc)
        if tls is None and _https(exc) and closed_in_handshake(exc):
            tls = HANDSHAKE_CLOSED  # reset while connecting an https:// url, as on aiohttp
        if tls is not None:
            raise UpstreamError("tls", phase, TLS_FAILED, detail=tls) from None
        raise UpstreamError("refused", phase, "could not connect") from None
    except httpx.ProxyError as exc:
        # httpcore's message: the proxy's status and reason ("407 Proxy Authentication
        # Required"); only the status is kept.
        status = str(exc).split(" ", 1)[0]
        refused = proxy_refused(int(status) if status.isdigit() and len(status) == 3 else None)
        raise UpstreamError("transport", phase, refused, detail=refused) from None
    except _REFUSED_LOCALLY as exc:
        raise UpstreamError("local", phase, type(exc).__name__) from None
    except (httpx.RemoteProtocolError, httpx.DecodingError) as exc:
        if str(exc) == _CLOSED_UNANSWERED and _nothing_arrived(exc):
            # The connection ended before a byte of an answer (a kept-alive one the
            # upstream closed as the request went out): no answer for a parser to refuse.
            # A transport failure, as aiohttp's ServerDisconnectedError is.
            raise UpstreamError("transport", phase, "ServerDisconnected") from None
        raise UpstreamError("protocol", phase, type(exc).__name__, detail=NOT_HTTP) from None
    except (httpx.TransportError, OSError) as exc:
        limited = host_limit(exc, phase)
        if limited is not None:
            raise limited from None
        # An ssl error after the handshake (TLS 1.3 tells a client the server wanted its
        # certificate on the first read; httpcore lets that ssl.SSLError through bare).
        tls = tls_problem(exc)
        if tls is not None:
            raise UpstreamError("tls", phase, TLS_FAILED, detail=tls) from None
        raise UpstreamError("transport", phase, type(exc).__name__) from None
    finally:
        _ENGINE_ACTIVE.reset(token)


def _https(exc: httpx.RequestError) -> bool:
    try:
        return exc.request.url.scheme == "https"
    except RuntimeError:  # no request attached: say nothing more precise
        return False


def _is_connect(info: object) -> bool:
    """Whether a trace event is about httpcore's CONNECT request to an egress proxy."""
    request = info.get("request") if isinstance(info, dict) else None
    return getattr(request, "method", None) == b"CONNECT"


def _http11_connection(response: httpx.Response) -> httpcore.AsyncHTTP11Connection | None:
    """httpcore's HTTP/1.1 connection an answer came on, found through its internals, read
    defensively: another shape (a handed transport's response) finds nothing."""
    bound = getattr(response.stream, "_stream", None)  # httpx's AsyncResponseStream
    pooled = getattr(bound, "_httpcore_stream", None)  # httpcore's PoolByteStream
    inner = getattr(pooled, "_stream", None)  # HTTP11ConnectionByteStream
    connection = getattr(inner, "_connection", None)
    return connection if isinstance(connection, httpcore.AsyncHTTP11Connection) else None


def _exact_url(url: str) -> httpx.URL:
    """The URL with the caller's query byte for byte, as the aiohttp engine sends it: httpx
    percent-encodes `"`, `<` and `>` in a query (WHATWG's query set), which curl sends as
    written and a signature over the query covers. The walker quoted the path already."""
    target = ascii_target(url)
    built = httpx.URL(target)
    query = target.partition("?")[2]
    reference = getattr(built, "_uri_reference", None)
    if query and built.query != query.encode() and isinstance(reference, tuple):
        # httpx re-quotes any query it is given (URL(), copy_with, params), so its parsed
        # form (a NamedTuple) takes the query as written; an httpx without it quotes.
        built._uri_reference = reference._replace(query=query)  # type: ignore[attr-defined]
    return built


def _h11_state(response: httpx.Response) -> h11.Connection | None:
    """The h11 state of the connection an HTTP/1.1 response came on (None: not found)."""
    state = getattr(_http11_connection(response), "_h11_state", None)
    return state if isinstance(state, h11.Connection) else None


async def _close_orphaned_connections(client: httpx.AsyncClient) -> None:
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


def _never_pool_leftovers(response: httpx.Response) -> None:
    """Called as httpcore hands a finished HTTP/1.1 response's connection back to the pool.
    Bytes already read past the answer's framing (a body on an answer to HEAD, bytes past
    its Content-Length) would be read as the answer to the next request on the connection,
    another caller's: such a connection is closed instead (aiohttp's parser refuses it)."""
    state = _h11_state(response)
    if state is not None and state.trailing_data[0]:
        state.send_failed()  # not DONE: httpcore closes the connection, never pools it


def _read_what_has_arrived(response: httpx.Response) -> bool:
    """Whether the rest of an unread body had already arrived (held by h11, e.g. a short
    failover status's body that came with its head): read through to its end, the
    connection goes back to the pool as the response closes, as the aiohttp engine's does.
    A body still arriving is left: httpcore closes its connection (no wait for the
    upstream here). Nothing is read from the socket: h11 parses what it holds."""
    state = _h11_state(response)
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


def _chunks_break_framing(data: bytes) -> bool:
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


def _with_what_has_arrived(state: h11.Connection, chunk: bytes) -> tuple[bytes, bool]:
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


def _past_its_framing(response: httpx.Response, method: str) -> bool:
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
    state = _h11_state(response)
    buffered = getattr(state, "_receive_buffer", None)
    if state is None or buffered is None or len(buffered) <= (declared or 0):
        return False
    if chunked:
        return _chunks_break_framing(state.trailing_data[0])
    # Blank lines after an answer are tolerated before the next (RFC 9112 §2.2; aiohttp's
    # parser skips them too): only other bytes contradict the framing.
    return bool(state.trailing_data[0][declared or 0 :].strip(b"\r\n"))


class HttpxResponse:
    def __init__(self, response: httpx.Response, idle_timeout: float, release: Release) -> None:
        self._response = response
        self._idle = idle_timeout
        self._release = release
        # A response dropped without aclose (a cancellation between send and its owner)
        # still gives its slot under the connection cap back.
        weakref.finalize(self, release)
        self.status = response.status_code
        self.headers = [(k.lower(), v) for k, v in response.headers.raw]
        self._finished = False
        # The HTTP/1.1 connection it came on and that connection's request count now: a
        # close that finds it ACTIVE on this same request knows it is still this answer's.
        self._connection = _http11_connection(response)
        self._cycle = getattr(self._connection, "_request_count", None)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        stream = self._response.aiter_raw()
        state = _h11_state(self._response)
        while True:
            with map_errors("body"), deadline_after(self._idle):
                try:
                    chunk = await stream.__anext__()
                except StopAsyncIteration:
                    self._finished = True
                    return
            ended = False
            if state is not None:
                chunk, ended = _with_what_has_arrived(state, chunk)
            if chunk:
                yield chunk
            if ended:
                # h11 read the body's end here: httpcore is not asked again (it would wait
                # for more), and the close hands the connection back, as after its own end.
                self._finished = True
                return

    async def aclose(self) -> None:
        # Shielded: the connection is released even if the caller is being cancelled.
        self._release()
        await asyncio.shield(self._close())

    async def _close(self) -> None:
        connection = self._connection
        if (
            not self._finished
            and connection is not None
            and getattr(connection, "_request_count", None) == self._cycle
            and not connection.is_closed()
            and not connection.is_idle()
        ):
            self._finished = _read_what_has_arrived(self._response)
        await self._response.aclose()
        if self._finished:
            return
        # A body read cut short (a cancellation, the idle timer) is closed by httpcore as
        # the read fails, with its connection. A second cancellation a few loop iterations
        # later (a client disconnect and the idle timer due together under load) cut that
        # close short: httpcore had marked the response closed, so this aclose did nothing,
        # and the connection stayed open and ACTIVE in the pool for ever (a socket in
        # CLOSE-WAIT, a pool slot lost). Cut short, the connection cannot have gone back to
        # the pool (only an answer read to its end does): closing it here is never another
        # request's. Still checked: closed, idle (back in the pool) or on a later request
        # (handed to one queued for it: its request count moved on), it is not this
        # answer's to close.
        if (
            connection is not None
            and not connection.is_closed()
            and not connection.is_idle()
            and getattr(connection, "_request_count", None) == self._cycle
        ):
            await connection.aclose()


class _TransportResponse(HttpxResponse):
    """A response from a transport handed to HttpxClient (`httpx.MockTransport` in a host's
    tests): one built with its content (`httpx.Response(200, json=...)`) was read as it was
    made, and httpx refuses to stream it again (StreamConsumed, an internal_error for every
    request): that content is the body."""

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        if not self._response.is_stream_consumed:
            async for chunk in super().iter_chunks():
                yield chunk
        elif self._response.content:
            yield self._response.content


class HttpxClient:
    def __init__(
        self,
        *,
        allow_hosts: Sequence[str] = (),
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = MAX_CONNECTIONS,
        ca_file: str | None = None,
    ) -> None:
        self._limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=min(128, max_connections)
        )
        self._allow_hosts = tuple(allow_hosts)
        # Behind an egress proxy the guarded network backend sees only the proxy's address:
        # a target written as an IP literal is checked here, as the aiohttp engine checks
        # it, once per host (a name is the proxy's to resolve and check).
        self._literals = LiteralChecks(allow_hosts)
        self._transport = transport
        # Chosen here, so the default transport's responses pay nothing for a handed one's.
        self._response = HttpxResponse if transport is None else _TransportResponse
        self._ca_file = ca_file
        # One client (and pool) per (CA bundle, egress proxy): httpx takes both per client.
        self._clients: dict[tuple[str | None, str | None], httpx.AsyncClient] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the one the clients run on
        self._at_loop_end: list[CloseAtLoopEnd] = []  # close the clients there
        self._caps = ConnectionCaps()
        # The idle sweep's timer (`_watch_idle`) and the closes it started.
        self._sweep: asyncio.TimerHandle | None = None
        self._closing: set[asyncio.Future[None]] = set()
        _silence_engine_logs()

    def _guarded_transport(
        self, ca_file: str | None, proxy: str | None
    ) -> httpx.AsyncHTTPTransport:
        """The default transport with its connection pool built on GuardedNetworkBackend:
        the connect-time SSRF check (resolve once, check every address, connect to the
        checked address; through a proxy, the proxy's). TLS trust as on the aiohttp
        engine (upstream/tls.py)."""
        limits = self._limits
        context = ssl_context(ca_file)
        # Also with no allowlist: the guard then refuses the always-refused addresses alone.
        transport = httpx.AsyncHTTPTransport(trust_env=False, limits=limits, verify=context)
        options: dict[str, object] = {
            "ssl_context": context,
            "max_connections": limits.max_connections,
            "max_keepalive_connections": limits.max_keepalive_connections,
            "keepalive_expiry": limits.keepalive_expiry,
            "network_backend": GuardedNetworkBackend(self._allow_hosts),
        }
        if proxy is not None:
            transport._pool = ProxyPool(proxy_url=proxy, **options)  # type: ignore[arg-type]
        else:
            transport._pool = Pool(**options)  # type: ignore[arg-type]
        return transport

    def _follow_loop(self) -> None:
        """Called from another event loop than the clients' (Starlette's TestClient runs
        each request on a new one when used without `with`, the last one closed): their
        pooled connections belong to that loop. The old clients are closed on their own
        loop while it runs (once it is closed, the garbage collector drops them); new
        clients, and new connection caps, are made for this loop."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            old, self._clients = list(self._clients.values()), {}
            for stale in old:
                close_on_its_loop(self._loop, stale.aclose)
            self._loop, self._caps, self._at_loop_end = loop, ConnectionCaps(), []
            self._sweep = None  # the old loop's timer: its clients are closed there

    def _get_client(self, request: UpstreamRequest | None = None) -> httpx.AsyncClient:
        self._follow_loop()
        ca_file = (request.ca_file if request else None) or self._ca_file
        proxy = request.proxy if request else None
        if self._transport is not None:
            ca_file = proxy = None  # a custom transport (tests) is used as it is
        key = (ca_file, proxy)
        client = self._clients.get(key)
        if client is None:
            transport = self._transport
            if transport is None:
                transport = self._guarded_transport(ca_file, proxy)
            client = self._clients[key] = httpx.AsyncClient(
                transport=transport,
                follow_redirects=False,
                timeout=None,
                trust_env=False,
                limits=self._limits,
                # No cookie jar (aiohttp's DummyCookieJar): an upstream's Set-Cookie is
                # relayed to its caller, never kept and sent with another caller's request.
                cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
            )
            self._at_loop_end.append(CloseAtLoopEnd(client.aclose))
        return client

    def _watch_idle(self) -> None:
        """httpcore closes an idle pooled connection (its keep-alive expiry over, or closed
        by the upstream) only when a request enters the pool or a response closes: after
        a burst and then no traffic (a fallback's pool, a quiet night) every connection the
        upstream closed stayed open on this side for ever, a socket in CLOSE-WAIT each (up
        to 128 a pool), where aiohttp's connector drops them. While connections are
        pooled, they are swept every IDLE_SWEEP_SECONDS; a handed transport keeps its own."""
        if self._sweep is None and self._transport is None:
            loop = asyncio.get_running_loop()
            self._sweep = loop.call_later(IDLE_SWEEP_SECONDS, self._sweep_idle)

    def _sweep_idle(self) -> None:
        self._sweep = None
        pooled = False
        for client in self._clients.values():
            pool = getattr(getattr(client, "_transport", None), "_pool", None)
            if not isinstance(pool, Pool | ProxyPool):
                continue
            # httpcore's own bookkeeping, as after a response closes: the expired and the
            # upstream-closed idle connections leave the pool, to be closed here.
            closing = pool._assign_requests_to_connections()
            if closing:
                done = asyncio.ensure_future(pool._close_connections(closing))
                self._closing.add(done)
                done.add_done_callback(self._closing.discard)
            pooled = pooled or bool(pool._connections)
        if pooled:
            self._watch_idle()

    async def send(self, request: UpstreamRequest) -> HttpxResponse:
        with map_errors("connect"):
            check_request_headers(request.headers)
            if request.proxy is not None:
                self._literals.check(request.url)
            client = self._get_client(request)
        self._watch_idle()
        # Waiting for a slot under the upstream's connection cap is the gateway's own queue
        # (bounded by the walk deadline around this call), never the upstream's time.
        release = await self._caps.acquire(request)
        try:
            for resends in range(STALE_RESENDS + 1):
                fresh: list[bool] = []  # a connection was made for this send
                try:
                    response = await self._send(client, request, fresh)
                    break
                except UpstreamError as exc:
                    if resends == STALE_RESENDS or not resend_on_new_connection(
                        request, exc, not fresh
                    ):
                        raise
        except BaseException:
            release()
            raise
        return self._response(response, request.timeouts.idle, release)

    async def _send(
        self, client: httpx.AsyncClient, request: UpstreamRequest, fresh: list[bool]
    ) -> httpx.Response:
        answer: list[httpx.Response] = []  # the response, once its head is in
        try:
            with map_errors("connect"):
                timer = FirstByteTimer(request.timeouts.first_byte)
                built = self._build(client, request, timer, answer, fresh)
            with map_errors("first_byte"), timer.running():
                if self._transport is not None:
                    timer.arm()  # a custom transport reports no progress
                    fresh.append(True)  # nor its connections: never resent
                response = await client.send(built, stream=True, follow_redirects=False)
            answer.append(response)
            try:
                with map_errors("first_byte"):
                    check_response_head(response.status_code, response.headers.raw)
                    check_proxy_answer(response.status_code, request.proxy)
                    if _past_its_framing(response, request.method):
                        raise unrelayable("the answer breaks its own framing")
            except UpstreamError:
                await asyncio.shield(response.aclose())
                raise
        except BaseException:
            if not answer:
                await asyncio.shield(_close_orphaned_connections(client))
            raise
        return response

    def _build(
        self,
        client: httpx.AsyncClient,
        request: UpstreamRequest,
        timer: FirstByteTimer,
        answer: list[httpx.Response],
        fresh: list[bool],
    ) -> httpx.Request:
        timeouts = request.timeouts
        body = request.body
        streamed = not isinstance(body, bytes)

        async def progress(event: str, info: object) -> None:
            if event == "connection.connect_tcp.started":
                fresh.append(True)  # not a kept-alive connection (resend_on_new_connection)
            # A buffered body follows its head at once: from here on the time is the
            # upstream's (a streamed body arms the timer itself, see FirstByteTimer).
            if ".send_request_headers." in event:
                if not streamed or _is_connect(info):
                    # An egress proxy's answer to CONNECT is the upstream's time too,
                    # whatever the body (a streamed one waited for it until the walk
                    # deadline, booked as the caller's 408).
                    timer.arm()
            elif streamed and event.endswith("receive_response_headers.complete"):
                timer.pause()  # the tunnel is up: the body's first chunk arms it again
            elif event.endswith(".response_closed.started") and answer:
                _never_pool_leftovers(answer[0])

        built = client.build_request(
            request.method,
            _exact_url(request.url),
            # Bytes: the same bytes aiohttp writes for the same text (UTF-8).
            headers=encode_request_headers(request.headers),
            content=body if isinstance(body, bytes) else timer.timed_body(body),
            # No pool timeout: waiting for a free pooled connection is the gateway's own
            # queue, not the upstream's slowness (bounded by the walk deadline). No read
            # timeout: httpcore would apply it to the wait for the response head too, where
            # only the first-byte timer rules (as on aiohttp); the gaps between body chunks
            # are timed by iter_chunks.
            timeout=httpx.Timeout(connect=timeouts.connect, read=None, write=None, pool=None),
            extensions={"trace": progress},
        )
        # httpx adds these by default; the upstream sees only what the gateway decided.
        sent = {k.lower() for k, _ in request.headers}
        for name in ("accept", "accept-encoding", "user-agent", "connection"):
            if name not in sent:
                built.headers.pop(name, None)
        return built

    async def aclose(self) -> None:
        self._follow_loop()  # clients of another loop are closed on that loop
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()
        at_loop_end, self._at_loop_end = self._at_loop_end, []
        for closing in at_loop_end:
            await closing.aclose()
