"""Content codings of a body as clients undo them: which `Content-Encoding` lists can be
read, and the decoders that undo them as the body streams (gzip, zlib-wrapped or bare
`deflate`, several gzip members, codings stacked on one body). The usage meter
(request/usage.py), the request body reader, the relay, the quota peek and the credential
echo mask read coded bodies through them."""

from __future__ import annotations

import zlib
from typing import Final

from fallback_mw.security.fields import READABLE_CODINGS, name_forms


def body_coding(headers: list[tuple[bytes, bytes]]) -> tuple[bytes | None, bytes | None]:
    """A response's `Content-Type` and `Content-Encoding`, as `UsageMeter.observe` reads
    them. Several `Content-Encoding` fields are one list (RFC 9110 §5.3): joined whole."""
    content_type = content_encoding = None
    more: list[bytes] | None = None  # the fields after the first, joined once at the end
    for key, value in headers:
        lower = name_forms(key)[0]
        if lower == b"content-type":
            content_type = value
        elif lower == b"content-encoding":
            if content_encoding is None:
                content_encoding = value
            elif more is None:
                more = [content_encoding, value]
            else:
                more.append(value)  # not joined each time: thousands of fields, a square
    return content_type, content_encoding if more is None else b",".join(more)


# A gzip (`x-gzip`) or zlib-wrapped deflate stream, told apart by its header.
_GZIP_OR_ZLIB: Final = zlib.MAX_WBITS | 32


class ContentDecoder:
    """One gzip / deflate body decoded as it streams, as clients decode it: gzip and
    zlib-wrapped deflate told apart by their header, and `deflate` sent as the bare RFC 1951
    stream, without the zlib wrapper (many servers send it so; httpx, the SDKs' client,
    aiohttp and browsers read it), read from its first byte again. A gzip body may hold
    several members (RFC 1952 §2.2: a server compressing each flush on its own); each is
    read, as urllib3 and browsers read them, and bytes after a member that are not another
    one are ignored, as urllib3 ignores them. Raises zlib.error on a body that is none of
    these."""

    __slots__ = ("_decompressor", "_head", "_members")

    def __init__(self, *, deflate: bool) -> None:
        self._decompressor = zlib.decompressobj(_GZIP_OR_ZLIB)
        # A `deflate` body's first coded bytes, kept until they show whether it carries
        # the zlib wrapper (None: decided, or not `deflate`).
        self._head: bytes | None = b"" if deflate else None
        # gzip: _FIRST, then _LATER once a second member begins; _IGNORED once what
        # follows a member is not one. `deflate` is one stream: None.
        self._members: int | None = None if deflate else _FIRST

    def decode(self, chunk: bytes, max_length: int = 0) -> bytes:
        """The decoded bytes `chunk` completes, at most `max_length` (0: all)."""
        members = self._members
        if members is not None:
            if members == _IGNORED:
                return b""
            try:
                decoded = self._decompressor.decompress(chunk, max_length)
            except zlib.error:
                if members == _FIRST:
                    raise
                self._members = _IGNORED
                return b""
            return self._later_members(decoded, max_length)
        head = self._head
        if head is None:
            return self._decompressor.decompress(chunk, max_length)
        try:
            decoded = self._decompressor.decompress(chunk, max_length)
        except zlib.error:
            self._head = None
            self._decompressor = zlib.decompressobj(-zlib.MAX_WBITS)
            return self._decompressor.decompress(head + chunk, max_length)
        # Two bytes read without an error: the zlib header was there.
        head += chunk
        self._head = head if len(head) < 2 else None
        return decoded

    def flush(self) -> bytes:
        """What the decoder still holds once the body has ended."""
        if self._members == _IGNORED:
            return b""
        return self._decompressor.flush()

    def _later_members(self, decoded: bytes, max_length: int) -> bytes:
        """`decoded`, and what the gzip members that follow the one that ended decode to
        (at most `max_length` in all)."""
        decompressor = self._decompressor
        if not (decompressor.eof and decompressor.unused_data):
            return decoded
        # What follows is read a window at a time: zlib copies the input a member leaves
        # unread (`unused_data`), so a chunk of many members (50,000 empty ones in 1 MiB,
        # a caller's request body) copied its rest once per member, seconds of CPU.
        rest = memoryview(decompressor.unused_data)
        parts = [decoded]
        size = len(decoded)
        offset = 0
        while offset < len(rest):
            if max_length and size >= max_length:
                break  # the caller reads this as over its bound
            if decompressor.eof:
                decompressor = self._decompressor = zlib.decompressobj(_GZIP)
                self._members = _LATER
            piece = rest[offset : offset + _MEMBER_WINDOW]
            try:
                out = decompressor.decompress(piece, max_length - size if max_length else 0)
            except zlib.error:
                self._members = _IGNORED  # not a member: ignored, as clients ignore it
                break
            parts.append(out)
            size += len(out)
            if decompressor.eof:
                offset += len(piece) - len(decompressor.unused_data)
            elif decompressor.unconsumed_tail:
                break  # max_length reached: over the bound
            else:
                offset += len(piece)
        return b"".join(parts)


