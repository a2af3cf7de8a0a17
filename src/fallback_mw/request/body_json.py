"""What the request body says as JSON, for the layers that read it: the object (parsed
once, kept on the body), a model named in the path, the body the budget's estimate reads
(decoded, and read as the most lenient upstream reads it), a coding or charset it cannot
read, and a document written back as the caller wrote it (a rewritten model). The body
itself is read once by request/body.py."""

from __future__ import annotations

import codecs
import contextlib
import json
import re
import zlib
from collections.abc import Callable
from typing import Any, Final

from fallback_mw.request.codings import (
    ContentDecoder,
    body_coding,
    content_decoder,
    unreadable_coding,
)
from fallback_mw.request.context import MAX_NAME, Headers, RequestBody, RequestContext
from fallback_mw.request.types import Scope
from fallback_mw.security.fields import name_forms
from fallback_mw.tokens import first_json_value


def body_json(body: RequestBody) -> dict[str, Any] | None:
    """The buffered body as a JSON object, parsed once per request."""
    if not body.json_inspected:
        body.json = inspect_json(body.buffered)
        body.json_inspected = True
    return body.json


# A body's first byte when it begins with a byte-order mark (UTF-8's, UTF-16 / UTF-32's)
# or a NUL (UTF-16 / UTF-32 BE): json.loads reads each such body by its encoding.
_NOT_UTF8_START: Final = frozenset({b"\xef", b"\xfe", b"\xff", b"\x00"})

# json.loads's last step: its decoder's scanner (a decoder of its default settings; typeshed
# does not declare the attribute, and `raw_decode` around it is one more Python frame).
_SCAN: Final[Callable[[str, int], tuple[Any, int]]] = getattr(json.JSONDecoder(), "scan_once")  # noqa: B009


def loads_json(data: bytes) -> Any:
    """`json.loads(data)`: the same value, the same errors. The usual document (an object,
    `{` then no NUL: UTF-8 by json.loads's own detection, nothing before it to skip) is
    decoded and scanned at once, without json.loads's three Python steps, which cost half
    again what the scan does (some 15k instructions of a 250-byte answer's 43k); anything
    else, and whatever follows the object but whitespace, is json.loads's own."""
    if data[:1] == b"{" and data[1:2] != b"\x00":
        text = data.decode("utf-8", "surrogatepass")  # raises as json.loads does
        try:
            value, end = _SCAN(text, 0)  # raises JSONDecodeError as json.loads does
        except StopIteration:  # never at a `{`: json.loads says why
            return json.loads(data)
        if end == len(text) or not text[end:].strip(" \t\n\r"):  # json's whitespace
            return value
    return json.loads(data)


def inspect_json(data: bytes | None, *, saturated: bool = False) -> dict[str, Any] | None:
    """The body as a JSON object, or None (not JSON, not an object, or too deeply nested
    to parse safely). Read as `json.loads` reads bytes, so as Starlette / FastAPI upstreams
    (vLLM) read a request: a UTF-8 byte-order mark, or UTF-16 / UTF-32, is JSON too.
    `saturated`: read as the most lenient upstream reads it (`_lenient_json`), for an
    estimate only (such a body is never sent re-encoded), and a body nested too deep to
    parse raises `NestedTooDeep` (the estimate's refusal)."""
    if not data or (data.lstrip()[:1] != b"{" and data[:1] not in _NOT_UTF8_START):
        return None
    try:
        parsed = _lenient_json(data) if saturated else loads_json(data)
    except RecursionError:
        if saturated:
            raise NestedTooDeep from None
        return None
    except ValueError:  # UnicodeDecodeError included
        return None
    return parsed if isinstance(parsed, dict) else None


