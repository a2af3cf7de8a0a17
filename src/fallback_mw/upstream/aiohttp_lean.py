"""The aiohttp engine's lean request: the usual attempt (a buffered body of at most
`ONE_WRITE_MAX`, no egress proxy, none of the fields aiohttp's request decides itself)
written and read over aiohttp's own connector, connection and parser, without its
`ClientRequest` and `ClientResponse`.

Those two objects are most of what aiohttp spends on a request beside its parser: some
dozen `update_*` steps, a `CIMultiDict` of the fields, two named tuples (the connection's
key, the request's info) and a `StreamWriter` to send; a response object, its cookies and
its writer bookkeeping to read. Here the request's head is the same bytes aiohttp writes
for it (`Host` first, the fields in order, `Content-Length` last; pinned against
`ClientSession.request` by tests/test_aiohttp_request_path.py), written with its body in
one transport write; the answer is the parser's message and payload, and `LeanResponse`
gives the connection back to the pool when the body ends, as `ClientResponse` does.

What `connector.connect` reads of a request (its key, host, port, TLS setting) is a
`Target`, made once per origin and TLS setting (`targets`). The pool's usual steps, taking
its next kept-alive connection and giving it back, are done here (`take`, `give_back`,
`Pooled`: aiohttp's `connect`, `_get`, `Connection` and `_release` are some ten
interpreted calls an attempt); an empty pool, a stale connection, a wait for a slot or a
closing connector go through aiohttp's own methods, as before. Anything else (a streamed or
larger body, a proxy, a `Host`, `Content-Length`, `Transfer-Encoding`, `Connection`,
`Expect` or `Content-Encoding` field, another method, credentials in the URL) goes through
aiohttp_request's `OneWriteRequest`, as before. Errors are aiohttp's own, raised where its
request raises them, so aiohttp_errors.raise_mapped reads them as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from time import monotonic
from typing import Any, Final, Protocol

import aiohttp
from aiohttp.client_exceptions import ClientConnectionResetError, ClientResponseError
from aiohttp.client_reqrep import ConnectionKey, RequestInfo
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

# The largest body written with the head, here and by aiohttp_request's OneWriteRequest.
ONE_WRITE_MAX: Final = 16 * 1024
# aiohttp's GET_METHODS: no Content-Length: 0 for an empty body of these.
_NO_EMPTY_LENGTH: Final = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
_LEAN_METHODS: Final = frozenset(
    {"GET", "HEAD", "OPTIONS", "TRACE", "POST", "PUT", "PATCH", "DELETE"}
)
# Fields aiohttp's request decides or reads itself (the Host it replaces in place, a length
# or coding it frames the body by, a 100-continue it waits for): a request with one goes
# through OneWriteRequest. Only these lengths are lowercased and looked up.
_DECIDED: Final = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "expect", "content-encoding"}
)
_DECIDED_LENGTHS: Final = frozenset(len(name) for name in _DECIDED)
_CONNECTION_CLOSED: Final = aiohttp.ClientConnectionError("Connection closed")


class Answer(Protocol):
    """What the engine reads of an answer: aiohttp's ClientResponse or a LeanResponse."""

    method: str
    status: int
    content: aiohttp.StreamReader

    @property
    def raw_headers(self) -> Any: ...

    @property
    def _protocol(self) -> Any: ...

    def release(self) -> Any: ...

    def close(self) -> None: ...


class Target:
    """What aiohttp's connector reads of a request to connect it (and to word a failure to
    connect), for one origin and TLS setting."""

    def __init__(self, url: URL, ssl: Any) -> None:
        self.url = url
        self.ssl = ssl
        self.proxy: URL | None = None
        self.proxy_auth: Any = None
        self.proxy_headers: Any = None
        self.server_hostname: str | None = None
        self.method = "GET"
        host = url.raw_host
        self.host: str = host or ""
        self.port: int | None = url.port
        self._is_ssl = url.scheme in ("https", "wss")
        # Seven fields, as aiohttp 3.14.0 has them; a later 3.14's eighth (server_hostname)
        # takes its default, None, as ClientRequest's key has it for the engine's requests.
        self.connection_key = ConnectionKey(
            self.host, self.port, self._is_ssl, ssl, None, None, None
        )
        self.host_field = f"Host: {url.host_port_subcomponent}\r\n"

    def is_ssl(self) -> bool:
        return self._is_ssl

    @property
    def request_info(self) -> RequestInfo:
        return RequestInfo(self.url, self.method, CIMultiDictProxy(CIMultiDict()), self.url)


