"""The aiohttp engine's request path: what `ClientSession.request` does for the engine's
requests, without what the engine never asks of it.

`ClientSession._request` is some hundred lines of interpreted Python per request (cookies,
redirects, netrc, trace hooks, client middlewares, auth, an upload tracker, a total
timeout), all off for the engine's session; and, on Python below 3.12, every request with a
body has its body written by a task of its own (`ClientRequest.write_bytes`), one more
task scheduled, run and finished per attempt. Here the engine builds aiohttp's own
`ClientRequest`, takes a connection from its own connector, and has its own
`send` and `ClientResponse.start` write the request and read the answer's head, as
`_request` does; a small buffered body is written with the head, in the same transport
write, without that task (`OneWriteRequest`).

What it leaves out, each off for the engine's session (AiohttpClient._get_session): the
cookie jar (a DummyCookieJar), redirects (allow_redirects=False), auth and netrc
(trust_env off, no `auth`), trace configs and middlewares (none), aiohttp's own resend of a
lost request (`_retry_connection` off: the engine resends, `send`), a total timeout (None).
The errors are aiohttp's own, raised as `_request` raises them (`request`), so
aiohttp_errors.raise_mapped reads them as before.

It reads aiohttp's private names (ClientSession's settings, the connector's ceiling
threshold, `ClientRequest._body`...), read against aiohttp 3.14: under another release
the engine keeps `ClientSession.request` (`supported()`).
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Iterable
from typing import Any, Final, cast

import aiohttp
from aiohttp import hdrs, payload
from aiohttp.client_exceptions import ClientError, ClientOSError, ConnectionTimeoutError
from aiohttp.client_reqrep import ClientRequest, ClientResponse
from aiohttp.helpers import TimerNoop
from aiohttp.http_writer import StreamWriter
from multidict import CIMultiDict
from yarl import URL

from fallback_mw.upstream import aiohttp_lean

# The aiohttp releases whose request path this module was read against: under another,
# AiohttpClient keeps ClientSession.request (`supported`).
_READ_AGAINST: Final = "3.14."
_ON: dict[str, bool] = {"path": aiohttp.__version__.startswith(_READ_AGAINST)}

# The largest body written with the head (`OneWriteRequest`, aiohttp_lean): far below the
# writer's drain threshold (64 KiB), so writing it never waits on the upstream reading; a
# larger one is written by aiohttp's writer task, as before, and an upstream that answers
# before reading it all (a 413) is still read.
ONE_WRITE_MAX: Final = aiohttp_lean.ONE_WRITE_MAX
_NO_TIMER: Final = TimerNoop()
# aiohttp would otherwise add these (User-Agent, Accept, Accept-Encoding; Content-Type to a
# POST without one); the upstream sees only what the gateway decided. The engine's session
# skips them (AiohttpClient._get_session), and its own request the same (`OneWriteRequest`).
SKIP_AUTO_HEADERS: Final = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")
_SKIPPED: Final = CIMultiDict[None]((name, None) for name in sorted(SKIP_AUTO_HEADERS))
_HEAD_ONLY: Final = frozenset({hdrs.METH_HEAD})


def supported() -> bool:
    """Whether the engine takes this path (the installed aiohttp is one it was read
    against); tests switch it off with `use(False)` to run the engine on
    ClientSession.request, the path for any other release."""
    return _ON["path"]


def use(on: bool) -> None:
    _ON["path"] = on


_LARGE_BYTES: Final = 1 << 20  # aiohttp's TOO_LARGE_BYTES_BODY


def bytes_data(body: bytes) -> Any:
    """A buffered body as the engine hands it to aiohttp: None when empty; over 1 MiB (a
    `replay_buffer` raised above its default) wrapped as aiohttp would wrap it, without its
    ResourceWarning ("might lock the event loop": the body is already in memory, and one
    transport write copies it). A host that runs with warnings as errors (its test suite)
    had the request end in that warning, raised out of the gateway. Constructing the
    payload does not await: no other task sees the filter."""
    if len(body) <= _LARGE_BYTES:
        return body or None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        return payload.BytesPayload(body)


class OneWriteRequest(ClientRequest):
    """aiohttp's request, whose small buffered body (bytes, at most ONE_WRITE_MAX) is
    written with its head in one transport write from `send` itself, as aiohttp does on
    Python 3.12 and later (an eagerly started writer task): no task per request. Anything
    else (a streamed body, a larger one, a proxy's absolute-form target, `Expect:
    100-continue`, a paused transport) is sent by aiohttp's own `send`."""

    def update_auto_headers(self, skip_auto_headers: Iterable[str] | None) -> None:
        # Every header aiohttp adds is skipped (SKIP_AUTO_HEADERS): none is added, and the
        # skipped names are one table, not one built and sorted per request.
        self._skip_auto_headers = _SKIPPED

    _one_write: bytes | None = None  # the body `send` writes with the head

    def update_body_from_data(self, body: Any, _stacklevel: int = 3) -> None:
        if type(body) is not bytes or not body or len(body) > ONE_WRITE_MAX:
            self._one_write = None
            super().update_body_from_data(body, _stacklevel=_stacklevel + 1)
            return
        # Kept as the bytes it is: the BytesPayload aiohttp would find for it through its
        # payload registry is made only if aiohttp's own `send` takes the request. Its
        # Content-Type is one of the skipped headers, so only its length reaches the head.
        self._body = None
        self._one_write = body
        if not self.chunked and hdrs.CONTENT_LENGTH not in self.headers:
            self.headers[hdrs.CONTENT_LENGTH] = str(len(body))

    async def send(self, conn: Any) -> ClientResponse:
        body = self._one_write
        protocol = conn.protocol
        if body is None:
            return await super().send(conn)
        if (
            protocol is None
            or protocol.writing_paused
            or self._continue is not None
            or self.proxy is not None
            or self.method == hdrs.METH_CONNECT
            or self.compress
            or self.chunked is not None
            or conn._connector.force_close
        ):
            self._body, self._one_write = payload.BytesPayload(body), None
            return await super().send(conn)
        if (
            self.method in self.POST_METHODS
            and hdrs.CONTENT_TYPE not in (self._skip_auto_headers or ())
            and hdrs.CONTENT_TYPE not in self.headers
        ):
            self.headers[hdrs.CONTENT_TYPE] = "application/octet-stream"  # as aiohttp's send
        writer = StreamWriter(protocol, self.loop)
        version = self.version
        await writer.write_headers(
            f"{self.method} {self.url.raw_path_qs} HTTP/{version.major}.{version.minor}",
            self.headers,
        )
        try:
            # Neither await suspends: the body is below the writer's drain threshold. At
            # most its Content-Length is written, as BytesPayload.write_with_length does.
            length = self._get_content_length()
            await writer.write(body if length is None else body[:length])
            await writer.write_eof()
        except OSError as exc:
            # As aiohttp's writer task words it (write_bytes), raised here instead of
            # through the connection: the head was not read yet.
            if exc.errno is None and isinstance(exc, asyncio.TimeoutError):
                raise
            raise ClientOSError(exc.errno, "Can not write request body") from exc
        except ClientError:
            raise
        except Exception as exc:
            raise aiohttp.ClientConnectionError(
                f"Failed to send bytes into the underlying connection: {type(exc).__name__}"
            ) from exc
        protocol.start_timeout()
        response = self.response_class(
            self.method,
            self.original_url,
            writer=None,
            continue100=None,
            timer=self._timer,
            request_info=self.request_info,
            traces=self._traces,
            loop=self.loop,
            session=self._session,
            stream_writer=writer,
        )
        # aiohttp (3.14.5) declares the attribute `response = None`, untyped, which mypy
        # reads as None alone: set through Any, as aiohttp's own send sets it.
        cast(Any, self).response = response
        return response


def response_params(
    session: aiohttp.ClientSession, read_timeout: float | None = None
) -> dict[str, Any]:
    """What the connection's protocol is told of the answer to read (`set_response_params`,
    as `ClientSession._request` tells it), but whether to skip a payload: for `request`
    per attempt; for the lean request (aiohttp_lean) once per session, the engine's
    timeouts never setting `sock_read` (it times the head and the body itself)."""
    connector: Any = session.connector
    return {
        "timer": _NO_TIMER,
        "read_until_eof": True,
        "auto_decompress": session._auto_decompress,
        "read_timeout": read_timeout,
        "read_bufsize": session._read_bufsize,
        "timeout_ceil_threshold": connector._timeout_ceil_threshold,
        "max_line_size": session._max_line_size,
        "max_field_size": session._max_field_size,
        "max_headers": session._max_headers,
    }


async def request(
    session: aiohttp.ClientSession,
    method: str,
    url: URL,
    *,
    headers: list[tuple[str, str]],
    data: Any,
    client_timeout: aiohttp.ClientTimeout,
    ssl: Any,
    proxy: str | None,
) -> ClientResponse:
    """The engine's one request through aiohttp: what `session.request(method, url, ...)`
    does for the engine's session (no redirect followed, no cookies, auth, traces or
    middlewares), the answer with its head read, or the exception `ClientSession._request`
    raises for the same failure; under an aiohttp release this path was not read against
    (`supported`), `session.request` itself, with the same settings."""
    if not _ON["path"]:
        return await session.request(
            method,
            url,
            headers=CIMultiDict(headers),
            data=data,
            allow_redirects=False,
            timeout=client_timeout,
            ssl=ssl,
            proxy=proxy,
        )
    connector: Any = session.connector
    if session.closed or connector is None:
        raise RuntimeError("Session is closed")
    req = OneWriteRequest(
        method,
        url,
        headers=headers,
        skip_auto_headers=None,  # SKIP_AUTO_HEADERS: OneWriteRequest.update_auto_headers
        data=data,
        loop=session._loop,
        response_class=session._response_class,
        proxy=None if proxy is None else URL(proxy),
        timer=_NO_TIMER,
        session=session,
        ssl=ssl,
        traces=[],
    )
    response: ClientResponse | None = None
    try:
        try:
            try:
                conn = await connector.connect(req, traces=[], timeout=client_timeout)
            except TimeoutError as exc:
                raise ConnectionTimeoutError("Connection timeout to host") from exc
            conn.protocol.set_response_params(
                skip_payload=req.method in _HEAD_ONLY,
                **response_params(session, client_timeout.sock_read),
            )
            try:
                response = await req.send(conn)
                try:
                    await response.start(conn)
                except BaseException:
                    response.close()
                    raise
            except BaseException:
                conn.close()
                raise
        except ClientError:
            raise
        except OSError as exc:
            if exc.errno is None and isinstance(exc, asyncio.TimeoutError):
                raise
            raise ClientOSError(*exc.args) from exc
        if req._body is not None:
            await req._body.close()
    except BaseException:
        if response is not None:
            response.close()
        if req._body is not None:
            await req._body.close()
        raise
    return response
