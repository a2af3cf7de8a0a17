"""TLS for https:// upstreams, the same on both engines.

One `ssl.SSLContext` per CA bundle, built once and shared by every connection that uses
it: without a `ca_file`, Python's default context, which trusts the system's store (the
one OpenSSL's `SSL_CERT_FILE` / `SSL_CERT_DIR` variables replace, on both engines); with
one (under `[gateway]` or per upstream), exactly the CAs in that PEM bundle. Certificates
are verified and host names checked either way; nothing here turns verification off.

`is_certificate_error` tells a failed TLS handshake (failure kind `tls`) from other
transport errors, whatever the engine wrapped it in; `is_unverified_certificate` tells one
that failed on the certificate (ca_file would change it) from the rest (an https:// url
for a plain-HTTP upstream, nothing in common to negotiate), which the error message tells
apart."""

from __future__ import annotations

import functools
import ssl


@functools.lru_cache(maxsize=64)
def ssl_context(ca_file: str | None) -> ssl.SSLContext:
    """The verifying client context for `ca_file` (None: the system's store)."""
    if ca_file is None:
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=ca_file)


def is_certificate_error(exc: BaseException) -> bool:
    """An ssl error anywhere in the exception's cause / context chain."""
    return _in_chain(exc, (ssl.SSLError, ssl.CertificateError))


def is_unverified_certificate(exc: BaseException) -> bool:
    """A certificate that did not verify (or names another host) in the exception's chain."""
    return _in_chain(exc, (ssl.SSLCertVerificationError, ssl.CertificateError))


def _in_chain(exc: BaseException, types: tuple[type[BaseException], ...]) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, types):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False
