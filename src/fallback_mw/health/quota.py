"""Telling a spent quota from a rate limit in a 429 (SPEC §12, credential pools).

A plain 429 cools the credential down for `Retry-After` (Gemini says it in the body:
RetryInfo's `retryDelay`). A 429 that says the credential's
quota is exhausted retires it until the quota resets: OpenAI's `insufficient_quota` error
code in the JSON body (Gemini's: a QuotaFailure naming a per-day quota, until its
RetryInfo `retryDelay`), or rate-limit headers that report nothing remaining together with
when it comes back (`x-ratelimit-remaining-requests: 0` + `x-ratelimit-reset-requests`,
Anthropic's `anthropic-ratelimit-*-remaining: 0` + `-reset`, the IETF `ratelimit-remaining`
+ `ratelimit-reset`).

The body is read only for a pool credential's 429, and only its first `PEEK_LIMIT` bytes
(`peek_quota`), decoded when it is gzip / deflate coded (the gateway asks upstreams for
such an answer whenever its caller does: every client library does); the client still
receives the whole response, as it came, when it is served. The body is never logged,
kept or put in any record: only the verdict leaves this module.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import zlib
from collections.abc import AsyncIterator, Iterable, Sequence
from datetime import datetime
from typing import Any, Protocol

from fallback_mw.health.pool import retry_after_seconds, sent_at
from fallback_mw.request.codings import body_coding, content_decoder

PEEK_LIMIT = 4096  # bytes of a 429's body read before deciding
QUOTA_CODES = frozenset({"insufficient_quota", "billing_hard_limit_reached", "quota_exceeded"})

# (remaining header, reset header, reset format)
_HEADER_PAIRS = (
    (b"x-ratelimit-remaining-requests", b"x-ratelimit-reset-requests", "duration"),
    (b"x-ratelimit-remaining-tokens", b"x-ratelimit-reset-tokens", "duration"),
    (b"anthropic-ratelimit-requests-remaining", b"anthropic-ratelimit-requests-reset", "date"),
    (b"anthropic-ratelimit-tokens-remaining", b"anthropic-ratelimit-tokens-reset", "date"),
    (
        b"anthropic-ratelimit-input-tokens-remaining",
        b"anthropic-ratelimit-input-tokens-reset",
        "date",
    ),
    (
        b"anthropic-ratelimit-output-tokens-remaining",
        b"anthropic-ratelimit-output-tokens-reset",
        "date",
    ),
    (b"ratelimit-remaining", b"ratelimit-reset", "seconds"),
)
_DURATION = re.compile(
    r"^(?:(\d{1,6})h)?(?:(\d{1,6})m(?!s))?(?:(\d{1,9}(?:\.\d{1,9})?)s)?(?:(\d{1,9})ms)?$"
)
MAX_RESET = 31 * 86400.0  # a reset further away than this is read as "unknown"


def parse_duration(text: str) -> float | None:
    """OpenAI's reset format: `1s`, `6m0s`, `1h2m3.5s`, `20ms`; None when unreadable."""
    match = _DURATION.match(text.strip())
    if match is None or not any(match.groups()):
        return None
    hours, minutes, seconds, millis = match.groups()
    return (
        int(hours or 0) * 3600
        + int(minutes or 0) * 60
        + float(seconds or 0)
        + int(millis or 0) / 1000
    )


def _reset_seconds(text: str, form: str, now: datetime) -> float | None:
    text = text.strip()
    if form == "duration":
        return parse_duration(text)
    if form == "seconds":
        # ASCII digits only: `²` is a digit to str.isdigit, not to float.
        return float(text) if text.isascii() and text.isdigit() and len(text) <= 9 else None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return max((when - now).total_seconds(), 0.0)


def _header_quota(headers: Iterable[tuple[bytes, bytes]], now: datetime) -> float | None:
    values: dict[bytes, str] = {}
    for key, value in headers:
        values.setdefault(key.lower(), value.decode("latin-1"))
    found: float | None = None
    for remaining, reset, form in _HEADER_PAIRS:
        if values.get(remaining, "").strip() != "0" or reset not in values:
            continue
        seconds = _reset_seconds(values[reset], form, now)
        if seconds is None or seconds > MAX_RESET:
            continue
        found = seconds if found is None else max(found, seconds)
    return found


def _body_error(prefix: bytes) -> dict[str, Any] | None:
    try:
        parsed = json.loads(prefix)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None  # not JSON, or cut at PEEK_LIMIT: no verdict from the body
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return error if isinstance(error, dict) else None


def _body_says_quota(error: dict[str, Any]) -> bool:
    # Strings only: a list or an object there is no code (and cannot be looked up in a set).
    return any(
        isinstance(code, str) and code in QUOTA_CODES
        for code in (error.get("code"), error.get("type"))
    ) or _google_daily_quota(error)


