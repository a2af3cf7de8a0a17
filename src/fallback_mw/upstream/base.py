"""The upstream client seam: one method to send a request and get a response head, a
response object that yields the body chunk by chunk, and one place per engine that turns
low-level errors into failure kinds."""

from __future__ import annotations

import asyncio
import errno
import operator
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final, Literal, Protocol

from fallback_mw.error_chain import error_chain
from fallback_mw.security.fields import name_forms
from fallback_mw.security.values import (
    MAX_CACHED,
    VALUE_CTL,
    is_field_name,
    is_token,
    only,
)
from fallback_mw.timers import Deadline
from fallback_mw.upstream.outgoing import Timeouts as Timeouts  # re-exported
from fallback_mw.upstream.outgoing import UpstreamRequest as UpstreamRequest  # re-exported
from fallback_mw.upstream.timed_body import TimedBody

# "local": the client library refused to build or send the request (a header value, a
# URL, an encoding): nothing reached the upstream, so it is never the upstream's failure.
# "host_limit": the gateway's own host had no file descriptor, socket memory or local port
# for the connection (EMFILE under `ulimit -n`, ...): nothing was sent, never the upstream's.
# "tls": the TLS handshake failed (a certificate that does not verify, SPEC §12): the
# upstream's failure like any transport error, named as what it is.
FailureKind = Literal[
    "transport", "timeout", "refused", "unsafe_address", "protocol", "local", "tls", "host_limit"
]
Phase = Literal["connect", "first_byte", "body"]


class UpstreamError(Exception):
    """An attempt failed below HTTP. `kind` is what the walker and telemetry see; the
    message never contains a URL query, header value or body."""

    def __init__(
        self, kind: FailureKind, phase: Phase, message: str = "", *, detail: str | None = None
    ) -> None:
        super().__init__(message or f"{kind} during {phase}")
        self.kind: FailureKind = kind
        self.phase: Phase = phase
        # What failed and what would change it, a fixed phrase for the local error's
        # message: for kind "tls" (upstream/tls.tls_problem) an untrusted CA (ca_file), an
        # expired certificate or one for another host (not ca_file), a plain-HTTP upstream
        # behind an https:// url; an egress proxy that refused the tunnel.
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        # Made again from all it holds (pickle, copy): Exception's own passes `args` alone,
        # the message, and `phase` is required.
        return (_rebuilt, (self.kind, self.phase, str(self), self.detail), self.__dict__)

    @property
    def telemetry_kind(self) -> str:
        # SPEC §9 vocabulary: timeouts are "timeout", a failed TLS handshake "tls",
        # everything else below HTTP "transport".
        return self.kind if self.kind in ("timeout", "tls") else "transport"


def _rebuilt(kind: FailureKind, phase: Phase, message: str, detail: str | None) -> UpstreamError:
    return UpstreamError(kind, phase, message, detail=detail)


# What each errno of the gateway's own host lacking a resource says it ran out of.
_HOST_LIMITS: Final = {
    errno.EMFILE: "out of file descriptors (EMFILE: the process's open-file limit)",
    errno.ENFILE: "out of file descriptors (ENFILE: the system's open-file table)",
    errno.ENOBUFS: "out of socket buffer memory (ENOBUFS)",
    errno.ENOMEM: "out of memory (ENOMEM)",
    # Also an address this host has no route of its own to (an IPv6 literal, IPv6 off).
    errno.EADDRNOTAVAIL: "out of local ports, or no local address to reach it from (EADDRNOTAVAIL)",
}


def host_limit(exc: BaseException, phase: Phase) -> UpstreamError | None:
    """The engine error for a connection the gateway's own host could not open (an
    `OSError` with one of _HOST_LIMITS' errnos, wrapped or not), None for anything else."""
    for current in error_chain(exc):
        wrapped = getattr(current, "os_error", None)  # aiohttp's ClientConnectorError
        for error in (current, wrapped):
            if isinstance(error, OSError) and error.errno in _HOST_LIMITS:
                lacking = _HOST_LIMITS[error.errno]
                return UpstreamError("host_limit", phase, lacking, detail=lacking)
    return None