def _lenient_json(data: bytes) -> Any:
    """The body's first JSON value as the most lenient upstream readers read it (for an
    estimate only): bytes that are not UTF-8 in a string read as U+FFFD (Go's
    encoding/json, Node's readers), an integer of over 4,300 digits as a large one
    (`read_json`), and whatever follows the value left unread, as Go's `json.Decoder`
    (gin's ShouldBindJSON: Ollama) reads a request: `{...}garbage` or JSON Lines run
    the first object."""
    text = data.decode(json.detect_encoding(data), "replace")
    start = len(text) - len(text.lstrip(" \t\n\r"))
    return first_json_value(text, start)


class NestedTooDeep(Exception):
    """A body nested deeper than Python's parser reads (`json_depth.json_depth_limit`), which Node's
    `JSON.parse` and Go's `encoding/json` (to 10,000) read: no estimate can be made of
    what such an upstream is asked to generate."""


# Gemini and Vertex AI name the model in the path, not the body:
# `/v1beta/models/gemini-2.0-flash:generateContent`,
# `/v1/projects/P/locations/L/publishers/google/models/gemini-2.0-flash:streamGenerateContent`.
_PATH_MODEL: Final = re.compile(r"/models/([^/:]+):[A-Za-z]+$")


def path_model(path: str) -> str | None:
    """The model a Gemini-style path (`/models/NAME:method`) names, bounded as a body's is;
    None for any other path."""
    if "/models/" not in path:
        return None
    match = _PATH_MODEL.search(path)
    return None if match is None else match.group(1)[:MAX_NAME]


def request_json(context: RequestContext, body: RequestBody) -> dict[str, Any] | None:
    """The buffered body as a JSON object (None: not one); notes the requested model."""
    if body.buffered is None:
        return None
    parsed = body_json(body)
    if parsed is not None and isinstance(parsed.get("model"), str):
        # Bounded: a 1 MiB name would otherwise be kept whole in every usage record and
        # session-affinity key (the body is still forwarded as it came).
        context.request_model = context.request_model or parsed["model"][:MAX_NAME]
    return parsed


def decoded_request_json(
    scope: Scope, body: RequestBody, limit: int
) -> tuple[bytes, dict[str, Any]] | None:
    """A buffered body sent with `Content-Encoding: gzip` / `deflate` (aiohttp and Express
    servers decode one before reading it), decoded (at most `limit` bytes) and parsed as a
    JSON object: what such an upstream reads, for the budget's estimate. None: no such
    coding, or not a JSON object once decoded. Only asked when the body as sent is not
    JSON, so a plain body costs nothing more. Raises `NestedTooDeep` for a decoded body
    too deep to parse."""
    if not body.buffered:
        return None
    coding = body_coding(scope.get("headers", []))[1]
    if coding is None:
        return None
    readable, decoder = content_decoder(coding)
    if not readable or not isinstance(decoder, ContentDecoder):
        return None  # one coding, as those servers undo: its flush stays small
    decoded = b""
    with contextlib.suppress(zlib.error):
        decoded = decoder.decode(body.buffered, limit + 1)
        if len(decoded) <= limit:
            decoded += decoder.flush()
    parsed = inspect_json(decoded, saturated=True) if len(decoded) <= limit else None
    return None if parsed is None else (decoded, parsed)


def estimated_request_json(body: RequestBody) -> dict[str, Any] | None:
    """A buffered body that is not JSON to `json.loads`, read as a lenient upstream reads
    it (`_lenient_json`): an integer of over 4,300 digits (Python's own limit; Go's
    encoding/json skips it in a field it does not read, Node's JSON.parse reads a float),
    bytes that are not UTF-8 in a string (both read U+FFFD), data after the object (Go's
    json.Decoder, gin's binding, reads the first value). Such an upstream generates what
    the body asks for. For the budget's estimate only; the body is not JSON to the walker
    (a model rewrite would send it altered). Only asked when the body as sent is not JSON,
    so a plain body costs nothing more. Raises `NestedTooDeep` for a body too deep to
    parse."""
    return inspect_json(body.buffered, saturated=True)