def _google_details(error: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """The `details` of a Google API error (Gemini, Vertex AI) of one `@type`."""
    details = error.get("details")
    if not isinstance(details, list):
        return []
    wanted = f"type.googleapis.com/google.rpc.{kind}"
    return [d for d in details if isinstance(d, dict) and d.get("@type") == wanted]


def _google_daily_quota(error: dict[str, Any]) -> bool:
    """Gemini's RESOURCE_EXHAUSTED whose QuotaFailure names a per-day quota
    (`GenerateRequestsPerDayPerProjectPerModel-FreeTier`): spent until it resets, where a
    per-minute one is a plain rate limit."""
    for failure in _google_details(error, "QuotaFailure"):
        violations = failure.get("violations")
        for violation in violations if isinstance(violations, list) else ():
            quota_id = violation.get("quotaId") if isinstance(violation, dict) else None
            if isinstance(quota_id, str) and "PerDay" in quota_id:
                return True
    return False


_PROTO_DURATION = re.compile(r"^(\d{1,9})(?:\.\d{1,9})?s$")


def body_retry_delay(error: dict[str, Any] | None) -> float | None:
    """Google's RetryInfo `retryDelay` (`"37s"`, `"0.5s"`) in seconds: Gemini says when to
    come back in the body, not in Retry-After. None when it does not."""
    for info in _google_details(error, "RetryInfo") if error is not None else ():
        delay = info.get("retryDelay")
        if isinstance(delay, str) and _PROTO_DURATION.match(delay.strip()):
            return float(delay.strip()[:-1])
    return None


def quota_reset(
    headers: Sequence[tuple[bytes, bytes]], body_prefix: bytes, *, now: datetime | None = None
) -> float | None:
    """For a 429: None when it is a plain rate limit; otherwise the seconds until the
    quota resets, `math.inf` when the answer says the quota is spent but not when it comes
    back (the upstream's `quota_retire_ms` applies)."""
    seconds = _header_quota(headers, now or sent_at(headers))
    if seconds is not None:
        return seconds
    error = _body_error(body_prefix)
    if error is None or not _body_says_quota(error):
        return None
    delay = body_retry_delay(error)
    return math.inf if delay is None or delay > MAX_RESET else delay


class PeekedResponse:
    """An upstream response whose first body bytes were read to judge a 429; relays them
    first, then the rest, as if nothing had been read. `quota` is the verdict."""

    def __init__(
        self,
        response: _Response,
        prefix: bytes,
        rest: AsyncIterator[bytes] | None,
        error: BaseException | None,
        quota: float | None,
        retry_delay: float | None = None,
    ) -> None:
        self.status = response.status
        self.headers = response.headers
        self.quota = quota
        self.retry_delay = retry_delay  # the body's word on when to come back (Gemini)
        self._response = response
        self._prefix = prefix
        self._rest = rest
        self._error = error

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        prefix, self._prefix = self._prefix, b""
        if prefix:
            yield prefix
        if self._error is not None:
            raise self._error  # the read failed while peeking: the relay sees it now
        if self._rest is not None:
            async for chunk in self._rest:
                yield chunk

    async def aclose(self) -> None:
        rest, self._rest = self._rest, None
        try:
            closer = getattr(rest, "aclose", None)
            if closer is not None:  # the engine's body generator, left mid-way by the peek
                with contextlib.suppress(Exception):
                    await closer()
        finally:
            await self._response.aclose()


class _Response(Protocol):  # upstream.base.UpstreamResponse, without importing it
    status: int
    headers: list[tuple[bytes, bytes]]

    def iter_chunks(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


def credential_retry_after(response: _Response | None) -> float | None:
    """When a pool credential may be asked again: its answer's Retry-After, else what a
    peeked 429's body says (Gemini's RetryInfo)."""
    seconds = retry_after_seconds(response.headers if response else ())
    if seconds is None and isinstance(response, PeekedResponse):
        return response.retry_delay
    return seconds


def spent_quota(response: _Response | None, quota_retire_ms: int) -> float | None:
    """Seconds a pool credential's spent quota keeps it retired (None: not spent);
    `quota_retire_ms` when its answer gave no reset."""
    quota = response.quota if isinstance(response, PeekedResponse) else None
    if quota is None or math.isfinite(quota):
        return quota
    return quota_retire_ms / 1000


async def peek_quota(response: _Response, *, limit: int = PEEK_LIMIT) -> PeekedResponse:
    """Read at most `limit` bytes of a 429's body (bounded by the engine's idle timeout and
    the caller's deadline) and judge it; the returned response relays every byte."""
    rest = response.iter_chunks()
    chunks: list[bytes] = []
    size = 0
    error: BaseException | None = None
    ended = False
    try:
        while size < limit:
            try:
                chunk = await anext(rest)
            except StopAsyncIteration:
                ended = True
                break
            chunks.append(chunk)
            size += len(chunk)
    except Exception as exc:  # the engine's error, raised again when relayed
        error = exc
    except BaseException:
        # Cancelled (the caller hung up, the deadline, a lost hedge): nobody will relay or
        # close this answer, so it is closed here. Dropped open, an httpx connection stayed
        # in the pool for good.
        await response.aclose()
        raise
    prefix = b"".join(chunks)
    readable = _readable(response.headers, prefix, limit)
    verdict = quota_reset(response.headers, readable)
    delay = body_retry_delay(_body_error(readable))
    return PeekedResponse(response, prefix, None if ended else rest, error, verdict, delay)


def _readable(headers: list[tuple[bytes, bytes]], prefix: bytes, limit: int) -> bytes:
    """At most `limit` bytes of the body's text: `prefix` decoded when the body is coded
    (nothing to judge when it is in a coding that cannot be read, or does not decode)."""
    coding = body_coding(headers)[1]
    if coding is None:
        return prefix[:limit]
    readable, decoder = content_decoder(coding)
    if not readable:
        return b""
    if decoder is None:
        return prefix[:limit]
    try:
        return decoder.decode(prefix, limit)[:limit]
    except zlib.error:
        return b""
