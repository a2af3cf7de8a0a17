"""Each candidate's own credential, from its own environment variable: the table the
credential injector (layers/injector.py) computes once per route table. Below all four
layers, so the walker used alone applies the same hygiene without building a layer."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import lru_cache
from itertools import chain
from typing import Final

from fallback_mw.config.views import AnyUpstream
from fallback_mw.request.codings import content_decoder, unreadable_coding
from fallback_mw.request.context import RequestContext
from fallback_mw.request.secrets import MIN_SECRET, credential_forms
from fallback_mw.security.fields import READABLE_CODINGS, forwardable_request_headers

Credentials = Mapping[str, tuple[tuple[str, str] | None, ...]]


def credential_header(
    upstream: AnyUpstream, index: int, environ: Mapping[str, str]
) -> tuple[str, str] | None:
    """The (header, value) one candidate sends, from its own environment variable only."""
    envs = upstream.credential_envs
    if not 0 <= index < len(envs):
        return None
    secret = environ.get(envs[index])
    if not secret:
        return None
    value = f"{upstream.auth_scheme} {secret}" if upstream.auth_scheme else secret
    return upstream.auth_header, value


def credential_table(
    upstreams: Mapping[str, AnyUpstream], environ: Mapping[str, str]
) -> Credentials:
    """Every upstream's (header, value) per pool index, None where the variable is unset."""
    return {
        name: tuple(
            credential_header(upstream, index, environ)
            for index in range(len(upstream.credential_envs))
        )
        for name, upstream in upstreams.items()
    }


def apply_hygiene(
    context: RequestContext, headers: Sequence[tuple[bytes, bytes]], credentials: Credentials
) -> None:
    """SPEC §4 step 3 for one request: the caller's headers without any credential or
    hop-by-hop header, and every candidate's own credential beside them."""
    secrets = context.secrets
    context.forward_headers = forwardable_request_headers(
        headers,
        also_strip=context.upstream_auth_headers,
        query_keys=secrets.query_keys if secrets is not None else frozenset(),
    )
    context.credentials = credentials


# A provider credential shorter than this is not searched for in response fields: it would
# match ordinary text (a test key such as "k1"); real provider keys are far longer. The
# bound telemetry uses for a caller-chosen value (request/secrets.py), so both agree.
MIN_ECHOED_SECRET: Final = MIN_SECRET


