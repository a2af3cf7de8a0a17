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

A body with `Content-Encoding: gzip` / `deflate` is read decoded (request/codings.py), up
to `MAX_DECODED` bytes; the walker narrows the caller's `Accept-Encoding` to those codings
(security.readable_accept_encoding), so no answer hides its usage in a coding the meter
cannot read. What each provider's document says is read by request/usage_documents.py."""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any, Final

from fallback_mw.request.body_json import loads_json
from fallback_mw.request.codings import BodyDecoder, content_decoder
from fallback_mw.request.context import Usage
from fallback_mw.request.usage_documents import read_document, read_gemini, read_usage
from fallback_mw.request.usage_tail import TAIL as _TAIL
from fallback_mw.request.usage_tail import Tail as _Tail
from fallback_mw.tokens import read_json

DEFAULT_JSON_CAP: Final = 1024 * 1024
# Where a `usage` (Gemini: `usageMetadata`) object starts; it is read from there with a
# JSON decoder, since it nests objects of its own (OpenAI's `prompt_tokens_details`,
# Anthropic's `cache_creation`).
_USAGE_OBJECT: Final = re.compile(rb'"usage(Metadata)?"\s*:\s*\{')
# SSE ends a line at CRLF, LF or a lone CR (WHATWG HTML, server-sent events), as the
# SDKs' decoders do.
# not Final: tests/hostile/test_usage_work.py replaces it, to count what is searched.
_LINE_END = re.compile(rb"\r\n|\r|\n")
_CR: Final = ord(b"\r")
# `_LF not in chunk`: a memchr (`bytes in bytes` formats and drops a TypeError first).
_LF: Final = ord(b"\n")


class UsageMeter:
    """Observe `(chunk, content_type)` pairs for one response; fills `target` as soon as
    usage is seen, so telemetry reading the context after the walk sees it."""

    # Decoded bytes read from a compressed body at most (a decompression bomb costs this).
    MAX_DECODED: Final = 16 * 1024 * 1024  # Final: a class constant when compiled too

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
                        self._read_document(document)
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
                read = read_gemini if matches[-1].group(1) else read_usage
                if read(self.target, usage):
                    self.reported = True
        else:
            self._apply_lines(tail)  # the last lines of a long JSON Lines stream

    def _apply_lines(self, data: bytes) -> None:
        """Usage from JSON Lines: the last line that can report counts (Ollama's last
        line, `prompt_eval_count` / `eval_count`), and the first for the model. One line
        of each is parsed, however many lines the body has."""
        lines = data.splitlines()
        if lines:
            self._read_document(_loads(lines[0]))
        for line in reversed(lines[1:]):
            if line.find(b'_count"') >= 0 or line.find(b'"usage') >= 0:
                self._read_document(_loads(line))
                return

    # --- SSE --------------------------------------------------------------------------

    def _feed_sse(self, chunk: bytes) -> None:
        pending = self._line
        if not pending:
            data = chunk
        elif _LF not in chunk and _CR not in chunk and pending[-1] != _CR:
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
        self._read_document(_loads(data))

    def _read_document(self, document: Any) -> None:
        if read_document(self.target, document):
            self.reported = True


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


_UNLABELLED: Final = frozenset({b"", b"text/plain"})
# The first byte that is not whitespace or a UTF-8 byte-order mark's.
_FIRST_BYTE: Final = re.compile(rb"[^ \t\r\n\xef\xbb\xbf]")
# An event stream's first line: a field (`data:`, `event:`, `id:`, `retry:`) or a comment.
_SSE_FIELD: Final = re.compile(rb"(?:data|event|id|retry)?:|(?:data|event|id|retry)\r?\n")
_SSE_FIELD_BYTES: Final = len(b"retry:")
_HEAD_MAX: Final = 1024  # leading whitespace kept while undecided, at most


def _loads(data: bytes) -> Any:
    try:
        return loads_json(data)  # json.loads, without its Python steps (body_json)
    except UnicodeDecodeError:
        # Bytes that are not UTF-8 (an answer in ISO-8859-1, a stray byte in a string):
        # read as U+FFFD, as Go's encoding/json, Node's readers and a browser's EventSource
        # read them (and aiohttp's and requests' `.json()` read a declared charset), so the
        # caller saw the usage it reports.
        pass
    except json.JSONDecodeError:
        return None
    except ValueError:
        # Python refuses an integer of over 4,300 digits (a ValueError, as for bad JSON):
        # a count of 10^5000 tokens is read as the largest, as 10^40 is, not as no usage.
        try:
            return read_json(data)
        except ValueError:  # UnicodeDecodeError included: as json.loads refused it above
            return None
    try:
        return read_json(data.decode(json.detect_encoding(data), "replace"))
    except ValueError:
        return None