# The most input a later gzip member is given at once (`_later_members`).
_MEMBER_WINDOW: Final = 16 * 1024


_GZIP: Final = zlib.MAX_WBITS | 16
_FIRST: Final = 0
_LATER: Final = 1
_IGNORED: Final = 2


class StackedDecoder:
    """A body coded more than once (`Content-Encoding: gzip, gzip`: an app compressed it
    and a proxy in front compressed it again; RFC 9110 §8.4 lists codings in the order
    applied), undone last coding first, as clients undo it (httpx, urllib3). Each stage
    is bounded like the last: a stage that fills `max_length` stops the decoding there,
    and the caller reads a result of `max_length` bytes as over its bound (nothing of it
    is relayed or metered)."""

    __slots__ = ("_stages",)

    def __init__(self, stages: list[ContentDecoder]) -> None:
        self._stages = stages

    def decode(self, chunk: bytes, max_length: int = 0) -> bytes:
        for stage in self._stages:
            chunk = stage.decode(chunk, max_length)
            if max_length and len(chunk) >= max_length:
                return chunk
        return chunk

    def flush(self) -> bytes:
        data = b""
        for stage in self._stages:
            data = (stage.decode(data) if data else b"") + stage.flush()
        return data


BodyDecoder = ContentDecoder | StackedDecoder
# Codings stacked on one body that are undone at most (urllib3's own bound): a longer
# stack is not read, as `br` is not.
MAX_STACKED_CODINGS: Final = 5


def content_decoder(content_encoding: bytes) -> tuple[bool, BodyDecoder | None]:
    """Whether a body in these codings can be read, and the decoder that undoes them
    (None: `identity`). Not readable: `br`, `zstd`, more than MAX_STACKED_CODINGS."""
    codings = [c.strip().lower() for c in content_encoding.split(b",")]
    codings = [c for c in codings if c and c != b"identity"]
    if not codings:
        return True, None
    if len(codings) > MAX_STACKED_CODINGS or not all(c in READABLE_CODINGS for c in codings):
        return False, None
    stages = [ContentDecoder(deflate=c == b"deflate") for c in reversed(codings)]
    return True, stages[0] if len(stages) == 1 else StackedDecoder(stages)


def unreadable_coding(content_encoding: bytes) -> str | None:
    """What keeps a body in these codings from being read (`content_decoder`), named for a
    message: a registered coding's name, never an upstream's own token (it may hold
    anything, a credential included). None: it can be read."""
    codings = _codings(content_encoding)
    if len(codings) > MAX_STACKED_CODINGS:
        return f"{len(codings)} codings stacked (at most {MAX_STACKED_CODINGS} are undone)"
    for coding in codings:
        if coding not in READABLE_CODINGS:
            return f"`{coding.decode()}`" if coding in _REGISTERED else "an unregistered coding"
    return None


# The IANA HTTP Content Coding Registry's names (a coding named in a message as it is).
_REGISTERED: Final = frozenset(
    {b"aes128gcm", b"br", b"compress", b"dcb", b"dcz", b"exi", b"pack200-gzip",
     b"x-compress", b"zstd"}
)  # fmt: skip


def _codings(content_encoding: bytes) -> list[bytes]:
    """The codings a `Content-Encoding` list names, in the order applied (no `identity`),
    as content_decoder reads them (written out there: the gzip answer's path)."""
    codings = [c.strip().lower() for c in content_encoding.split(b",")]
    return [c for c in codings if c and c != b"identity"]
