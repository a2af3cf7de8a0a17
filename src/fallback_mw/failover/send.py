"""One upstream request and its outcome: `AttemptRunner.run` builds the request for a
candidate (its own credential, the caller's cleaned headers, the model rewrite), applies an
injected fault, sends it under what is left of the walk deadline and returns an `Outcome`
saying who is responsible, with the response (whose owner is then the caller) when a head
arrived. Every attempt goes through the lifecycle (failover/attempt.py), which runs it
here.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final
from urllib.parse import quote

from fallback_mw.config.views import AnyUpstream
from fallback_mw.credentials import PLAIN_CODINGS, unmaskable_answer
from fallback_mw.failover.outcome import Outcome, engine_outcome, local_or, status_outcome
from fallback_mw.faults import BlackholeSource, FaultSource, NoFaults
from fallback_mw.health.breaker import upstream_probe_lease
from fallback_mw.health.quota import peek_quota
from fallback_mw.request.body import BodyAborted
from fallback_mw.request.body_json import written_like
from fallback_mw.request.codings import body_coding, unreadable_coding
from fallback_mw.request.context import AttemptRecord, Headers, RequestBody, RequestContext
from fallback_mw.spelling import PATH_SAFE
from fallback_mw.timers import deadline_after
from fallback_mw.upstream.base import (
    NoChunks,
    Timeouts,
    UpstreamClient,
    UpstreamError,
    UpstreamRequest,
    UpstreamResponse,
    check_response_head,
    checks_own_heads,
)

AttemptResult = tuple[Outcome, UpstreamResponse | None]
# A path `quote(path, safe=PATH_SAFE)` returns unchanged (its always-safe characters and
# PATH_SAFE): the usual one, sent as it is without urllib's two Python calls.
_PLAIN_PATH: Final = re.compile(f"[A-Za-z0-9_.~{re.escape(PATH_SAFE.replace('-', ''))}-]*")
_FIRST_BYTE: Final = "first_byte_timeout_ms"


@functools.lru_cache(maxsize=1024)
def _derived(upstream: AnyUpstream) -> tuple[Timeouts, float, int, int]:
    """What every attempt at `upstream` derives from its settings: its timeouts in
    seconds, its half-open probe lease (`upstream_probe_lease`), its connection slots for
    a real attempt and for a shadow copy (`connection_slots`). Once per upstream, not per
    attempt: the route table makes its upstreams' views once (a view hashes by identity,
    a model by its values); bounded, for configs reloaded with ever new values."""
    timeouts = Timeouts(
        connect=upstream.connect_timeout_ms / 1000,
        first_byte=upstream.first_byte_timeout_ms / 1000,
        idle=upstream.idle_timeout_ms / 1000,
    )
    return (
        timeouts,
        upstream_probe_lease(upstream),
        connection_slots(upstream, shadow=False),
        connection_slots(upstream, shadow=True),
    )


class SyntheticResponse:
    """A response made by the gateway itself (a `fail` fault): no packet leaves."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.headers: list[tuple[bytes, bytes]] = [(b"content-length", b"0")]

    def iter_chunks(self) -> AsyncIterator[bytes]:
        return NoChunks()

    async def aclose(self) -> None:
        return None


