"""The HTTP session `serve`'s OTLP/HTTP exporters send through: what a collector answers an
export with is read up to `ANSWER_LIMIT` bytes, the rest never.

`requests` reads a whole answer into memory before the exporter looks at its status, and
the exporter never uses its body (an OTLP answer is a few bytes of partial-success counts):
a collector, or whatever answers at its address, that sent a gigabyte took a gigabyte of
the gateway's memory twice over, and one whose answer never ended grew it without bound,
about 100 MiB a second, the export thread never coming back. Here the answer's first
`ANSWER_LIMIT` bytes, those that came within the export's timeout, are kept as its
content; past either the connection is closed, not reused. Redirects are not followed
(the exporter asks for none either: an endpoint's OTLP headers, its key, must not go where
a 3xx points); the exporter counts a 3xx answer as delivered, so the first one is said in
one WARNING line (its Location not shown)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import requests

_log = logging.getLogger("fallback_mw.telemetry")
# Whether a redirect was said, by either exporter (once per process).
_redirect_said: list[bool] = []
_said_lock = threading.Lock()

# What an OTLP answer may hold: its partial-success message, or a proxy's error page.
ANSWER_LIMIT = 64 * 1024
_CHUNK = 8192
# An answer's time, when the exporter gives no timeout (it always gives one: 10 s unless set).
_ANSWER_SECONDS = 10.0


class BoundedAnswerSession(requests.Session):
    """A `requests.Session` whose answers are read up to `ANSWER_LIMIT` bytes."""

    def request(
        self, method: str, url: str | bytes, *args: Any, **kwargs: Any
    ) -> requests.Response:
        kwargs["stream"] = True
        kwargs["allow_redirects"] = False
        until = time.monotonic() + _seconds(kwargs.get("timeout"))
        response = super().request(method, url, *args, **kwargs)
        _read_bounded(response, until)
        if 300 <= response.status_code < 400 and _first_redirect():
            _log.warning(
                "the OTLP endpoint answered an export with a redirect (HTTP %d), which is "
                "not followed: what was sent there is not delivered, though the exporter "
                "counts it so (said once); set OTEL_EXPORTER_OTLP_ENDPOINT to the "
                "collector itself (where it points is not shown)",
                response.status_code,
            )
        return response


def _seconds(timeout: Any) -> float:
    """The export's timeout (requests': a number, or (connect, read)) as the whole answer's
    time: each read's timeout alone let a trickled answer, a byte a second, go on for hours."""
    if isinstance(timeout, tuple):
        timeout = timeout[-1]
    return float(timeout) if isinstance(timeout, int | float) else _ANSWER_SECONDS


def _first_redirect() -> bool:
    with _said_lock:
        if _redirect_said:
            return False
        _redirect_said.append(True)
        return True


def _read_bounded(response: requests.Response, until: float) -> None:
    """`response`'s content: its body's first ANSWER_LIMIT bytes (as sent, not decoded:
    a compressed answer is not inflated), what came by `until` (monotonic). Past either
    the connection is closed."""
    body = bytearray()
    complete = False
    # One read of the connection at a time where urllib3 has it (2.x): `read` waits for
    # _CHUNK bytes, minutes of a trickle, before `until` is looked at again.
    read = getattr(response.raw, "read1", None) or response.raw.read
    try:
        while len(body) <= ANSWER_LIMIT and time.monotonic() < until:
            chunk = read(_CHUNK, decode_content=False)
            if not chunk:
                complete = True
                break
            body += chunk
    except Exception:  # a reset or a timeout part-way: what came is the content
        pass
    if not complete:
        response.raw.close()  # the rest unread: the connection is not reused
    response._content = bytes(body[:ANSWER_LIMIT])
    response._content_consumed = True
    response.close()  # a connection read to its end goes back to the pool


__all__ = ["ANSWER_LIMIT", "BoundedAnswerSession"]