def without_echoed_credentials(
    context: RequestContext, name: str, headers: list[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    """Response fields less any that carry a credential of upstream `name` (an upstream
    echoing what the gateway injected must not hand a provider key to the caller) in its
    value or its name, in any case: the relay lowercases field names, so a key echoed in
    a name (`x-debug-sk-...: 1`) arrives lowercased."""
    found = (context.credentials or {}).get(name)
    upstream = context.upstreams.get(name)
    if not found or upstream is None:
        return headers
    secrets = _echo_secrets(found, upstream.auth_scheme)
    if not secrets:
        return headers
    # One search when none is there (every name and value, a line each: no credential
    # holds a line break, so none is found across two of them).
    joined = b"\n".join(chain.from_iterable(headers)).lower()
    # `find`, not `in`: `bytes in bytes` raises and drops a TypeError on CPython 3.11. A
    # loop, not `any()` over a generator (about 2,000 instructions): every answer.
    for secret in secrets:
        if joined.find(secret) >= 0:
            break
    else:
        return headers
    return [
        (k, v)
        for k, v in headers
        if all(k.lower().find(secret) < 0 and v.lower().find(secret) < 0 for secret in secrets)
    ]


def unmaskable_answer(
    context: RequestContext, name: str, status: int, content_encoding: bytes
) -> str | None:
    """Why upstream `name`'s answer, coded `content_encoding`, must not reach the caller:
    its body is one `EchoMask` reads for the credential the gateway injected, and the mask
    cannot read it (a coding the gateway cannot undo: `br`, `zstd`, six stacked, a token
    of the upstream's own; or a `206` range of a coded object, which counts coded bytes
    and, from the middle, does not decode). Relayed as it came, the key inside went to the
    caller unmasked. None: it may be relayed (a readable coding, no body, or no credential
    to look for). Named for the local error, never quoting the body or an unknown token."""
    if content_encoding in PLAIN_CODINGS and status != 206:
        return None  # the common answer (gzip) costs one lookup
    if context.method == "HEAD" or status in (204, 205, 304):
        return None
    if EchoMask.for_answer(context, name) is None:
        return None
    named = unreadable_coding(content_encoding)
    if named is None and status == 206 and content_decoder(content_encoding)[1] is not None:
        named = "a 206 range of a coded body (a range from its middle does not decode)"
    return named


# The codings answers come in (what the gateway asks for), each read as it is: a caller
# may test for these before calling unmaskable_answer, which then returns None.
PLAIN_CODINGS: Final = READABLE_CODINGS | {b"identity"}


def echoes_credential(context: RequestContext, name: str, text: str) -> bool:
    """Whether `text`, read from upstream `name`'s answer (the model its body says
    answered), carries a credential the gateway injected into that upstream: such a value
    is never recorded (spans, the usage record, `fallback-mw usage`), since an upstream
    echoing its key there would otherwise put a provider key in the operator's telemetry."""
    found = (context.credentials or {}).get(name)
    upstream = context.upstreams.get(name)
    if not found or upstream is None:
        return False
    lowered = text.encode("latin-1", "replace").lower()
    # The meter keeps at most MAX_NAME characters: a longer key arrives cut, as a piece.
    piece = len(lowered) >= MIN_ECHOED_SECRET
    # A loop, not `any()` over a generator (about 2,000 instructions): every metered answer.
    for secret in _echo_secrets(found, upstream.auth_scheme):
        if lowered.find(secret) >= 0 or (piece and secret.find(lowered) >= 0):
            return True
    return False


class EchoMask:
    """Masks, in one response body as it streams, every credential the gateway injected
    into the upstream that answers: each is replaced by as many `*` (lengths and framing
    still hold). A key split over two chunks is caught too: a chunk's end that could begin
    a credential is held back until the next chunk shows whether it does (only such an
    end, so an SSE event's closing blank line is never delayed)."""

    __slots__ = ("_held", "_secrets", "_shapes", "_wide")

    def __init__(self, secrets: tuple[bytes, ...]) -> None:
        self._secrets = secrets
        self._shapes = _shapes(secrets)
        self._held = b""
        self._wide = False  # also looking for the keys as UTF-16 / UTF-32 text spells them

    @classmethod
    def for_answer(cls, context: RequestContext, name: str) -> EchoMask | None:
        """A mask for upstream `name`'s answer, or None: no credential long enough to look
        for. The mask reads the body's text: a coded body is decoded first (the relay)."""
        found = (context.credentials or {}).get(name)
        upstream = context.upstreams.get(name)
        if not found or upstream is None:
            return None
        secrets = _body_secrets(found, upstream.auth_scheme)
        return cls(secrets) if secrets else None

    def feed(self, chunk: bytes) -> bytes:
        """The part of the body seen so far that can be relayed, masked."""
        data = self._held + chunk if self._held else chunk
        if not self._wide and 0 in data:  # a NUL (`int in bytes`: a memchr)
            # Text in UTF-16 or UTF-32 (a NUL beside every ASCII character; UTF-8 text has
            # none): a JSON answer in either, which `json.loads` and so the SDKs read, carried
            # the key past a mask that looked for its UTF-8 bytes only.
            self._wide = True
            self._secrets = _wide_secrets(self._secrets)
            self._shapes = _shapes(self._secrets)
        for secret in self._secrets:
            if data.find(secret) >= 0:
                # `*` in the key's own encoding: each of its bytes but the NULs of its
                # UTF-16 / UTF-32 form (a credential holds no NUL), as many as it had.
                data = data.replace(secret, bytes(byte and 0x2A for byte in secret))
        keep = self._partial(data)
        if keep:
            self._held = data[-keep:]
            return data[:-keep]
        self._held = b""
        return data

    def flush(self) -> bytes:
        """What was held back, once the body has ended (it began no credential)."""
        held, self._held = self._held, b""
        return held

    def _partial(self, data: bytes) -> int:
        """The length of the longest end of `data` that begins some credential."""
        longest = 0
        size = len(data)
        # Each credential's length, anchor and first byte made once per mask (`_shapes`),
        # not sliced for every chunk.
        for secret, length, anchor, first in self._shapes:
            start = size - length + 1
            if start < 0:
                start = 0
            # An end of _ANCHOR bytes or more begins with the credential's first _ANCHOR
            # bytes, which one search finds: a check at every byte equal to its first cost
            # the square of its length a chunk (a body of `s` against an `sk-...` key).
            position = data.find(anchor, start)
            while position >= 0:
                if secret.startswith(data[position:]):
                    break  # the earliest start is the longest end
                position = data.find(anchor, position + 1)
            else:
                # Only an end shorter than the anchor is left: fewer than _ANCHOR places.
                short = size - len(anchor) + 1
                position = data.find(first, short if short > start else start)
                while position >= 0:
                    if secret.startswith(data[position:]):
                        break
                    position = data.find(first, position + 1)
            if position >= 0 and size - position > longest:
                longest = size - position
        return longest


@lru_cache(maxsize=256)
def _shapes(secrets: tuple[bytes, ...]) -> tuple[tuple[bytes, int, bytes, bytes], ...]:
    """Each of `secrets` with its length, its first _ANCHOR bytes and its first byte, as
    `EchoMask._partial` searches for them."""
    return tuple((secret, len(secret), secret[:_ANCHOR], secret[:1]) for secret in secrets)


# How much of a credential's beginning `EchoMask._partial` searches for at once.
_ANCHOR: Final = 16


_WIDE: Final = ("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")


@lru_cache(maxsize=256)
def _wide_secrets(secrets: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """`secrets` (UTF-8 spellings of the keys) and each as UTF-16 and UTF-32 text spells
    it, in either byte order; longest first, as `_body_secrets` orders them."""
    wide = {
        secret.decode("utf-8", "replace").encode(encoding)
        for secret in secrets
        for encoding in _WIDE
    }
    return tuple(sorted(wide | set(secrets), key=len, reverse=True))


def _keys(found: tuple[tuple[str, str] | None, ...], scheme: str) -> list[str]:
    """The keys behind one upstream's credential values (the scheme cut off), and the
    token inside a value that is a whole header value (`credential_forms`); those too
    short to look for left out."""
    skip = len(scheme) + 1 if scheme else 0
    return [form for _, value in filter(None, found) for form in credential_forms(value[skip:])]


@lru_cache(maxsize=256)
def _body_secrets(found: tuple[tuple[str, str] | None, ...], scheme: str) -> tuple[bytes, ...]:
    """The keys as the body would carry them (UTF-8, case kept), also as JSON encoders
    write them in a string (`_json_spellings`) and percent-encoded (`_percent_spellings`).
    Longest first: a key that begins with another pool key is masked whole, not cut after
    the shorter one."""
    secrets: set[bytes] = set()
    for key in _keys(found, scheme):
        encoded = key.encode("utf-8", "replace")
        secrets |= _json_spellings(encoded) | _percent_spellings(encoded)
    return tuple(sorted(secrets, key=len, reverse=True))


# What JSON encoders escape that a key may hold: PHP's json_encode writes `/` as `\/`;
# .NET's System.Text.Json writes `+` (and, as Go's encoding/json does, `<`, `>`, `&`, `'`)
# as `\u00XX`, .NET with upper-case hex digits, Go with lower-case ones.
_SLASH: Final = (b"/", b"\\/")
_HTML_SENSITIVE: Final = b"+<>&'`"


def _json_spellings(key: bytes) -> set[bytes]:
    """`key` as it is and as a JSON encoder may spell it inside a string, which a caller's
    JSON reader turns back into the key."""
    slashed = key.replace(*_SLASH)
    spellings = {key, slashed}
    if any(byte in key for byte in _HTML_SENSITIVE):
        for form in (b"\\u%04X", b"\\u%04x"):
            for base in (key, slashed):
                escaped = base
                for byte in _HTML_SENSITIVE:
                    escaped = escaped.replace(bytes((byte,)), form % byte)
                spellings.add(escaped)
    return spellings


# What URL and form encoders leave as it is (RFC 3986's unreserved characters).
_UNRESERVED: Final = frozenset(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~"
)


def _percent_spellings(key: bytes) -> set[bytes]:
    """`key` quoted in a URL (a `Location`, a link in an error) as URL and form encoders
    write it: every other byte as `%XX`, `/` kept or not (urllib's `quote` keeps it), hex
    digits in either case. Empty for a key that has nothing to encode."""
    if all(byte in _UNRESERVED for byte in key):
        return set()
    spellings = set()
    for kept in (b"", b"/"):
        for form in (b"%%%02X", b"%%%02x"):
            spellings.add(
                b"".join(
                    bytes((byte,)) if byte in _UNRESERVED or byte in kept else form % byte
                    for byte in key
                )
            )
    return spellings


@lru_cache(maxsize=256)
def _echo_secrets(found: tuple[tuple[str, str] | None, ...], scheme: str) -> tuple[bytes, ...]:
    """The keys as lowercased bytes, searched for in response fields, also percent-encoded
    (a `Location` quoting the key). Per credential table, not per request."""
    secrets: set[bytes] = set()
    for key in _keys(found, scheme):
        encoded = key.encode("latin-1", "replace")
        secrets.add(encoded.lower())
        secrets.update(spelling.lower() for spelling in _percent_spellings(encoded))
    return tuple(secrets)


class CredentialCache:
    """The credential table, computed once per route table (a store reload swaps the table,
    and its upstreams)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ = os.environ if environ is None else environ
        self._table: tuple[Mapping[str, AnyUpstream], Credentials] | None = None

    def credentials(self, upstreams: Mapping[str, AnyUpstream]) -> Credentials:
        cached = self._table
        if cached is not None and cached[0] is upstreams:
            return cached[1]
        table = credential_table(upstreams, self.environ)
        self._table = (upstreams, table)
        return table