def unrelayable(reason: str) -> UpstreamError:
    """An answer the relay cannot carry (failover-class, SPEC §12), its `reason` (a fixed
    phrase, never the upstream's bytes) named in the local 502 when the walk ends on it."""
    return UpstreamError("protocol", "first_byte", reason, detail=reason)


# What the local 502 says of an answer the engine's own parser refused (a status line that
# is none, HTTP/0.9, framing its parser cannot read): never the parser's text, which may
# quote the upstream's bytes.
NOT_HTTP: Final = "the engine's HTTP/1.1 parser refused the upstream's answer"


def proxy_refused(status: int | None, *, tunnel: bool = True) -> str:
    """The local error's phrase for an egress proxy that answered CONNECT with an error
    (`tunnel`), or an http:// upstream's request with its own 407."""
    answered = f" ({status})" if status is not None else ""
    what = "the tunnel to it" if tunnel else "to forward the request to it"
    return (
        f"the egress proxy refused {what}{answered}: check that the proxy allows "
        "and can reach this host and port (the gateway sends a proxy no credentials)"
    )


def check_proxy_answer(status: int, proxy: str | None) -> None:
    """An http:// upstream behind an egress `proxy` is asked in absolute form, so the
    proxy's own refusal comes back as the answer: a 407 is the proxy's alone (it wants
    credentials the gateway never sends it). Relayed, the caller got the proxy's page as
    the upstream's answer, and a client behind a proxy of its own read it as a demand for
    that one's credentials. It is the upstream's transport failure, as a refused tunnel
    is for an https:// one. Raises UpstreamError("transport")."""
    if status == 407 and proxy is not None:
        refused = proxy_refused(status, tunnel=False)
        raise UpstreamError("transport", "first_byte", refused, detail=refused)


def check_request_headers(headers: Sequence[tuple[str, str]]) -> None:
    """Refuse, before a connection is used, a header no engine may put on the wire (a
    credential variable changed under a running gateway to `key\\n`...). Raises the local
    UpstreamError (never the upstream's failure, never the engine's ValueError, which would
    be a bare 500). Caller headers were held to the same rule before the walk
    (security.request_header_problem): this is defence in depth."""
    for name, value in headers:
        # A caller's long name is checked uncached (`security.MAX_CACHED`).
        token = is_field_name(name) if len(name) <= MAX_CACHED else is_token(name)
        # The usual value in C: printable text has no control character, HTAB or
        # surrogate, so only a SP at either end is left to look for; the expression
        # (about a microsecond a field, every field of every attempt) for the rest.
        if value.isprintable():
            forbidden = value[:1] == " " or value[-1:] == " "
        else:
            forbidden = _FORBIDDEN_IN_VALUE.search(value) is not None
        if not token or forbidden:
            raise UpstreamError("local", "connect", "invalid request header")


