"""The httpx engine: supported for compatibility and handy in tests (custom transports). How
its errors are read is upstream/httpx_errors.py's; what its connections read past an
answer's framing, upstream/httpx_framing.py's; how an answer's body is read and its
connection handed back, upstream/httpx_response.py's."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import SupportsIndex

from fallback_mw.extras import missing_extra
from fallback_mw.injected import count_option, path_option
from fallback_mw.loops import CloseAtLoopEnd, close_on_its_loop

try:
    import httpx
except ImportError:
    raise missing_extra("httpx", 'engine = "httpx"') from None
from fallback_mw.upstream.base import (
    STALE_RESENDS,
    FirstByteTimer,
    UpstreamError,
    UpstreamRequest,
    ascii_target,
    check_proxy_answer,
    check_request_headers,
    check_response_head,
    encode_request_headers,
    resend_on_new_connection,
    unrelayable,
)
from fallback_mw.upstream.caps import ConnectionCaps, uncapped
from fallback_mw.upstream.guard import LiteralChecks
from fallback_mw.upstream.httpx_backend import GuardedNetworkBackend
from fallback_mw.upstream.httpx_errors import is_connect, map_errors, silence_engine_logs
from fallback_mw.upstream.httpx_framing import (
    close_orphaned_connections,
    head_as_written,
    interim_lengths_repeated,
    never_pool_leftovers,
    past_its_framing,
)
from fallback_mw.upstream.httpx_pool import Pool, ProxyPool
from fallback_mw.upstream.httpx_response import HttpxResponse, TransportResponse
from fallback_mw.upstream.tls import ssl_context

MAX_CONNECTIONS = 512


# How often pooled connections are swept while any are kept (HttpxClient._watch_idle):
# httpx's keep-alive expiry.
IDLE_SWEEP_SECONDS = 5.0


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


class HttpxClient:
    checks_response_heads = True  # check_response_head, on every answer it returns

    def __init__(
        self,
        *,
        allow_hosts: Sequence[str] = (),
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: SupportsIndex = MAX_CONNECTIONS,
        ca_file: str | os.PathLike[str] | None = None,
    ) -> None:
        # Checked as the aiohttp engine checks them (injected.py).
        max_connections = count_option(
            max_connections, parameter="max_connections", owner="HttpxClient"
        )
        ca_file = path_option(ca_file, parameter="ca_file", owner="HttpxClient")
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
        self._response = HttpxResponse if transport is None else TransportResponse
        self._ca_file = ca_file
        # One client (and pool) per (CA bundle, egress proxy): httpx takes both per client.
        self._clients: dict[tuple[str | None, str | None], httpx.AsyncClient] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the one the clients run on
        self._at_loop_end: list[CloseAtLoopEnd] = []  # close the clients there
        self._caps = ConnectionCaps()
        # The idle sweep's timer (`_watch_idle`) and the closes it started.
        self._sweep: asyncio.TimerHandle | None = None
        self._closing: set[asyncio.Future[None]] = set()
        silence_engine_logs()

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
        request.slot_taken = False  # nothing of it has left the gateway yet
        with map_errors("connect"):
            check_request_headers(request.headers)
            if request.proxy is not None:
                self._literals.check(request.url)
            client = self._get_client(request)
        self._watch_idle()
        # Waiting for a slot under the upstream's connection cap is the gateway's own queue
        # (bounded by the walk deadline around this call), never the upstream's time.
        release = uncapped(request) or await self._caps.acquire(request)
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
                    check_response_head(response.status_code, head_as_written(response))
                    check_proxy_answer(response.status_code, request.proxy)
                    if past_its_framing(response, request.method):
                        raise unrelayable("the answer breaks its own framing")
                    if interim_lengths_repeated(response):
                        raise unrelayable("contradictory Content-Length on an interim answer")
            except UpstreamError:
                await asyncio.shield(response.aclose())
                raise
        except BaseException:
            if not answer:
                await asyncio.shield(close_orphaned_connections(client))
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
                if not streamed or is_connect(info):
                    # An egress proxy's answer to CONNECT is the upstream's time too,
                    # whatever the body (a streamed one waited for it until the walk
                    # deadline, booked as the caller's 408).
                    timer.arm()
            elif streamed and event.endswith("receive_response_headers.complete"):
                timer.pause()  # the tunnel is up: the body's first chunk arms it again
            elif event.endswith(".response_closed.started") and answer:
                never_pool_leftovers(answer[0])

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
