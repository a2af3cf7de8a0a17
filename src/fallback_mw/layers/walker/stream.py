"""The commit point and the relay: once a response head is accepted it is sent to the
client, and the body follows chunk by chunk (SSE included). A failure after that aborts
the client response: it is never restarted and never ended as if complete. This module is
the one owner of the upstream response from the commit on; it closes it in a shielded
`finally` (the engines' `aclose` completes even under cancellation). It meters the
response too: each relayed chunk goes to a `UsageMeter` that fills `context.usage`, which
the walker's `tpm` settlement, the budget guard and telemetry read. A relay that fails
returns what ended it (`failover.outcome.relay_outcome`), for the walker to book on its attempt."""

from __future__ import annotations

import zlib
from typing import Final

from fallback_mw.credentials import EchoMask, echoes_credential, without_echoed_credentials
from fallback_mw.failover.outcome import Outcome, relay_outcome
from fallback_mw.layers.walker.own_urls import linked_here, located_here
from fallback_mw.request.body import content_length
from fallback_mw.request.codings import BodyDecoder, body_coding, content_decoder
from fallback_mw.request.context import RequestContext
from fallback_mw.request.local_errors import gateway_headers, send_error
from fallback_mw.request.types import Send
from fallback_mw.request.usage import UsageMeter, media_type
from fallback_mw.security.answers import forwardable_response_headers
from fallback_mw.timers import Stall
from fallback_mw.upstream.base import NoChunks, UpstreamError, UpstreamResponse


async def commit(
    send: Send,
    context: RequestContext,
    name: str,
    response: UpstreamResponse,
    *,
    max_response_body: int,
    coding: tuple[bytes | None, bytes | None] | None = None,
) -> Outcome | None:
    """Relay `response`, upstream `name`'s answer. `coding`: its Content-Type and
    Content-Encoding as the attempt read them (`request.usage.body_coding`), else read
    here."""
    meter = UsageMeter(context.usage)
    # The response is closed however the relay ended, but not from a `finally`: a
    # mypyc-compiled coroutine re-raises a stale exception after a `finally` that awaits
    # (scripts/compile.py).
    try:
        outcome = await _relay(send, context, name, response, meter, max_response_body, coding)
    except BaseException as exc:
        _finished(context, name, meter)
        await response.aclose()
        raise exc
    _finished(context, name, meter)
    await response.aclose()
    return outcome


def _finished(context: RequestContext, name: str, meter: UsageMeter) -> None:
    meter.finish()  # however the response ended: a cut-short one still reports usage
    usage = context.usage
    if usage.model is not None and echoes_credential(context, name, usage.model):
        usage.model = None  # never recorded; the requested model prices it


