"""Token usage read from responses as they pass to the client, never holding a stream back.

The response path meters (`layers/walker/stream.commit` feeds each relayed chunk to a
`UsageMeter` that fills `context.usage`); the budget guard settles from that, the walker
settles `tpm` from it, telemetry reports it. It sits below the layers for that reason.

OpenAI reports `usage.prompt_tokens` / `usage.completion_tokens`; Anthropic reports
`usage.input_tokens` (plus its cache's `cache_creation_input_tokens` and
`cache_read_input_tokens`, which count as input) / `usage.output_tokens` (in a stream:
`message_start` carries the input count, `message_delta` the cumulative output count);
AWS Bedrock's Converse `usage.inputTokens` (plus `cacheWriteInputTokens` /
`cacheReadInputTokens`) / `usage.outputTokens`; the OpenAI Responses API's stream
reports them in the final `response.completed` event's `response`, Groq's stream in its
last chunk's `x_groq`; Gemini / Vertex AI in
`usageMetadata` (`promptTokenCount` / `candidatesTokenCount` plus `thoughtsTokenCount`,
in each chunk of a stream, SSE or one JSON array), the model in `modelVersion`; Ollama's
own API in `prompt_eval_count` / `eval_count` (a stream's last JSON line). The body's
first bytes decide how it is read, the label only when they cannot
(`UsageMeter._sniff`), as the SDKs read a JSON object or an event stream under any
content type. JSON bodies are parsed once they end, if they fit in `json_cap`; a larger
body is only searched near its end, where the providers put `usage`. SSE is parsed line
by line (CRLF, LF or CR), keeping at most one event, up to `data: [DONE]`, where the
SDKs stop reading.

A body with `Content-Encoding: gzip` / `deflate` (a caller may ask for one) is read
decoded (`deflate` with or without its zlib wrapper, as clients read it; codings stacked
on one body undone in turn, `StackedDecoder`), up to `MAX_DECODED` bytes; the walker
narrows the caller's `Accept-Encoding` to those codings
(security.readable_accept_encoding), so no answer hides its usage in a coding the meter
cannot read."""

from __future__ import annotations

import contextlib
import json
import re
import zlib
from typing import Any

from fallback_mw.request.context import MAX_NAME, Usage
from fallback_mw.security import READABLE_CODINGS
from fallback_mw.tokens import MAX_TOKENS, read_json, token_count

DEFAULT_JSON_CAP = 1024 * 1024
_TAIL = 64 * 1024
# Where a `usage` (Gemini: `usageMetadata`) object starts; it is read from there with a
# JSON decoder, since it nests objects of its own (OpenAI's `prompt_tokens_details`,
# Anthropic's `cache_creation`).
_USAGE_OBJECT = re.compile(rb'"usage(Metadata)?"\s*:\s*\{')
# SSE ends a line at CRLF, LF or a lone CR (WHATWG HTML, server-sent events), as the
# SDKs' decoders do.
_LINE_END = re.compile(rb"\r\n|\r|\n")
_CR = ord(b"\r")


def body_coding(headers: list[tuple[bytes, bytes]]) -> tuple[bytes | None, bytes | None]:
    """A response's `Content-Type` and `Content-Encoding`, as `UsageMeter.observe` reads
    them. Several `Content-Encoding` fields are one list (RFC 9110 §5.3): joined whole."""
    content_type = content_encoding = None
    more: list[bytes] | None = None  # the fields after the first, joined once at the end
    for key, value in headers:
        lower = key.lower()
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