def estimate_source(
    scope: Scope, body: RequestBody, limit: int
) -> tuple[bytes, dict[str, Any]] | None:
    """A buffered body that is not JSON as sent, read for the estimates as an upstream
    reads it (the budget's hold, `tpm`): decoded from gzip / deflate (`decoded_request_json`)
    or with an integer of thousands of digits (`estimated_request_json`). None: neither."""
    try:
        decoded = decoded_request_json(scope, body, limit)
        if decoded is not None:
            return decoded
        parsed = estimated_request_json(body)
    except NestedTooDeep:
        return None
    return None if parsed is None or body.buffered is None else (body.buffered, parsed)


def unreadable_request_coding(scope: Scope, body: RequestBody) -> str | None:
    """What keeps a buffered body's `Content-Encoding` from being read for the budget's
    estimate (`br`, `zstd`, a token of the caller's own: `unreadable_coding`'s name for
    it, never the caller's token), or None. An upstream with the codec (aiohttp's server
    with its speedups, Express's body-parser 2) decodes it and generates what it asks for,
    which the hold could not see. Only asked when the body is not JSON as sent or decoded."""
    if not body.buffered:
        return None
    coding = body_coding(scope.get("headers", []))[1]
    return None if coding is None else unreadable_coding(coding)


# A charset name as Node's iconv-lite matches one (lowercase, letters and digits only).
_NAME_NOISE: Final = re.compile(rb"[^0-9a-z]")
_CHARSET: Final = re.compile(rb";\s*charset\s*=\s*\"?([^;\"]*)", re.IGNORECASE)


def unreadable_request_charset(scope: Scope) -> str | None:
    """The charset a request's `Content-Type` declares when JSON reads differently in it
    than as the bytes `json.loads` reads (UTF-8, UTF-16, UTF-32): UTF-7 (and its IMAP
    variant). Express's body-parser decodes a body by any declared `utf-*` charset before
    parsing it, and in UTF-7 `"max+AF8-tokens"` is `"max_tokens"`: the upstream generated
    a limit the hold never saw. None: no such charset. Asked only of a body holding `+` or
    `&` (what UTF-7 decodes) or not JSON as sent, so a plain body costs nothing more."""
    for key, value in scope.get("headers", ()):
        if name_forms(key)[0] == b"content-type":
            match = _CHARSET.search(value)
            if match is not None:
                name = _NAME_NOISE.sub(b"", match[1].lower())
                if name.startswith(b"utf7"):
                    return "UTF-7"
    return None


# A body's byte-order mark and the codec of what follows it (UTF-32's before UTF-16's:
# they share their first two bytes).
BYTE_ORDER_MARKS: Final = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)


def written_like(document: dict[str, Any], original: bytes, headers: Headers) -> bytes:
    """`document` as JSON written as the caller wrote `original` (a model rewrite): in its
    encoding (UTF-8, UTF-16 or UTF-32, as `json.loads` read it, its byte-order mark kept),
    and with every non-ASCII character escaped when its `Content-Type` declares a charset
    that is not a UTF (`iso-8859-1`: ASCII reads the same in all of them). The caller's
    `Content-Type` goes with it: an upstream that decodes by its charset (Express's
    body-parser, ASP.NET Core) read UTF-8 bytes under `charset=utf-16` as garbage, and
    raw UTF-8 under `charset=iso-8859-1` as mojibake."""
    bom, codec = b"", str(json.detect_encoding(original))
    for mark, name in BYTE_ORDER_MARKS:
        if original.startswith(mark):
            bom, codec = mark, name
            break
    escape = False
    for key, value in headers:
        if name_forms(key)[0] == b"content-type":
            match = _CHARSET.search(value)
            escape = match is not None and not _NAME_NOISE.sub(b"", match[1].lower()).startswith(
                b"utf"
            )
            break
    try:
        text = json.dumps(document, separators=(",", ":"), ensure_ascii=escape)
        return bom + text.encode(codec)
    except UnicodeEncodeError:
        # A lone surrogate (`"\\ud800"` in the caller's JSON) has no UTF form: it goes out
        # escaped, as the caller wrote it.
        return bom + json.dumps(document, separators=(",", ":")).encode(codec)