def encode_request_headers(headers: Sequence[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """The bytes both engines put on the wire: aiohttp writes header text as UTF-8, so the
    httpx engine sends the same bytes (a caller's UTF-8 value goes out byte for byte)."""
    return [(name.encode("ascii"), value.encode("utf-8")) for name, value in headers]


# CTLs but HTAB, surrogates (bytes that were not UTF-8), leading or trailing whitespace.
_FORBIDDEN_IN_VALUE: Final = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\ud800-\udfff]|^[ \t]|[ \t]$")


# The largest response head relayed, its fields counted as written: the httpx engine's own
# bound (h11's, as httpcore sets it), so both engines agree. aiohttp bounds each field and
# their number, not their sum: a head of 120 fields of 60 KB (7 MB) was relayed, and a
# client with h11's or a browser's bound could not read the answer the gateway booked as
# served.
MAX_RESPONSE_HEAD: Final = 100 * 1024

# The most fields a relayed head has, and the longest field (name and value): aiohttp's
# bounds (its count, and the field length the aiohttp engine sets), held on the httpx
# engine too, so one answer is not served by one engine and failed over by the other.
MAX_RESPONSE_FIELDS: Final = 128
MAX_RESPONSE_FIELD: Final = 64 * 1024


# The most digits a relayed Content-Length may have: h11's bound (the httpx engine, and
# uvicorn and hypercorn writing the relayed head). Every length up to it is read exactly
# (request.body.content_length), 10**19 bytes included.
MAX_LENGTH_DIGITS: Final = 20


# What no server writes in a field value (RFC 9110 §5.5; uvicorn's and h11's own checks):
# VALUE_CTL, the caller's headers' rule. A table keeping every other byte (`only`).
_NO_CTL_IN_VALUE: Final = only(frozenset(range(256)) - VALUE_CTL)
# The ends of a field name only aiohttp's parser lets through (whitespace before the colon).
_SPACE: Final = frozenset(b" \t")


def ascii_target(url: str) -> str:
    """Bytes >= 0x80 a client sent raw in the query (carried as latin-1 text) go out as
    %XX of that same byte; everything already ASCII is left exactly as it is. Both engines
    send this: httpx encoded each such character's UTF-8 again (`€` as `%C3%A2%C2%82%C2%AC`)."""
    if url.isascii():
        return url
    return "".join(c if c.isascii() else f"%{ord(c) & 0xFF:02X}" for c in url)


def check_response_head(
    status: int, headers: Sequence[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    """A response head the relay cannot carry is the upstream's failure (failover-class,
    SPEC §12): a status outside 100-599, a 1xx as the final answer, or contradictory
    framing (Content-Length with Transfer-Encoding, repeated or invalid lengths, a length
    or a chunked body on 204, a length on 205), a transfer coding other than `chunked`
    (`gzip, chunked`: the relay re-frames the body and would hand on coded bytes
    unlabelled), a field
    value with a control character other than HTAB (the engines accept `\x01` and `\x7f`;
    uvicorn refuses to write them, after the commit point: an empty reply), or a field name
    that is not a token (aiohttp's parser takes `Content-Length : 2` and `Transfer-Encoding
    : chunked`, space and all, as the name; uvicorn, h11 and httptools alike, refused to
    write it after the commit point: an empty reply booked as served; h11, on the httpx
    engine, refuses it). Two equal
    Content-Length fields: aiohttp's parser refuses them, h11 (httpx) merges them before
    this sees them. A length of more than MAX_LENGTH_DIGITS digits (h11's own bound, so
    both engines agree; aiohttp read `000...02` and uvicorn refused to write it after the
    commit point: an empty reply) is invalid, and so is a head over MAX_RESPONSE_HEAD,
    one of more than MAX_RESPONSE_FIELDS fields or with a field over MAX_RESPONSE_FIELD.
    Raises UpstreamError("protocol"); returns the fields, names lowercased (one pass: the
    engine relays these)."""
    if not 200 <= status <= 599:
        raise unrelayable("the upstream status cannot be relayed")
    # Every value at once (a tab between them is allowed in a value anyway): its control
    # characters found in one C loop, half of a regular expression's search.
    values = b"\t".join(map(_VALUE, headers))
    if values.translate(_NO_CTL_IN_VALUE) != values:
        raise unrelayable("a response field cannot be relayed")
    count = len(headers)
    if count > MAX_RESPONSE_FIELDS:
        raise unrelayable("the response head has too many fields")
    size = len(values) + 3 * count  # each field's ": " and CRLF, less the tab; names below
    lowered: list[tuple[bytes, bytes]] = []
    lengths: list[bytes] = []
    codings: list[bytes] = []
    for name, value in headers:
        length = len(name)
        if length + len(value) > MAX_RESPONSE_FIELD:
            raise unrelayable("a response field is too large to relay")
        size += length
        lowered.append((lower := name_forms(name)[0], value))  # lowercased once per name
        if lower == b"content-length":
            lengths.append(value.strip())
        elif lower == b"transfer-encoding":
            codings.extend(c.strip().lower() for c in value.split(b","))
        elif not lower or lower[-1] in _SPACE:
            # `Content-Length : 2`: aiohttp's parser reads it (framing included), space and
            # all in the name; no parser lets another non-token byte into a name.
            raise unrelayable("a response field cannot be relayed")
    if size > MAX_RESPONSE_HEAD:
        raise unrelayable("the response head is too large to relay")
    if len(lengths) > 1:
        raise unrelayable("contradictory Content-Length")
    if lengths and not (lengths[0].isdigit() and len(lengths[0]) <= MAX_LENGTH_DIGITS):
        raise unrelayable("an invalid Content-Length")
    if codings and codings != [b"chunked"]:
        raise unrelayable("a transfer coding other than chunked cannot be relayed")
    # A 304 (as an answer to HEAD) may name the transfer coding its GET would have had,
    # with no body (RFC 9112 §6.1): no contradiction. A 204 has no framing at all.
    if codings and (lengths or status == 204):
        raise unrelayable("contradictory response framing")
    if status in (204, 205) and lengths and lengths != [b"0"]:
        # RFC 9110 §15.3.6: a 205 has no content either (a chunked one may say so, RFC 7231
        # §6.3.6: the relay sends none of it, layers.walker.stream).
        raise unrelayable(f"a {status} response that declares a body")
    return lowered


_VALUE: Final = operator.itemgetter(1)


# The most kept-alive connections one send finds closed before it takes a new one (each
# lost one is closed, never pooled again; a new connection always ends the tries).
STALE_RESENDS: Final = 4


def resend_on_new_connection(request: UpstreamRequest, error: UpstreamError, reused: bool) -> bool:
    """Whether a send that failed is made again, on a new connection, in the same attempt:
    only a replayable request with its body in hand (never a POST the route leaves out, a
    PUT or DELETE it does not list, a streamed body), on a kept-alive connection (`reused`:
    the pool's, not one made for it), that ended before any answer (a transport failure
    waiting for the head: the upstream closed it idle as the request went out, its
    keep-alive timeout or request limit). A new connection that ends so is the upstream's
    failure, as any other: the walk decides what follows (one upstream request, one
    attempt). The one rule for both engines."""
    return (
        reused
        and request.replayable
        and isinstance(request.body, bytes)
        and error.kind == "transport"
        and error.phase == "first_byte"
        and error.detail is None  # a named failure (a proxy's refusal) is no lost connection
    )


class FirstByteTimer(Deadline):
    """The upstream's first-byte timer for one request, armed and paused from wherever
    the engine learns the request's progress (its body writer, its connector): it runs
    once the body is sent and while a chunk waits for the upstream to take it, never
    while the caller's body is still arriving (SPEC §12: the upload is the caller's
    time). Arming after the send has ended does nothing. A `Deadline` (timers.py, on the
    loop's timer wheel: it seldom fires) that starts unarmed."""

    __slots__ = ("_seconds",)

    def __init__(self, seconds: float) -> None:
        super().__init__(None)
        self._seconds = seconds

    def running(self) -> FirstByteTimer:
        """`with timer.running():` the scope the timer may end (unarmed at first)."""
        return self

    def arm(self) -> None:
        if self.active():
            self.reschedule(asyncio.get_running_loop().time() + self._seconds)

    def pause(self) -> None:
        if self.active():
            self.reschedule(None)

    def timed_body(self, source: AsyncIterator[bytes]) -> TimedBody:
        # (Its own module: this one would pass 400 lines.)
        """The streamed request body as the engine sends it: no timer while the caller's
        next chunk is awaited (the caller's idle gap and the walk deadline bound that);
        the first-byte timer while a chunk waits for the upstream, and after the end."""
        return TimedBody(self, source)


class NoChunks:
    """An empty body's chunks: ends at once. A class, not an async generator, so the
    modules that use it compile with mypyc (scripts/compile.py)."""

    __slots__ = ()

    def __aiter__(self) -> NoChunks:
        return self

    async def __anext__(self) -> bytes:
        raise StopAsyncIteration


class UpstreamResponse(Protocol):
    status: int
    headers: list[tuple[bytes, bytes]]

    def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive; raises UpstreamError (idle timeout, reset)."""
        ...

    async def aclose(self) -> None:
        """Release the connection. Safe to call twice; completes even when the calling
        task is being cancelled (a shielded close)."""
        ...


class UpstreamClient(Protocol):
    """The engine seam: `send` and `aclose`; optionally a class attribute
    `checks_response_heads = True` (`checks_own_heads`)."""

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        """Send the request; return once the response head has arrived. Never follows
        redirects, never decompresses. Raises UpstreamError."""
        ...

    async def aclose(self) -> None: ...


def checks_own_heads(client: UpstreamClient) -> bool:
    """Whether `client` checks each answer's head itself (`check_response_head`), as both
    shipped engines declare; the walk checks them for an engine that does not say so (a
    host's own, written to `send` + `aclose` alone: the declaration is optional)."""
    return getattr(client, "checks_response_heads", False) is True