class UsageMeter:
    """Observe `(chunk, content_type)` pairs for one response; fills `target` as soon as
    usage is seen, so telemetry reading the context after the walk sees it."""

    # Decoded bytes read from a compressed body at most (a decompression bomb costs this).
    MAX_DECODED = 16 * 1024 * 1024

    def __init__(self, target: Usage, *, json_cap: int = DEFAULT_JSON_CAP) -> None:
        self.target = target
        self.json_cap = json_cap
        self.mode: str | None = None  # "sniff", then "sse", "json" or "ignore"
        self._label = "other"  # what the content type says: "sse", "json" or "other"
        self._head = b""  # the body's first bytes while they cannot decide yet
        self._decoder: BodyDecoder | None = None  # for a gzip / deflate body
        self.decoded = 0  # bytes it produced
        # A JSON body up to json_cap: its first chunk, and from a second one on all of them
        # in one buffer (a list of the chunks held some 40 bytes a chunk: 22 MB for a 1 MB
        # answer read two bytes at a time).
        self._json_first: bytes | None = None
        self._json = bytearray()
        self._json_size = 0
        self._tail = _Tail()  # the end of a JSON body over json_cap
        # The pending SSE line, grown in place (searched once a line end comes).
        self._line = bytearray()
        # The pending event's data: its first line, and from a second one on all of them
        # joined with "\n" as they come (as the SDKs join them): a list of them held some
        # 40 bytes a line, 5x what a stream of tiny lines sent. `_event_size`: what its
        # data has come to (over json_cap: only the tail is kept).
        self._first = b""
        self._event = bytearray()
        self._event_size = 0
        self._event_lines = 0
        self._event_tail = _Tail()  # the end of an event over json_cap
        self._long_line = False  # the pending line is over json_cap: only its tail is kept
        self._long_data = False  # ... and it is a `data:` line
        self.reported = False
        self._finished = False

    # --- the observer seam ------------------------------------------------------------

    def observe(
        self, chunk: bytes, content_type: bytes | None, content_encoding: bytes | None = None
    ) -> None:
        try:
            if self.mode is None:
                self.mode, self._label = "sniff", _mode(content_type)
                if content_encoding is not None:
                    readable, self._decoder = content_decoder(content_encoding)
                    if not readable:
                        self.mode = "ignore"  # a coding the meter cannot read
            if self.mode == "ignore":
                return
            decoder = self._decoder
            if decoder is not None:
                chunk = self._decode(decoder, chunk)
            if self.mode == "sniff":
                chunk = self._sniff(chunk, ended=False)
            if self.mode == "sse":
                self._feed_sse(chunk)
            elif self.mode == "json":
                self._feed_json(chunk)
        except Exception:  # metering must never break a response
            self.mode = "ignore"
            self._decoder = None

    def finish(self) -> None:
        """The response ended: parse a buffered JSON body, or a final unterminated event.
        Idempotent: the relay calls it when the response ends, however it ends (a response
        cut short never sends a last chunk)."""
        if self._finished:
            return
        self._finished = True
        try:
            if self.mode == "sniff":  # a body too short to decide until now
                head = self._sniff(b"", ended=True)
                if self.mode == "sse":
                    self._feed_sse(head)
                elif self.mode == "json":
                    self._feed_json(head)
            if self.mode == "json":
                if self._json_size <= self.json_cap:
                    data = bytes(self._json) if self._json else self._json_first or b""
                    document = _loads(data)
                    if document is None and data.find(b"data:") >= 0:
                        # Not one JSON document but an event stream labelled as JSON:
                        # an SDK that asked for a stream reads it as one, whatever its label.
                        self.mode = "sse"
                        self._feed_sse(data)
                    elif document is None:
                        # JSON Lines (Ollama's stream, `application/x-ndjson`).
                        self._apply_lines(data)
                    else:
                        self._apply_document(document)
                else:
                    self._apply_tail(self._tail.read())
            if self.mode == "sse":
                if self._line:
                    self._end_line(bytes(self._line))
                    self._line.clear()
                self._dispatch_event()
        except Exception:
            pass
        self._json_first = None
        self._json.clear()

    def _decode(self, decoder: BodyDecoder, chunk: bytes) -> bytes:
        room = self.MAX_DECODED - self.decoded
        decoded = decoder.decode(chunk, room + 1)
        self.decoded += len(decoded)
        if self.decoded > self.MAX_DECODED:
            raise ValueError("decoded body over MAX_DECODED")  # observe stops metering
        return bytes(decoded)

    def _sniff(self, chunk: bytes, *, ended: bool) -> bytes:
        """Decide the mode from the body's first bytes, as the SDKs read a body whatever
        its label: a JSON object (`{`) is parsed as JSON (an SDK parses a non-streamed
        answer as JSON under any content type), an event stream's first field as SSE (an
        SDK that asked for a stream reads it as one under any content type); otherwise
        the label decides (`_mode`), and a body of any other type is not metered. Returns
        the bytes to feed the chosen mode (none while undecided)."""
        data = self._head + chunk if self._head else chunk
        start = _FIRST_BYTE.search(data)
        first = b"" if start is None else data[start.start() : start.start() + _SSE_FIELD_BYTES]
        decided = ended or first[:1] == b"{" or len(first) == _SSE_FIELD_BYTES
        if not decided and len(data) < _HEAD_MAX:  # whitespace so far, or too few to tell
            self._head = data
            return b""
        self._head = b""
        if first[:1] == b"{":
            self.mode = "json"
        elif self._label == "sse" or _SSE_FIELD.match(first):
            self.mode = "sse"
        elif self._label == "json":
            self.mode = "json"
        else:
            self.mode = "ignore"  # audio, an image, HTML: nothing an SDK reads usage from
            return b""
        return data

    # --- JSON -------------------------------------------------------------------------

    def _feed_json(self, chunk: bytes) -> None:
        if self._json_size <= self.json_cap:
            self._json_size += len(chunk)
            first = self._json_first
            if first is None:
                first = self._json_first = chunk
            else:
                if not self._json:
                    self._json += first
                self._json += chunk
            if self._json_size > self.json_cap:
                self._tail.add(self._json or first)
                self._json_first = None
                self._json.clear()
            return
        self._tail.add(chunk)

    def _apply_tail(self, tail: bytes) -> None:
        """Usage from the end of a document too large to parse (a JSON body, an SSE event):
        its last `"usage": {...}`, read whole."""
        matches = list(_USAGE_OBJECT.finditer(tail))
        if matches:
            start = matches[-1].end() - 1
            text = tail[start:].decode("utf-8", "replace")
            with contextlib.suppress(ValueError):
                usage = json.JSONDecoder().raw_decode(text)[0]
                if matches[-1].group(1):
                    self._apply_gemini(usage)
                else:
                    self._apply_usage(usage)
        else:
            self._apply_lines(tail)  # the last lines of a long JSON Lines stream

    def _apply_lines(self, data: bytes) -> None:
        """Usage from JSON Lines: the last line that can report counts (Ollama's last
        line, `prompt_eval_count` / `eval_count`), and the first for the model. One line
        of each is parsed, however many lines the body has."""
        lines = data.splitlines()
        if lines:
            self._apply_document(_loads(lines[0]))
        for line in reversed(lines[1:]):
            if line.find(b'_count"') >= 0 or line.find(b'"usage') >= 0:
                self._apply_document(_loads(line))
                return

    # --- SSE --------------------------------------------------------------------------

    def _feed_sse(self, chunk: bytes) -> None:
        pending = self._line
        if not pending:
            data = chunk
        elif chunk.find(b"\n") < 0 and chunk.find(b"\r") < 0 and pending[-1] != _CR:
            # No line ends here: the pending line grows by this chunk, and is searched once
            # its end comes (not again with every chunk: a long line that came a few bytes
            # at a time cost the square of its length).
            pending += chunk
            if len(pending) > self.json_cap:
                self._cut_long_line()
            return
        else:
            pending += chunk
            data = bytes(pending)
        # A CR at the end may be the first half of a CRLF: kept until the next chunk.
        cut = len(data) - 1 if data.endswith(b"\r") else len(data)
        lines = _LINE_END.split(data[:cut])
        pending.clear()
        pending += lines.pop()
        pending += data[cut:]
        for line in lines:
            if self.mode != "sse":
                return  # `[DONE]` was read: nothing after it is metered
            self._end_line(line)
        if len(pending) > self.json_cap:
            self._cut_long_line()

    def _cut_long_line(self) -> None:
        """A line too long to keep whole (the Responses API's `response.completed` carries
        the whole response, echoed `instructions` included): its tail only."""
        line = self._line
        if not self._long_line:
            self._long_line, self._long_data = True, line.startswith(b"data:")
        del line[:-_TAIL]

    def _end_line(self, line: bytes) -> None:
        if self._long_line:  # the end of a line kept by its tail
            self._long_line = False
            if self._long_data:
                self._event_size += self.json_cap + 1
                self._event_tail.add(line)
            return
        self._sse_line(line)

    def _sse_line(self, line: bytes) -> None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            self._dispatch_event()
            return
        if line.startswith(b"data:"):
            value = line[5:]
            if value.startswith(b" "):
                value = value[1:]
            lines = self._event_lines = self._event_lines + 1
            size = self._event_size = self._event_size + len(value)
            if size <= self.json_cap:
                if lines == 1:
                    self._first = value
                else:
                    event = self._event
                    if lines == 2:
                        event += self._first
                    event += b"\n"
                    event += value
            else:  # too large to parse: its tail is searched, as a large JSON body's is
                self._event_tail.add(value)

    def _dispatch_event(self) -> None:
        event, size, lines = self._event, self._event_size, self._event_lines
        self._event_size = self._event_lines = 0
        if lines > 1:
            data = bytes(event) if size <= self.json_cap else b""
            event.clear()
        else:
            data = self._first
        self._first = b""
        if size > self.json_cap:
            # Only an event over json_cap has a tail: it alone starts a fresh one.
            tail, self._event_tail = self._event_tail.read(), _Tail()
            self._apply_tail(tail)
            return
        if not lines:
            return
        if data.startswith(b"[DONE]"):
            # The SDKs stop reading here: usage sent after it reaches no client.
            self.mode = "ignore"
            self.target.done = True
            return
        # Cheap filter: only events that can carry usage, or the model when still unknown.
        # `find`, not `in`: bytes `in` formats and drops a TypeError first (CPython 3.11).
        if data.find(b'"usage') < 0 and (
            self.target.model is not None or data.find(b'"model"') < 0
        ):
            return
        self._apply_document(_loads(data))

    # --- both -------------------------------------------------------------------------

    def _apply_document(self, document: Any) -> None:
        if isinstance(document, list):
            # Gemini's `:streamGenerateContent` without `alt=sse`: one JSON array of the
            # chunks, each with the `usageMetadata` so far. Only that: a listing of past
            # requests' `usage` is no usage of this one.
            for item in document:
                if isinstance(item, dict):
                    self._apply_model(item.get("modelVersion"))
                    self._apply_gemini(item.get("usageMetadata"))
            return
        if not isinstance(document, dict):
            return
        # Gemini / Vertex AI: `usageMetadata`, the model in `modelVersion`. (Each shape is
        # looked for by its keys first: every answer the meter parses pays for the lookups.)
        if "usageMetadata" in document or "modelVersion" in document:
            self._apply_model(document.get("modelVersion"))
            self._apply_gemini(document.get("usageMetadata"))
        # Ollama's own API: the last object (or NDJSON line) counts at the top level.
        if "eval_count" in document or "prompt_eval_count" in document:
            self._apply_counts(
                _reported_count(document.get("prompt_eval_count")),
                _reported_count(document.get("eval_count")),
            )
        # Anthropic `message_start` nests it in `message`; the OpenAI Responses API's
        # stream in `response` (`response.created`, `response.completed`); Groq's stream
        # in its last chunk's `x_groq`.
        for key in ("message", "response", "x_groq"):
            nested = document.get(key)
            if isinstance(nested, dict):
                self._apply_model(nested.get("model"))
                self._apply_usage(nested.get("usage"))
        self._apply_model(document.get("model"))
        self._apply_usage(document.get("usage"))

    def _apply_model(self, model: Any) -> None:
        if isinstance(model, str) and model and self.target.model is None:
            self.target.model = model[:MAX_NAME]

    def _apply_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        input_tokens = output_tokens = None
        # AWS Bedrock's Converse API spells them `inputTokens` / `outputTokens`.
        for key in ("prompt_tokens", "input_tokens", "inputTokens"):
            value = _reported_count(usage.get(key))
            if value is not None:
                # Anthropic's input_tokens (and Bedrock's inputTokens) leaves out the
                # prompt written to and read from its cache (billed too): they count as
                # input, as the GenAI conventions' gen_ai.usage.input_tokens includes
                # cached tokens.
                for cached in _CACHE_KEYS.get(key, ()):
                    extra = _reported_count(usage.get(cached))
                    if extra is not None:
                        value = min(value + extra, MAX_TOKENS)
                input_tokens = value
                break
        for key in ("completion_tokens", "output_tokens", "outputTokens"):
            value = _reported_count(usage.get(key))
            if value is not None:
                output_tokens = value
                break
        self._apply_counts(input_tokens, output_tokens)

    def _apply_gemini(self, usage: Any) -> None:
        """Gemini's `usageMetadata`: `promptTokenCount` (cached content included) and the
        tool-use prompt are input; `candidatesTokenCount` and the thinking model's
        `thoughtsTokenCount` are output, billed at the output price."""
        if not isinstance(usage, dict):
            return
        self._apply_counts(
            _sum_counts(usage, _GEMINI_INPUT_KEYS), _sum_counts(usage, _GEMINI_OUTPUT_KEYS)
        )

    def _apply_counts(self, input_tokens: int | None, output_tokens: int | None) -> None:
        # A count only grows over one response (Anthropic's output count is cumulative;
        # OpenAI reports once): the largest reported stands, so a later event saying less
        # (one the SDKs skip, e.g. an unknown `event:` name) cannot lower the charge.
        target = self.target
        if input_tokens is not None and (
            target.input_tokens is None or input_tokens > target.input_tokens
        ):
            target.input_tokens = input_tokens
        if output_tokens is not None and (
            target.output_tokens is None or output_tokens > target.output_tokens
        ):
            target.output_tokens = output_tokens
        if input_tokens is not None or output_tokens is not None:
            self.reported = True


