"""aiohttp's exceptions read as the engine seam's (upstream/base.py): which phase an error
arose in, a certificate that does not verify named as `tls`, what the client library
refused to send as local."""

from __future__ import annotations

import ssl
from typing import Any, cast

import aiohttp

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
    is_certificate_error,
    tls_problem,
)


def raise_mapped(phase: Phase, exc: Exception) -> None:
    """The one place aiohttp's exceptions become failure kinds: raises the UpstreamError
    `exc`, raised during `phase`, stands for; returns for what passes as it is (a
    UpstreamError, what no rule names), which the caller re-raises; a cancellation is no
    `Exception` and never comes here. The
    engine calls it from `except Exception`, not a `with` scope: a try costs nothing
    while nothing is raised, and the engine enters one several times per request."""
    if isinstance(exc, UpstreamError):
        return  # as it is
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


def answer_began(error: UpstreamError) -> bool:
    """Whether the connection a send failed on had received bytes of an answer before it
    ended (a status line or head cut short): the upstream took the request and began to
    answer, so it was not lost unanswered, and is not sent again (resend_on_new_connection;
    the httpx engine names such bytes a parser refusal). aiohttp's ServerDisconnectedError
    carries the message its parser had begun then (its own words when no byte came)."""
    lost = error.__context__
    if not isinstance(lost, aiohttp.ServerDisconnectedError):
        return False
    # Read untyped: aiohttp types it `RawResponseMessage | str | None`, a NamedTuple its C
    # parser's message is not (compiled, mypyc checked it for a tuple: a TypeError).
    message: object = cast(Any, lost).message
    return not isinstance(message, str | None)