def connection_slots(upstream: AnyUpstream, *, shadow: bool) -> int:
    """The connection cap an attempt waits under. Shadow copies have slots of their own
    (a space in the key: no upstream name has one), a quarter of `max_connections`, at
    least one: a copy the candidate is slow to answer holds one of those, never one a real
    attempt (the candidate may also be a fallback) would wait for."""
    if not shadow:
        return upstream.max_connections
    return max(1, upstream.max_connections // 4)


def pool_key(name: str, upstream: AnyUpstream, *, shadow: bool) -> str:
    """What an attempt's connection slots are counted under: the upstream name at its url
    (a url moved by a store reload gets slots of its own: requests waiting on the old host,
    which may hang, hold none of them), the shadow copies' apart (`connection_slots`). No
    name or url has a space. (`+`: compiled, an f-string formats each field by a call.)"""
    return name + " shadow " + upstream.url if shadow else name + " " + upstream.url


def model_rewritten(
    model: str, parsed: Mapping[str, Any], buffered: bytes, headers: Headers
) -> bytes:
    """The JSON object body `parsed` (sent as `buffered`) with its model replaced by a
    candidate's `model`, written as the caller wrote it (`written_like`). Every spelling of
    the key goes: an upstream reading keys in any case (Go's encoding/json takes the last)
    ran the caller's `"Model"` beside the rewrite."""
    rewritten = {k: v for k, v in parsed.items() if k.casefold() != "model"}
    rewritten["model"] = model
    return written_like(rewritten, buffered, headers)


class CheckedHead:
    """A host engine's answer as the walk reads it (`_checked_head`): the status an `int`
    and the fields tuples of `bytes` (names lowercased), whatever sequence of pairs, bytes
    subclass or `IntEnum` the engine handed; its body and close are the engine's."""

    def __init__(
        self, response: UpstreamResponse, status: int, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self.status = status
        self.headers = headers
        self._response = response

    def iter_chunks(self) -> AsyncIterator[bytes]:
        return self._response.iter_chunks()

    async def aclose(self) -> None:
        await self._response.aclose()


def _head_fields(fields: object) -> list[tuple[bytes, bytes]]:
    """A host engine's `headers` as tuples of bytes; TypeError naming them otherwise."""
    pairs: list[tuple[Any, Any]] = []
    try:
        for field in fields:  # type: ignore[attr-defined]
            if isinstance(field, bytes | bytearray | str):  # a line, not a pair to unpack
                raise TypeError
            name, value = field
            pairs.append((name, value))
    except (TypeError, ValueError):
        raise TypeError(
            f"client=: the engine's answer has headers {type(fields).__name__}, not (name, "
            "value) pairs; UpstreamResponse.headers is a list of (bytes, bytes)"
        ) from None
    for name, value in pairs:
        if not isinstance(name, bytes) or not isinstance(value, bytes):
            raise TypeError(
                f"client=: the engine's answer has headers {type(fields).__name__} of "
                f"{type(name).__name__}; UpstreamResponse.headers is a list of (bytes, bytes)"
            )
    return [(bytes(name), bytes(value)) for name, value in pairs]


async def _checked_head(response: UpstreamResponse) -> UpstreamResponse:
    """An answer no relay can carry (SPEC §12: a status outside 100-599, a 1xx as the final
    answer, contradictory framing) from an engine that does not check its own: closed
    unread, and the upstream's failover-class failure (UpstreamError "protocol"). Else the
    answer as the walk reads it (CheckedHead). A status or fields of the wrong type are the
    host's code: one TypeError in either build (compiled, reading them as the protocol
    types them raised mypyc's own, `int object expected; got float`)."""
    answer: Any = response  # read untyped: the builds check what the protocol says alike
    try:
        status = answer.status
        if not isinstance(status, int):
            raise TypeError(
                f"client=: the engine's answer has status {type(status).__name__} "
                f"{status!r}; UpstreamResponse.status is an int"
            )
        fields = check_response_head(int(status), _head_fields(answer.headers))
    except (UpstreamError, TypeError) as exc:
        await response.aclose()
        raise exc  # by name: a bare raise after an await, compiled (scripts/compile.py)
    return CheckedHead(response, int(status), fields)


class AttemptRunner:
    """Runs attempts for one request. The hedge drives it through `run` only."""

    def __init__(
        self,
        context: RequestContext,
        body: RequestBody,
        parsed: dict[str, Any] | None,
        client: UpstreamClient,
        faults: FaultSource,
        inject_headers: Any,
        shadow: bool = False,
        replayable: bool = False,
        rendered: bool = False,
    ) -> None:
        self.context = context
        self.body = body
        # The buffered body is already what the candidate takes (a shadow copy's, its
        # `model` rewritten when the copy was taken): sent as it is.
        self.rendered = rendered
        # The walk's own verdict (failover.replay.is_replayable): the engine may send such a
        # request again on a new connection when a kept-alive one was lost under it.
        self.replayable = replayable
        self.parsed = parsed
        self.client = client
        # The shipped engines check each answer's head themselves (they read its framing);
        # an engine of the host's own is checked here (upstream/base.check_response_head).
        self._heads_checked = checks_own_heads(client)
        self.faults = faults
        self.inject_headers = inject_headers
        self.shadow = shadow  # a shadow copy: its own connection slots (shadow_slots)
        # What every attempt of the request sends alike, made on the first attempt: the
        # quoted path and query, the caller's cleaned headers as text.
        self._target: str | None = None
        self._headers: list[tuple[str, str]] | None = None
        # The latest model rewrite of the body (`_rewritten`): the model, and the bytes sent.
        self._rewrite: tuple[str, bytes | None] | None = None

    def _request_url(self, upstream: AnyUpstream) -> str:
        target = self._target
        if target is None:
            # The caller's percent-encoding where it is safe to keep (`%2F` inside a
            # segment), else the normalised path quoted.
            path = self.context.path
            target = self.context.spelled_path or (
                path if _PLAIN_PATH.fullmatch(path) else quote(path, safe=PATH_SAFE)
            )
            if self.context.query:
                target += "?" + self.context.query.decode("latin-1")
            self._target = target
        return upstream.url + target

    def _forwarded(self) -> list[tuple[str, str]]:
        """The caller's cleaned headers as text, a list of the attempt's own.

        UTF-8 text: both engines write it back as the very bytes the caller sent (values
        were held to security.request_header_problem before the walk; anything else is
        refused by the engine's local check, never sent altered). Leading and trailing
        SP/HTAB are not part of a field value (RFC 9110 §5.5)."""
        decoded = self._headers
        if decoded is None:
            decoded = self._headers = [
                (k.decode("latin-1"), v.strip(b" \t").decode("utf-8", "surrogateescape"))
                for k, v in self.context.forward_headers
            ]
        return decoded.copy()

    def takes_body(self, upstream: AnyUpstream) -> bool:
        """A candidate that rewrites the model (`model`) needs a buffered JSON object body
        (an empty one needs no rewrite) that can be written again; any other candidate
        takes the body as it is."""
        if not upstream.model or self.rendered:
            return True
        buffered = self.body.buffered
        if buffered is None or not buffered:
            return buffered is not None
        return self.parsed is not None and self._rewritten(upstream.model) is not None

    def _rewritten(self, model: str) -> bytes | None:
        """The body with its model rewritten to `model`, written once for the attempts that
        send it (the latest model only: most plans rewrite to one); None when it cannot be
        written again: a body nested just under what `json.loads` reads (~930 levels) was
        read, and writing it deeper in the stack raised RecursionError (a 500)."""
        kept = self._rewrite
        if kept is None or kept[0] != model:
            assert self.parsed is not None and self.body.buffered is not None
            try:
                data: bytes | None = model_rewritten(
                    model, self.parsed, self.body.buffered, self.context.forward_headers
                )
            except RecursionError:
                data = None
            kept = self._rewrite = (model, data)
        return kept[1]

    def _request_body(self, upstream: AnyUpstream) -> bytes | AsyncIterator[bytes]:
        body = self.body
        if body.buffered is None:
            assert body.stream is not None
            return body.stream
        if upstream.model and self.parsed is not None and not self.rendered:
            rewritten = self._rewritten(upstream.model)
            assert rewritten is not None  # `takes_body`: the gate skips it otherwise
            return rewritten
        return body.buffered

    async def run(self, name: str, upstream: AnyUpstream, record: AttemptRecord) -> AttemptResult:
        context = self.context
        headers = self._forwarded()
        if self.body.buffered is None and self.body.length is not None:
            # A streamed body keeps its declared length (no chunked upload an upstream
            # that demands a length would answer with 411).
            headers.append(("content-length", str(self.body.length)))
        if record.credential_index is not None:
            credential = context.credential(name, record.credential_index)
            if credential is not None:
                headers.append(credential)
        self.inject_headers(headers)
        timeouts, _, slots, shadow_slots = _derived(upstream)
        # No fault source (no store): no coroutine asked for what is always None.
        faults = self.faults
        fault = None if type(faults) is NoFaults else await faults.upstream_fault(name)
        # Typed `object`, checked in the `finally`: compiled, an `UpstreamRequest | None`
        # assigned in the `try` and read in its `finally` was kept as an UpstreamRequest
        # across the await, and the `finally` after a fault's early return refused its None
        # (TypeError: UpstreamRequest object expected; got None; scripts/compile.py).
        sent: object = None
        deadline = deadline_after(max(context.remaining, 0.0))
        try:
            with deadline:
                # Asked only when a fault is set (a game day): no name compared per attempt.
                if fault is not None:
                    if fault == "fail":
                        record.fault = "fail"
                        return Outcome("status", 503, fault="fail"), SyntheticResponse(503)
                    if fault == "hang":
                        record.fault = "hang"
                        await asyncio.sleep(timeouts.first_byte)
                        return Outcome("timeout", fault="hang"), None
                    if fault == "revoke":  # the 401 of a credential disabled at the vendor
                        record.fault = "revoke"
                        return Outcome("status", 401, fault="revoke"), SyntheticResponse(401)
                client, url = self.client, self._request_url(upstream)
                proxy = upstream.proxy
                if fault == "blackhole" and isinstance(self.faults, BlackholeSource):
                    # A real connection to the process's silent listener: the engine's
                    # own first-byte timeout ends the attempt (upstream/blackhole.py).
                    # Direct, never through the upstream's proxy: the listener is this
                    # process's own, and its plain http URL would hand the proxy the
                    # request in clear, the injected credential included.
                    record.fault = "blackhole"
                    base, client = await self.faults.blackhole().open()
                    url, proxy = base + url[len(upstream.url) :], None
                # Positional, in the dataclass's field order (a class called with keywords
                # builds a dict of them for every attempt): method, url, headers, body,
                # timeouts, allow_hosts (the engine's own), max_connections, pool_key,
                # ca_file, proxy, slot_taken, replayable.
                request = sent = UpstreamRequest(
                    context.method, url, headers, self._request_body(upstream), timeouts, (),
                    shadow_slots if self.shadow else slots,
                    pool_key(name, upstream, shadow=self.shadow), upstream.ca_file, proxy,
                    None, self.replayable,
                )  # fmt: skip
                response = await client.send(request)
                if client is self.client and not self._heads_checked:
                    response = await _checked_head(response)
                if response.status == 429 and len(upstream.credential_envs) > 1:
                    # A pool credential's 429: quota spent or rate limited? (a bounded read
                    # of the body; the client still gets every byte if it is served)
                    response = await peek_quota(response)
        except TimeoutError:
            if not deadline.expired():
                # Not the walk's deadline: an engine of the host's own timing its upstream
                # out as asyncio does (the shipped engines raise UpstreamError "timeout").
                record.timer = _FIRST_BYTE
                return self._local_or(engine_outcome("timeout", "first_byte")), None
            # An injected hang still counts against the upstream when the deadline ends it.
            return self._local_or(Outcome("deadline", fault=record.fault)), None
        except UpstreamError as exc:
            record.could_not_connect = exc.kind == "refused"  # for the local error's message
            record.failure_detail = exc.detail
            if exc.kind == "timeout" and exc.phase != "body":
                record.timer = "connect_timeout_ms" if exc.phase == "connect" else _FIRST_BYTE
            return self._local_or(engine_outcome(exc.kind, exc.phase, fault=record.fault)), None
        except BodyAborted:
            return self._local_or(Outcome("transport")), None
        finally:
            if isinstance(sent, UpstreamRequest) and sent.slot_taken is False:
                # Ended waiting for a connection (or refused before one): never sent. An
                # engine that does not say (None) sent what it was handed.
                record.queued_only = True
        if not self.shadow:  # a shadow's answer goes to nobody
            # Read once for the relay (stream.commit takes it from the record); the check
            # runs only for an answer in a coding other than a plain gzip / deflate.
            coding = record.coding = body_coding(response.headers)
            encoding = coding[1]
            if encoding is not None and (encoding not in PLAIN_CODINGS or response.status == 206):
                unmaskable = unmaskable_answer(context, name, response.status, encoding)
                if unmaskable is not None:
                    # The gateway's key went with it and the mask cannot read the body: it
                    # is the upstream's unusable answer, as one the relay cannot carry
                    # (failover-class). Closed unread: its connection is never reused.
                    record.unmaskable = unmaskable
                    await response.aclose()
                    # A range of a body in a coding it reads answers the caller's own Range:
                    # the upstream did as asked, so it is not the upstream's failure.
                    asked = response.status == 206 and unreadable_coding(encoding) is None
                    if asked and any(k == b"range" for k, _ in context.forward_headers):
                        return self._local_or(Outcome("unreadable_range")), None
                    return self._local_or(Outcome("transport")), None
        # A redirect is never followed: it is an answer like any other.
        return status_outcome(response.status), response

    def _local_or(self, outcome: Outcome) -> Outcome:
        """The body's facts, for `failover.outcome.local_or` (the rule is decided there)."""
        body = self.body
        return local_or(
            outcome,
            client_gone=body.client_gone or self.context.client_disconnected,
            body_too_large=body.too_large,
            body_timed_out=body.timed_out,
            body_misframed=body.misframed,
            body_unfinished=body.stream is not None and not body.finished,
            host_refused=body.host_refusal is not None,
        )