def target(
    targets: dict[tuple[str, int | None, str, Any], Target], url: URL, ssl: Any
) -> Target | None:
    """The Target of `url`'s origin under `ssl` (kept in `targets`, at most 256), None for a
    URL the lean request does not send (no host, credentials in it)."""
    key = (url.raw_host or "", url.port, url.scheme, ssl)
    found = targets.get(key)
    if found is None:
        if not url.raw_host or url.raw_user is not None or url.raw_password is not None:
            return None
        found = Target(url, ssl)
        if len(targets) < 256:
            targets[key] = found
    return found


def eligible(method: str, headers: Sequence[tuple[str, str]]) -> bool:
    """Whether the lean request sends an attempt of this method and these fields (else
    OneWriteRequest); its body, bytes of at most ONE_WRITE_MAX, the engine has asked."""
    if method not in _LEAN_METHODS:
        return False
    lengths = _DECIDED_LENGTHS
    for name, _ in headers:  # noqa: SIM110 (compiled, a loop; `all` would make a generator)
        if len(name) in lengths and name.lower() in _DECIDED:
            return False
    return True


def head(
    method: str, url: URL, host_field: str, headers: Sequence[tuple[str, str]], body: bytes | None
) -> bytes:
    """The request's head and body as aiohttp writes them (ClientRequest.send)."""
    parts = [f"{method} {url.raw_path_qs} HTTP/1.1\r\n", host_field]
    for name, value in headers:
        parts.append(f"{name}: {value}\r\n")
    if body:
        parts.append(f"Content-Length: {len(body)}\r\n\r\n")
        return "".join(parts).encode() + body
    parts.append("\r\n" if method in _NO_EMPTY_LENGTH else "Content-Length: 0\r\n\r\n")
    return "".join(parts).encode()


