"""httpx's and httpcore's exceptions read as the engine seam's (upstream/base.py): which
phase an error arose in, whether anything was sent or arrived, whether the client library
refused it locally; and httpx's own log records kept out of the gateway's log."""

from __future__ import annotations

import contextvars
import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from fallback_mw.extras import missing_extra

try:
    import h11
    import httpcore
    import httpx
except ImportError:
    raise missing_extra("httpx", 'engine = "httpx"') from None
from fallback_mw.upstream.base import (
    NOT_HTTP,
    Phase,
    UpstreamError,
    host_limit,
    proxy_refused,
)
from fallback_mw.upstream.guard import UnsafeAddressError
from fallback_mw.upstream.tls import (
    HANDSHAKE_CLOSED,
    TLS_FAILED,
    closed_in_handshake,
    tls_problem,
)

# httpx logs each request's full URL, query string included (INFO), and httpcore logs
# response header values (DEBUG). Neither may be recorded for the gateway's upstream calls,
# so records emitted while this engine is working are dropped; other httpx use in the host
# process logs as before.
ENGINE_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar(
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
        return not ENGINE_ACTIVE.get()


_DROP_ENGINE_RECORDS = _DropEngineRecords()


def silence_engine_logs() -> None:
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


def nothing_arrived(exc: BaseException) -> bool:
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
    token = ENGINE_ACTIVE.set(True)
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
        if tls is None and https(exc) and closed_in_handshake(exc):
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
        if str(exc) == _CLOSED_UNANSWERED and nothing_arrived(exc):
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
        ENGINE_ACTIVE.reset(token)


def https(exc: httpx.RequestError) -> bool:
    try:
        return exc.request.url.scheme == "https"
    except RuntimeError:  # no request attached: say nothing more precise
        return False


def is_connect(info: object) -> bool:
    """Whether a trace event is about httpcore's CONNECT request to an egress proxy."""
    request = info.get("request") if isinstance(info, dict) else None
    return getattr(request, "method", None) == b"CONNECT"