async def _relay(
    send: Send,
    context: RequestContext,
    name: str,
    response: UpstreamResponse,
    meter: UsageMeter,
    max_response_body: int,
    coding: tuple[bytes | None, bytes | None] | None,
) -> Outcome | None:
    limit = max_response_body
    # A HEAD's, a 204's or a 304's Content-Length is the size of a body that never
    # follows (an artifact's HEAD): only a body that will follow can be over the limit.
    # A 205 has no content either (RFC 9110 §15.3.6).
    bodyless = context.method == "HEAD" or response.status in (204, 205, 304)
    declared = None if bodyless else content_length(response.headers)
    if declared is not None and declared > limit:
        for attempt in reversed(context.attempts):
            if attempt.candidate == name and attempt.decision == "serve":
                # The trace's account of this attempt: not served, refused here.
                attempt.decision = "local_error"
                attempt.reason = "the response is larger than max_response_body"
                break
        await send_error(
            send,
            context,
            "response_too_large",
            f"the upstream response exceeds max_response_body ({limit} bytes); raise "
            "[gateway] max_response_body to pass it",
        )
        return None
    context.chosen = name
    context.status = response.status
    # The gateway's own key went with this attempt (an upstream without one is attempted
    # bare, one whose variables are all unset is skipped): its account ids stay here.
    injected = any((context.credentials or {}).get(name, ()))
    headers = forwardable_response_headers(
        response.headers, status=response.status, injected=injected
    )
    headers = without_echoed_credentials(context, name, headers)
    if response.status in (201, 202) or 300 <= response.status < 400:
        headers = located_here(headers, context.upstreams[name].url, context.mount)
    for field, _ in headers:
        if field == b"link":  # any status: a list's 200 names its next page
            headers = linked_here(headers, context.upstreams[name].url, context.mount)
            break
    content_type, content_encoding = coding or body_coding(response.headers)
    # An upstream echoing its own credential in the body (an error quoting the key it
    # was sent) must not hand it to the caller, as in a header. The mask reads text: a
    # gzip / deflate body (every client library asks for one) is relayed decoded, or
    # a caller could have the key handed over compressed, unmasked. One the mask cannot
    # read never comes here (the attempt refused it: credentials.unmaskable_answer);
    # what does unread had no credential of the gateway's with it (a kept answer).
    if bodyless:
        mask = None
        # What an upstream put in a 205 (chunked, or up to its connection's close: the
        # engines read those as a body) is not relayed: the caller gets no content, as
        # for a 204. Left unread, the upstream connection is closed, never reused.
        chunks = NoChunks() if response.status == 205 else response.iter_chunks()
        if (
            context.method == "HEAD"
            and response.status not in (204, 205, 206, 304)
            and content_encoding is not None
            and content_decoder(content_encoding)[1] is not None
            and EchoMask.for_answer(context, name) is not None
        ):
            # RFC 9110 §9.3.2: a HEAD gets the fields a GET would, and this answer's
            # GET is relayed decoded (below): neither its coding nor its length.
            headers = _decoded_fields(headers)
    else:
        mask = EchoMask.for_answer(context, name)
        chunks = response.iter_chunks()
    decoder = None
    if mask is not None and content_encoding is not None:
        readable, decoder = content_decoder(content_encoding)
        if not readable:
            mask = None  # relayed as it comes
        elif decoder is not None and response.status == 206:
            # A range of a coded object counts coded bytes (its Content-Range), and
            # one from the middle does not decode: relayed as it comes.
            mask, decoder = None, None
        elif decoder is not None:
            headers = _decoded_fields(headers)
            content_encoding = None  # the meter reads what is relayed
    if context.vary:
        headers = _varied(headers, context.vary)
    if content_type is not None and not bodyless and _is_stream(content_type):
        # nginx in front buffers an answer by default (`proxy_buffering on`), holding a
        # stream's events back until it ends: the gateway's own order not to (the
        # upstream's never passes: security.FRONT_PROXY_RESPONSE_HEADERS). nginx
        # reads it and does not pass it on.
        headers.append((b"x-accel-buffering", b"no"))
    headers += gateway_headers(context)
    start = {"type": "http.response.start", "status": response.status, "headers": headers}
    try:
        await send(start)
    except OSError:  # the server's word (ASGI HTTP 2.4) that the client left
        context.client_disconnected = True  # the walk books it as a client gone
        return None
    context.committed = True
    received = 0
    coded = 0  # what a decoded body's upstream sent: held to the limit too
    # The client's side of the relay has the upstream's idle bound too: a client that
    # takes no chunk for that long (it stopped reading) is treated as gone, so it cannot
    # hold an upstream connection (one of max_connections) for as long as it likes.
    # One watchdog for the relay (checked once per idle period: a stuck send is cut
    # after one to two of them), not a timer per chunk; the upstream's waits have
    # their own.
    client = Stall(context.upstreams[name].idle_timeout_ms / 1000)
    try:
        with client:
            last = b""  # what ends the body: the decoder's and the mask's tails
            try:
                async for chunk in chunks:
                    if decoder is not None:
                        # Bounded: what is relayed is held to max_response_body, and
                        # so is what the upstream sends (a coded stream of empty
                        # blocks decodes to nothing, for as long as it is read).
                        coded += len(chunk)
                        chunk = _decoded(decoder, chunk, limit - received + 1)
                    received += len(chunk)
                    if received > limit or coded > limit:
                        context.outcome = "response_too_large"
                        return relay_outcome(None)  # abort: the client sees it incomplete
                    if mask is not None:
                        chunk = mask.feed(chunk)
                        if not chunk:
                            continue  # all of it may begin a credential: held back
                    client.waiting()
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    client.done()
                    if chunk:
                        meter.observe(chunk, content_type, content_encoding)
                if decoder is not None:
                    last = _decoded(decoder, None, 0)
                    received += len(last)
                    if received > limit:
                        context.outcome = "response_too_large"
                        return relay_outcome(None)
            except UpstreamError as exc:
                context.outcome = "aborted"
                return relay_outcome(exc.kind)  # never ended as if complete
            if mask is not None:
                last = mask.feed(last) + mask.flush()
            if last:
                meter.observe(last, content_type, content_encoding)
            client.waiting()
            await send({"type": "http.response.body", "body": last, "more_body": False})
    except TimeoutError:
        if not client.expired():
            raise
        context.outcome = "client_disconnected"  # it stopped reading: as if gone
        context.rule = "client_gone"
        return None
    except OSError:
        if not client.in_wait():
            raise
        # ASGI HTTP 2.4: a server's `send` raises an OSError subclass once the client
        # left (uvicorn's ClientDisconnected did): a client gone, never an error.
        context.client_disconnected = True
        return None
    context.completed = True
    context.outcome = "served"
    return None