class _Tail(bytearray):
    """The last _TAIL bytes of what was added. Each byte is copied a bounded number of
    times: keeping the tail as one bytes object copied all _TAIL of them again for every
    piece added, and an event stream of tiny `data:` lines in an event over json_cap (a
    few bytes each) cost 64 KiB of copying per line. A bytearray itself: every response's
    meter makes two, and most never hold a byte (no `__init__` of its own to run)."""

    __slots__ = ()

    def add(self, data: bytes | bytearray) -> None:
        self.extend(data)
        if len(self) > 2 * _TAIL:
            self._trim(self)

    @staticmethod
    def _trim(buffer: bytearray) -> None:
        del buffer[: len(buffer) - _TAIL]

    def read(self) -> bytes:
        return bytes(self[-_TAIL:])


def _reported_count(value: Any) -> int | None:
    """A reported token count (`token_count`), where one too large for a float (`1e400`,
    `Infinity`: the SDKs read `inf`) is the largest, as 1e300 or 10^5000 is."""
    if isinstance(value, float) and value == _INFINITY:
        return MAX_TOKENS
    return token_count(value)


def _sum_counts(usage: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    """The sum of the counts `usage` reports under `keys` (None: none reported)."""
    total = None
    for key in keys:
        value = _reported_count(usage.get(key))
        if value is not None:
            total = min((total or 0) + value, MAX_TOKENS)
    return total


_INFINITY = float("inf")
_CACHE_KEYS = {
    "input_tokens": ("cache_creation_input_tokens", "cache_read_input_tokens"),  # Anthropic
    "inputTokens": ("cacheWriteInputTokens", "cacheReadInputTokens"),  # Bedrock Converse
}
_GEMINI_INPUT_KEYS = ("promptTokenCount", "toolUsePromptTokenCount")
_GEMINI_OUTPUT_KEYS = ("candidatesTokenCount", "thoughtsTokenCount")


def media_type(content_type: bytes) -> bytes:
    """A Content-Type's media type, lowercased, without its parameters."""
    return content_type.split(b";", 1)[0].strip().lower()


def _mode(content_type: bytes | None) -> str:
    """What the label says the body is; the body's first bytes have the last word
    (`UsageMeter._sniff`)."""
    kind = media_type(content_type or b"")
    if kind == b"text/event-stream":
        return "sse"
    if kind.endswith(b"json") or kind in _UNLABELLED:
        # The SDKs parse an answer as JSON whatever it is labelled; these labels are
        # parsed even when the body does not start like a JSON object.
        return "json"
    return "other"


_UNLABELLED = frozenset({b"", b"text/plain"})
# The first byte that is not whitespace or a UTF-8 byte-order mark's.
_FIRST_BYTE = re.compile(rb"[^ \t\r\n\xef\xbb\xbf]")
# An event stream's first line: a field (`data:`, `event:`, `id:`, `retry:`) or a comment.
_SSE_FIELD = re.compile(rb"(?:data|event|id|retry)?:|(?:data|event|id|retry)\r?\n")
_SSE_FIELD_BYTES = len(b"retry:")
_HEAD_MAX = 1024  # leading whitespace kept while undecided, at most


# A gzip (`x-gzip`) or zlib-wrapped deflate stream, told apart by its header.
_GZIP_OR_ZLIB = zlib.MAX_WBITS | 32


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
_MEMBER_WINDOW = 16 * 1024


_GZIP = zlib.MAX_WBITS | 16
_FIRST, _LATER, _IGNORED = 0, 1, 2


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
MAX_STACKED_CODINGS = 5


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
_REGISTERED = frozenset(
    {b"aes128gcm", b"br", b"compress", b"dcb", b"dcz", b"exi", b"pack200-gzip",
     b"x-compress", b"zstd"}
)  # fmt: skip


def _codings(content_encoding: bytes) -> list[bytes]:
    """The codings a `Content-Encoding` list names, in the order applied (no `identity`),
    as content_decoder reads them (written out there: the gzip answer's path)."""
    codings = [c.strip().lower() for c in content_encoding.split(b",")]
    return [c for c in codings if c and c != b"identity"]


def _loads(data: bytes) -> Any:
    try:
        # Python refuses an integer of over 4,300 digits (a ValueError, as for bad JSON):
        # a count of 10^5000 tokens is read as the largest, as 10^40 is, not as no usage.
        return read_json(data)
    except UnicodeDecodeError:
        # Bytes that are not UTF-8 (an answer in ISO-8859-1, a stray byte in a string):
        # read as U+FFFD, as Go's encoding/json, Node's readers and a browser's EventSource
        # read them (and aiohttp's and requests' `.json()` read a declared charset), so the
        # caller saw the usage it reports.
        pass
    except ValueError:
        return None
    try:
        return read_json(data.decode(json.detect_encoding(data), "replace"))
    except ValueError:
        return None
