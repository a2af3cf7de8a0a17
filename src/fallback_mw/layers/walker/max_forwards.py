"""`Max-Forwards` on an OPTIONS or TRACE request (RFC 9110 §7.6.2): every recipient that
would forward one checks the field first. At 0 the gateway is the final recipient and
answers itself (an OPTIONS with the methods the route forwards, a TRACE with the request
as it would have gone on); above 0 it goes on one lower. Forwarded unchanged, a caller
probing where a chain of proxies ends (`curl -X OPTIONS -H 'Max-Forwards: 0'`) reached
the upstream with the gateway's credential. Only these two methods read it: any other
request forwards the field as it came."""

from __future__ import annotations

from typing import Final

from fallback_mw.request.context import RequestContext
from fallback_mw.request.local_errors import gateway_headers
from fallback_mw.request.types import Send

MAX_FORWARDS_METHODS: Final = frozenset({"OPTIONS", "TRACE"})
_FIELD: Final = b"max-forwards"
_MAX_DIGITS: Final = 10  # more is no count a chain of proxies can reach: forwarded as it came


async def answered_here(send: Send, context: RequestContext) -> bool:
    """Whether the request (an OPTIONS or a TRACE) ended here, answered as its final
    recipient; else its `Max-Forwards`, if it has one the gateway can read, is one lower
    in `context.forward_headers`. A value that is not ASCII digits, or counts more than
    10 digits (leading zeros aside), is left alone."""
    headers = context.forward_headers
    for index, (name, value) in enumerate(headers):
        if name != _FIELD:
            continue
        text = value.strip(b" \t")
        if not text.isdigit():  # bytes: ASCII digits only
            return False
        # Leading zeros count nothing (`00000000000` is 0, to the next hop too).
        count = text.lstrip(b"0") or b"0"
        if len(count) > _MAX_DIGITS:
            return False
        remaining = int(count)
        if remaining > 0:
            headers[index] = (name, str(remaining - 1).encode())
            return False
        await _answer(send, context)
        return True
    return False


async def _answer(send: Send, context: RequestContext) -> None:
    if context.method == "OPTIONS":
        body = b""
        fields = [(b"allow", ", ".join(context.route.accepted_methods).encode())]
    else:
        # RFC 9110 §9.3.8: the request as received, as `message/http`, without what may
        # carry a secret: the fields as they would have been forwarded (no credential).
        target = context.path.encode() + (b"?" + context.query if context.query else b"")
        lines = [b"TRACE " + target + b" HTTP/1.1"]
        lines += [name + b": " + value for name, value in context.forward_headers]
        body = b"\r\n".join(lines) + b"\r\n\r\n"
        fields = [(b"content-type", b"message/http")]
    context.status = 200
    context.outcome = "served"
    context.rule = "max_forwards"  # why no attempt ran (the log line's rule=)
    context.committed = True
    headers = [
        *fields,
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        *gateway_headers(context),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
    context.completed = True