# The media types of the streams LLM APIs answer with: SSE (OpenAI, Anthropic, and
# most), one JSON object a line (Ollama's `application/x-ndjson`), Amazon Bedrock's
# event stream. A JSON array streamed as `application/json` (Gemini without `alt=sse`)
# cannot be told from a plain answer.
_STREAM_TYPES: Final = frozenset(
    {
        b"text/event-stream",
        b"application/x-ndjson",
        b"application/ndjson",
        b"application/jsonl",
        b"application/vnd.amazon.eventstream",
    }
)


def _is_stream(content_type: bytes) -> bool:
    """Whether a Content-Type names a stream's media type (any case, any parameters)."""
    return media_type(content_type) in _STREAM_TYPES


def _varied(
    headers: list[tuple[bytes, bytes]], fields: tuple[bytes, ...]
) -> list[tuple[bytes, bytes]]:
    """`headers` whose `Vary` also names `fields` (the request fields that chose the
    candidate: the tenant header, a canary's session header): one field, the upstream's
    members first (caches such as nginx's read a single `Vary`); as they came when they
    name them already, or `*` (varies by anything)."""
    members = [
        item.strip()
        for name, value in headers
        if name == b"vary"
        for item in value.split(b",")
        if item.strip()
    ]
    named = {item.lower() for item in members}
    missing = [field for field in fields if field not in named]
    if b"*" in named or not missing:
        return headers
    kept = [(name, value) for name, value in headers if name != b"vary"]
    kept.append((b"vary", b", ".join([*members, *missing])))
    return kept


def _decoded_fields(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The fields of a body relayed decoded, as nginx's gzip filter rewrites them the other
    way: without what describes the coded bytes (_CODED_BODY_FIELDS), a strong `ETag`
    weakened (the decoded bytes are not the coded ones, but mean the same)."""
    return [
        (k, b"W/" + v if k == b"etag" and not v.startswith(b"W/") else v)
        for k, v in headers
        if k not in _CODED_BODY_FIELDS
    ]


# What a decoded body is relayed without: its coding, its length (the coded one), the
# digests of the coded bytes (RFC 9530: Content-Digest and Repr-Digest both cover the
# coded form, as the older Digest and Content-MD5 do), and ranges over them.
_CODED_BODY_FIELDS: Final = frozenset(
    {
        b"content-encoding",
        b"content-length",
        b"content-md5",
        b"digest",
        b"content-digest",
        b"repr-digest",
        b"accept-ranges",
    }
)


def _decoded(decoder: BodyDecoder, chunk: bytes | None, max_length: int) -> bytes:
    """`chunk` decoded (None: what the decoder still holds at the body's end)."""
    try:
        return decoder.flush() if chunk is None else decoder.decode(chunk, max_length)
    except zlib.error:
        # The client would have failed to read it too: the upstream's broken body.
        raise UpstreamError("protocol", "body", "the body does not decode as labelled") from None
