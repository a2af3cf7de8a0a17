"""The httpx engine's connect-time guard: an httpcore network backend that connects only to
addresses the allowlist allows (httpcore comes with the httpx extra). Its plain-TCP streams
also stop sending a request body once the upstream has answered with an error
(`EarlyAnswerStream`)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import httpcore
from httpcore._utils import is_socket_readable

from fallback_mw.upstream.guard import UnsafeAddressError, resolve_checked_async


class GuardedNetworkBackend(httpcore.AsyncNetworkBackend):
    """httpcore network backend for the httpx engine: resolves the host once, checks every
    address, and connects to a checked address (an IP, so nothing below looks the name up
    again). TLS still verifies and sends SNI for the original host: httpcore passes the
    origin's host name to start_tls separately."""

    def __init__(
        self, allow_hosts: Sequence[str], inner: httpcore.AsyncNetworkBackend | None = None
    ) -> None:
        self._allow_hosts = tuple(allow_hosts)
        self._inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        # The lookup is part of the connect, as httpcore's own backend has it: a resolver
        # that hangs (a DNS server gone) is held to connect_timeout_ms, a connect timeout,
        # not left to run out the walk deadline. The connect gets what is left.
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                addresses = await resolve_checked_async(host, port, self._allow_hosts)
        except TimeoutError:
            raise httpcore.ConnectTimeout(
                f"no address for the upstream's host within {timeout:g} s"
            ) from None
        if timeout is not None:
            timeout = max(timeout - (time.monotonic() - started), 0.001)
        options = list(socket_options) if socket_options is not None else None

        async def connect(address: str) -> httpcore.AsyncNetworkStream:
            return await self._inner.connect_tcp(
                address, port, timeout=None, local_address=local_address, socket_options=options
            )

        # One connect timeout for every address, as aiohttp's sock_connect has it: one
        # each held a name with N silent addresses N times connect_timeout_ms.
        try:
            async with asyncio.timeout(timeout):
                stream = await first_connected(interleaved(addresses), connect)
        except TimeoutError:
            raise httpcore.ConnectTimeout(
                f"no address of the upstream's host answered within {timeout:g} s"
            ) from None
        return EarlyAnswerStream(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise UnsafeAddressError("unix sockets are not upstreams")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


# RFC 8305 §5's Connection Attempt Delay, the one aiohttp's connector (aiohappyeyeballs)
# uses: a next address is tried this long after the previous began, or as soon as it failed.
NEXT_ADDRESS_AFTER = 0.25


def interleaved(addresses: Sequence[str]) -> list[str]:
    """The resolved addresses with the families taking turns, the first address's family
    first (RFC 8305 §4, as aiohttp orders them): a broken IPv6 path costs one delay, not
    one per IPv6 address ahead of the first IPv4 one."""
    sixes = [address for address in addresses if ":" in address]
    fours = [address for address in addresses if ":" not in address]
    first, second = (sixes, fours) if addresses and ":" in addresses[0] else (fours, sixes)
    turns: list[str] = []
    for index in range(max(len(first), len(second))):
        turns.extend(family[index] for family in (first, second) if index < len(family))
    return turns


async def first_connected(
    addresses: Sequence[str],
    connect: Callable[[str], Awaitable[httpcore.AsyncNetworkStream]],
) -> httpcore.AsyncNetworkStream:
    """Happy eyeballs (RFC 8305): connect to each address in turn, starting the next one
    NEXT_ADDRESS_AFTER after the previous began or as soon as it failed, and keep the first
    connection made; the others are cancelled or closed. Tried one after another with the
    whole connect timeout each (httpcore's own way), a silent first address (a dropping
    firewall, an IPv6 path with no route back) cost every new connection that timeout,
    where the aiohttp engine waited 250 ms. Raises the last address's error when none
    connects."""
    if len(addresses) == 1:
        return await connect(addresses[0])  # an IP literal's, most names': no race to run
    queue = list(addresses)
    running: set[asyncio.Task[httpcore.AsyncNetworkStream]] = set()
    failure: BaseException | None = None
    try:
        while queue or running:
            if queue:
                running.add(asyncio.ensure_future(connect(queue.pop(0))))
            done, running = await asyncio.wait(
                running,
                timeout=NEXT_ADDRESS_AFTER if queue else None,
                return_when=asyncio.FIRST_COMPLETED,
            )
            connected = [task for task in done if task.exception() is None]
            if connected:
                for extra in connected[1:]:  # connected in the same instant: not needed
                    await _close(extra.result())
                return connected[0].result()
            failure = next(iter(done)).exception() if done else failure
    finally:
        for task in running:
            task.cancel()
        if running:
            await _closed(running)
    assert failure is not None
    raise failure


async def _closed(tasks: set[asyncio.Task[httpcore.AsyncNetworkStream]]) -> None:
    """Waits for the cancelled attempts to end; one that connected all the same is closed."""
    await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled() and task.exception() is None:
            await _close(task.result())


async def _close(stream: httpcore.AsyncNetworkStream) -> None:
    """Closes a connection the race does not keep. A close that fails (a reset on close)
    is that connection's end, not the race's: raised, it lost the winner (left open,
    never used) and failed a connect that one address had answered."""
    with contextlib.suppress(Exception):
        await stream.aclose()


class HeadRecorder:
    """The raw Content-Length field values of the final response head read on one
    connection, as the upstream wrote them. h11 merges `Content-Length: 2, 2` and two equal
    fields into one `2` before httpx shows the head, where aiohttp's parser refuses both:
    `check_response_head` reads these instead, so both engines judge the same bytes.
    httpcore writes a request only once the previous answer is done (no pipelining): the
    first write after a read starts the next exchange."""

    __slots__ = ("_buffer", "_done", "interim_lengths", "lengths")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._done = False
        self.lengths: list[bytes] | None = None  # None: no final head read whole yet
        # The Content-Length values of this exchange's interim heads that carried more than
        # one, or one that is not a length (aiohttp's parser refuses them on any head).
        self.interim_lengths: list[bytes] = []

    def wrote(self) -> None:
        if self._done or self._buffer:
            self._buffer.clear()
            self._done = False
            self.lengths = None
            self.interim_lengths = []

    def read(self, data: bytes) -> None:
        if self._done or len(self._buffer) > _MAX_HEAD_READ:
            return  # the body, or a head h11 refuses anyway (over its 100 KiB)
        self._buffer += data
        while (end := _HEAD_END.search(self._buffer)) is not None:
            lines = bytes(self._buffer[: end.start()]).split(b"\n")
            del self._buffer[: end.end()]
            status = lines[0].split(b" ", 2)[1:2]
            lengths = [
                value.strip()
                for name, sep, value in (line.partition(b":") for line in lines[1:])
                if sep and name.lower() == b"content-length"
            ]
            if status and status[0].strip()[:1] == b"1" and status[0].strip() != b"101":
                # An interim answer: the final head follows.
                # The first such head's only: whether there was one is what is asked, and
                # an upstream sending interim heads without end grows nothing.
                if not self.interim_lengths and (
                    len(lengths) > 1 or (lengths and not lengths[0].isdigit())
                ):
                    self.interim_lengths = lengths
                continue
            self.lengths = lengths
            self._buffer.clear()
            self._done = True
            return


# h11's end of a head (a CRLF or a bare LF, then an empty line).
_HEAD_END = re.compile(rb"\n\r?\n")
_MAX_HEAD_READ = 128 * 1024


class RecordingStream(httpcore.AsyncNetworkStream):
    """A network stream whose response heads a HeadRecorder reads (TLS streams included:
    `start_tls` wraps what it returns)."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner
        self.heads = HeadRecorder()

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109 - httpcore's signature
        data = await self._inner.read(max_bytes, timeout)
        self.heads.read(data)
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109 - httpcore's signature
        self.heads.wrote()
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
    ) -> httpcore.AsyncNetworkStream:
        return RecordingStream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


def interim_lengths(stream: object) -> list[bytes]:
    """The repeated or invalid Content-Length values of the interim heads read on `stream`
    before its last final head (empty: none, or not a recording stream)."""
    return stream.heads.interim_lengths if isinstance(stream, RecordingStream) else []


def raw_lengths(stream: object) -> list[bytes] | None:
    """The Content-Length values of the last final head read on `stream`, as written (None:
    not a recording stream, or no head recorded)."""
    return stream.heads.lengths if isinstance(stream, RecordingStream) else None


class EarlyAnswerStream(RecordingStream):
    """A plain-TCP stream that stops sending once the upstream has answered with an error
    (RFC 9112 §9.5: a server may answer before the request body is complete, a 413 or a
    401, and close). httpcore sends the whole body before it reads, and its anyio stream
    does not read meanwhile: when the upstream closed, the failed write closed the
    transport with the answer unread, and the upstream's 413 became a transport failure
    on its breaker. Here each write first peeks at what has arrived: an error status
    (4xx, 5xx) or the upstream's end raises httpcore's WriteError before writing, which
    httpcore answers by reading the response. Any other early bytes (an interim 1xx, a
    2xx an upstream streams while it reads) leave the body going. TLS streams are not
    peeked (a TLS 1.3 server's session tickets arrive unasked), only recorded."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        super().__init__(inner)
        # asyncio hands out a TransportSocket, which cannot peek: the socket it wraps,
        # read defensively (another shape: no peeking, the body goes as before).
        raw = inner.get_extra_info("socket")
        # uvloop's (under `serve`) is a PseudoSocket: no peek, but its descriptor is
        # enough to tell whether an idle connection has something to read.
        self._polled: Any = raw if callable(getattr(raw, "fileno", None)) else None
        raw = getattr(raw, "_sock", raw)
        self._socket: socket.socket | None = raw if isinstance(raw, socket.socket) else None
        # uvloop's PseudoSocket cannot peek either: its descriptor is borrowed for each
        # peek (without it, under `serve`, every early answer became a transport failure).
        self._pseudo = self._polled if self._socket is None else None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109 - httpcore's signature
        self.heads.wrote()
        sock, pseudo = self._socket, self._pseudo
        if (sock is None and pseudo is None) or not buffer:
            await self._inner.write(buffer, timeout)
            return
        # In slices: a body buffered whole is one write, which an upstream that answered
        # and stopped reading would block until it closes.
        for start in range(0, len(buffer), _SLICE):
            if _answered_early(sock) if sock is not None else _answered_early_borrowed(pseudo):
                raise httpcore.WriteError("the upstream answered before the request was sent")
            await self._inner.write(buffer[start : start + _SLICE], timeout)

    def polled_fileno(self) -> int | None:
        """The descriptor httpcore's readability check polls (None: not known here)."""
        return None if self._polled is None else int(self._polled.fileno())

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable" and self._polled is not None:
            # Asked of every idle pooled connection each time a request enters the pool
            # or a response closes (httpcore's keep-alive check): the socket is at hand,
            # where anyio's answer builds its table of typed attributes for each ask.
            return is_socket_readable(self._polled)
        return self._inner.get_extra_info(info)


_STATUS_LINE = len(b"HTTP/1.1 4")
_SLICE = 64 * 1024
# The socket is non-blocking under asyncio already; MSG_DONTWAIT (not on Windows) says so
# again for a peek.
_PEEK = socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)


def _answered_early_borrowed(pseudo: Any) -> bool:
    """_answered_early on a socket-like object that cannot peek itself (uvloop's
    PseudoSocket): a socket object over its descriptor for the peek, detached after it
    (the descriptor stays the transport's, never closed here)."""
    fd = pseudo.fileno()
    if fd < 0:
        return True  # closed: the read that follows says so
    sock = socket.socket(pseudo.family, pseudo.type, pseudo.proto, fileno=fd)
    try:
        return _answered_early(sock)
    finally:
        sock.detach()


def _answered_early(sock: socket.socket) -> bool:
    """Whether the upstream has sent an error status line, or ended the connection, before
    the request was all sent (a peek: nothing is taken from the socket)."""
    try:
        head = sock.recv(_STATUS_LINE, _PEEK)
    except BlockingIOError:
        return False  # nothing yet: the usual case
    except OSError:
        return True  # reset: the read that follows says so
    if not head:
        return True  # the upstream closed: what it sent first is read
    return len(head) == _STATUS_LINE and head.startswith(b"HTTP/1.") and head[-1:] in b"45"
