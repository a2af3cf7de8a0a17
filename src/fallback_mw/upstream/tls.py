"""TLS for https:// upstreams, the same on both engines.

One `ssl.SSLContext` per CA bundle, built once and shared by every connection that uses
it: without a `ca_file`, Python's default context, which trusts the system's store (the
one OpenSSL's `SSL_CERT_FILE` / `SSL_CERT_DIR` variables replace, on both engines); with
one (under `[gateway]` or per upstream), exactly the CAs in that PEM bundle. Certificates
are verified and host names checked either way; nothing here turns verification off.

`is_certificate_error` tells a failed TLS exchange (failure kind `tls`) from other
transport errors, whatever the engine wrapped it in; `tls_problem` says what failed, in a
fixed phrase for the local error's message (never the peer's text): a certificate that
expired or names another host is not fixed by `ca_file`, and a server that speaks plain
HTTP or only TLS 1.0 / 1.1, or that asks for a client certificate (which TLS 1.3 reports on
the first read, after the handshake), has no certificate problem at all."""

from __future__ import annotations

import functools
import ssl

from fallback_mw.error_chain import error_chain


@functools.lru_cache(maxsize=64)
def ssl_context(ca_file: str | None) -> ssl.SSLContext:
    """The verifying client context for `ca_file` (None: the system's store). Both engines
    offer ALPN `http/1.1`, the one protocol they speak: httpcore set it on this shared
    context as it connected and aiohttp sent none, so an upstream that accepts only `h2`
    refused the httpx engine's handshake and served the aiohttp engine (or not, once the
    httpx engine had run in the process); it now refuses both, and the message says why."""
    if ca_file is None:
        context = ssl.create_default_context()
    else:
        context = ssl.create_default_context(cafile=ca_file)
    context.set_alpn_protocols(["http/1.1"])
    return context


def is_certificate_error(exc: BaseException) -> bool:
    """An ssl error anywhere in the exception's cause / context chain."""
    return _in_chain(exc, (ssl.SSLError, ssl.CertificateError))


# The engine error's own message for any `tls` failure (the detail says what failed).
TLS_FAILED = "the TLS exchange with the upstream failed"
# OpenSSL's verify codes (x509_vfy.h) the message tells apart; any other is "did not verify".
_EXPIRED = {9: "is not valid yet (check the clocks)", 10: "has expired (renew it on the upstream)"}
_OTHER_HOST = frozenset({62, 64})  # X509_V_ERR_HOSTNAME_MISMATCH, _IP_ADDRESS_MISMATCH
# OpenSSL's reason codes of a handshake the peer broke off, by what would change it.
_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "PACKET_LENGTH_TOO_LONG",
                      "RECORD_LAYER_FAILURE"})  # fmt: skip
_OLD_TLS = frozenset({"TLSV1_ALERT_PROTOCOL_VERSION", "UNSUPPORTED_PROTOCOL",
                      "NO_PROTOCOLS_AVAILABLE", "VERSION_TOO_LOW"})  # fmt: skip
_NO_PROTOCOL = "TLSV1_ALERT_NO_APPLICATION_PROTOCOL"
_CLIENT_CERTIFICATE = frozenset({"TLSV13_ALERT_CERTIFICATE_REQUIRED",
                                 "PEER_DID_NOT_RETURN_A_CERTIFICATE"})  # fmt: skip
_NOT_TLS_HINT = (
    "check the url's scheme and port (an https:// url for an upstream that speaks plain "
    "http, or another service's port)"
)


def tls_problem(exc: BaseException) -> str | None:
    """What failed in the TLS exchange, as a fixed phrase for the local error's message
    (what would change it included); None when no ssl error is in the chain."""
    found = _first_in_chain(exc, (ssl.SSLCertVerificationError, ssl.CertificateError))
    if found is not None:
        code = getattr(found, "verify_code", None)
        if code in _EXPIRED:
            return f"the upstream's TLS certificate {_EXPIRED[code]}; ca_file cannot change that"
        if code in _OTHER_HOST or not isinstance(found, ssl.SSLCertVerificationError):
            return (
                "the upstream's TLS certificate is not for the url's host: write the url "
                "with a host name (or IP address) the certificate names; ca_file cannot "
                "change that"
            )
        return (
            "the upstream's TLS certificate did not verify: set ca_file (under [gateway] "
            "or the upstream) to the CA that signed it"
        )
    error = _first_in_chain(exc, (ssl.SSLError,))
    if error is None:
        return None
    reason = getattr(error, "reason", None) or ""
    if reason in _OLD_TLS:
        return (
            "the upstream offers no TLS version the gateway accepts (TLS 1.2 or later): "
            "upgrade its TLS"
        )
    # Python names no reason for this alert: OpenSSL's own text says it.
    if reason == _NO_PROTOCOL or "alert no application protocol" in str(error):
        return (
            "the upstream accepts no application protocol the gateway speaks (ALPN: the "
            "gateway speaks HTTP/1.1 to upstreams; this one offers only another, such as "
            "HTTP/2 alone)"
        )
    if reason in _CLIENT_CERTIFICATE:
        return (
            "the upstream asks for a client certificate, which the gateway does not send: "
            "let it accept the gateway without one, or reach it through a proxy that holds one"
        )
    if isinstance(error, ssl.SSLEOFError):
        return HANDSHAKE_CLOSED
    if reason in _NOT_TLS or not reason:
        return (
            f"the TLS handshake with it failed before any certificate was checked: {_NOT_TLS_HINT}"
        )
    # An OpenSSL reason code (upper-case letters, digits, `_`), never a free text.
    named = reason if reason.replace("_", "").isalnum() else "unknown"
    return (
        f"the upstream refused the TLS handshake ({named}: no cipher in common, or a client "
        "certificate it asks for, which the gateway does not send)"
    )


def _first_in_chain(
    exc: BaseException, types: tuple[type[BaseException], ...]
) -> BaseException | None:
    return next((found for found in error_chain(exc) if isinstance(found, types)), None)


def closed_in_handshake(exc: BaseException) -> bool:
    """A connection the upstream reset or aborted while connecting an https:// url: it had
    accepted the TCP connection (a refusal is ConnectionRefusedError), so the TLS handshake
    is what it broke off (a server with nothing to offer the gateway's TLS, depending on
    timing, resets rather than answering with an alert)."""
    return _in_chain(exc, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError))


# A handshake the upstream broke off without saying why (a reset, an end of stream).
HANDSHAKE_CLOSED = (
    "the upstream closed the connection during the TLS handshake (a server speaking "
    "something else, or only TLS versions or ciphers the gateway does not offer): " + _NOT_TLS_HINT
)


def _in_chain(exc: BaseException, types: tuple[type[BaseException], ...]) -> bool:
    return _first_in_chain(exc, types) is not None