class LeanResponse:
    """An answer read by the lean request: its status, raw fields and payload, and its
    connection, given back to the pool when the body ends (`_response_eof`), closed when
    the answer is closed before it (`close`), as ClientResponse does."""

    def __init__(
        self,
        method: str,
        connection: Pooled,
        protocol: Any,
        message: Any,
        payload: aiohttp.StreamReader,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.method = method
        self.status: int = message.code
        self.raw_headers: Any = message.raw_headers
        self.content = payload
        self._protocol: Any = protocol
        self._connection: Pooled | None = connection
        self._loop = loop
        self._closed = False
        self._released = False
        payload.on_eof(self._response_eof)

    def _response_eof(self) -> None:
        if self._closed:
            return
        connection = self._connection
        protocol = None if connection is None else connection.protocol
        if protocol is not None and protocol.upgraded:
            return
        self._closed = True
        self._release_connection()

    def _release_connection(self) -> None:
        connection = self._connection
        if connection is not None:
            self._connection = None
            connection.release()

    def _notify_content(self) -> None:
        content = self.content
        if content.exception() is None:
            content.set_exception(_CONNECTION_CLOSED)
        self._released = True

    def release(self) -> None:
        if not self._released:
            self._notify_content()
        self._closed = True
        self._release_connection()

    def close(self) -> None:
        if not self._released:
            self._notify_content()
        self._closed = True
        if self._loop.is_closed():
            return
        connection = self._connection
        if connection is not None:
            self._connection = None
            connection.close()

    def __del__(self) -> None:
        # Dropped unclosed (a cancellation between send and its owner): the connection is
        # given back, closed unless its answer was read whole (Connection.release).
        if not self._closed:
            self._release_connection()


class Pooled:
    """A connection of aiohttp's pool as the lean request holds it: what aiohttp's
    `Connection` does for it (give it back to the pool, or close it), the pool's usual
    steps done here (`take`, `give_back`) and any other through aiohttp's own methods."""

    def __init__(self, connector: Any, key: Any, protocol: Any) -> None:
        self._connector = connector
        self._key = key
        self.protocol: Any = protocol

    def release(self) -> None:
        protocol = self.protocol
        if protocol is not None:
            self.protocol = None
            give_back(self._connector, self._key, protocol, False)

    def close(self) -> None:
        protocol = self.protocol
        if protocol is not None:
            self.protocol = None
            give_back(self._connector, self._key, protocol, True)

    def __del__(self) -> None:
        # Dropped still holding it (as aiohttp's Connection.__del__): closed, so that its
        # slot under the connector's limit is not held for good.
        if self.protocol is not None and not self._connector._loop.is_closed():
            self.close()


def take(connector: Any, key: Any) -> Any:
    """The protocol of the kept-alive connection aiohttp's `_get` would hand out next for
    `key`, taken from the pool (None: the pool has none, or its next one is stale, timed
    out or holds something unread, which `connector.connect` closes and replaces)."""
    if connector._closed or connector._limit_per_host:
        return None
    conns = connector._conns.get(key)
    if not conns:
        return None
    protocol, since = conns[0]
    keepalive = connector._keepalive_timeout
    if (
        not protocol.is_connected()
        or (keepalive is not None and monotonic() - since > keepalive)
        or protocol.should_close
    ):
        return None
    conns.popleft()
    if not conns:
        del connector._conns[key]  # as _get: an emptied key is dropped
    connector._acquired.add(protocol)
    return protocol


def give_back(connector: Any, key: Any, protocol: Any, close: bool) -> None:
    """`connector._release(key, protocol, should_close=close)`, its usual case (kept alive,
    nobody waiting for a slot, the pool's cleanup timer armed) done here."""
    if (
        close
        or connector._closed
        or connector._waiters
        or connector._force_close
        or connector._limit_per_host
        or connector._cleanup_handle is None
        or protocol.should_close
    ):
        connector._release(key, protocol, should_close=close)
        return
    connector._acquired.discard(protocol)
    connector._conns[key].append((protocol, monotonic()))


async def _connect(
    connector: Any, target_: Target, client_timeout: aiohttp.ClientTimeout, sending: Any
) -> Pooled:
    """A connection for `target_`: a kept-alive one from the pool (`take`; the first-byte
    timer armed and the send marked not fresh, as GuardedConnector.connect does), else
    aiohttp's `connector.connect` (waiting for a slot, connecting, the guard)."""
    key = target_.connection_key
    protocol = take(connector, key)
    if protocol is not None:
        sending.fresh = False
        sending.timer.arm()
        return Pooled(connector, key, protocol)
    try:
        connection = await connector.connect(target_, [], client_timeout)
    except TimeoutError as exc:
        raise aiohttp.ConnectionTimeoutError("Connection timeout to host") from exc
    except OSError as exc:
        if _as_it_is(exc):
            raise exc
        raise aiohttp.ClientOSError(*exc.args) from exc
    protocol = connection._protocol
    connection._protocol = None  # held by the Pooled now (its __del__ finds nothing)
    return Pooled(connector, key, protocol)


async def request(
    connector: Any,
    target_: Target,
    method: str,
    url: URL,
    headers: Sequence[tuple[str, str]],
    body: bytes | None,
    client_timeout: aiohttp.ClientTimeout,
    response_params: dict[str, Any],
    loop: asyncio.AbstractEventLoop,
    sending: Any,
) -> LeanResponse:
    """The attempt sent and its answer's head read, as aiohttp_request.request does through
    OneWriteRequest; raises what that raises for the same failure. `sending`: the engine's
    aiohttp_connector.Sending for it."""
    conn = await _connect(connector, target_, client_timeout, sending)
    protocol = conn.protocol
    try:
        protocol.set_response_params(skip_payload=method == "HEAD", **response_params)
        transport = protocol.transport
        if transport is None or transport.is_closing():
            raise ClientConnectionResetError("Cannot write to closing transport")
        transport.write(head(method, url, target_.host_field, headers, body))
        protocol.start_timeout()
        while True:
            try:
                message, payload = await protocol.read()
            except HttpProcessingError as exc:
                raise ClientResponseError(
                    RequestInfo(url, method, CIMultiDictProxy(CIMultiDict(headers)), url),
                    (),
                    status=exc.code,
                    message=exc.message,
                    headers=exc.headers,
                ) from exc
            code = message.code
            if code < 100 or code > 199 or code == 101:
                break
    except BaseException as exc:
        conn.close()
        if isinstance(exc, OSError) and not _as_it_is(exc):
            raise aiohttp.ClientOSError(*exc.args) from exc
        raise exc
    return LeanResponse(method, conn, protocol, message, payload, loop)


def _as_it_is(exc: OSError) -> bool:
    """Whether an OSError leaves the request as it is (aiohttp's own, a timeout), as
    `ClientSession._request` raises it; any other is raised as ClientOSError."""
    return isinstance(exc, aiohttp.ClientError) or (
        exc.errno is None and isinstance(exc, asyncio.TimeoutError)
    )
