"""A reference model of the failover rules (SPEC §5, §6 and the §12 rulings) against the
real gateway. Hypothesis draws a plan of 1-4 upstreams (single credentials or pools, declared
rpm, some refusing connections), a route (retries, strategy, failover_status,
replayable_methods, replay_with_idempotency_key, on_exhausted, breaker settings, the repeat
allowance), a request (method, body size around replay_buffer, with or without a length, a
method-override field, an Idempotency-Key, an x-gateway-deadline-ms, the caller's own
credentials and forged x-gateway-* fields) sent 1-3 times through one gateway, and what each
upstream does with each request it receives (a status, an answer over max_response_body, a
reset or a close before the head, a head cut short, a status or framing the relay cannot
carry, a hang past its first-byte timeout). The requests go through a real Gateway (in
process) to scripted upstreams on real 127.0.0.1 sockets, on either engine, and every
observable is compared with what the model, written from the SPEC and docs/failover.md,
says: the status, the local error's code and rule, x-gateway-attempts, -provider, -skipped,
Retry-After on 503 route_exhausted, which upstream (and which pool credential) received how
many requests in which order, the body served, and that no caller credential, query key or
x-gateway-* field reached an upstream.

A disagreement is a defect or a model error: fix the one that is wrong. Under CI the same
examples run every time (about 15 s); FMW_MODEL_EXAMPLES=2000 searches afresh."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import socket
import struct
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fallback_mw import Gateway
from tests.conftest import IN_CI, REDIS_DB, REDIS_HOST, REDIS_PORT, _reachable
from tests.helpers import client_for
from tests.upstreams import host_app

NAMES = ("u0", "u1", "u2", "u3")
REPLAY_BUFFER = 1024
MAX_RESPONSE_BODY = 256  # a "big" answer is longer
ROUTE_DEADLINE_MS = 60_000
COOLDOWN_S = 600
REPEAT_WINDOW_S = 600  # every example lies within one window of the repeat allowance
# A hang costs this much, so hangs are drawn rarely; every other answer must come well
# within it on a loaded machine (a scripted answer later than this is a timeout).
FIRST_BYTE_MS = 1500
CALLER_SECRET = "caller-secret-7f3a"
KEYS = {f"K{i}": f"key-{i}-9c1e" for i in range(len(NAMES))} | {
    f"K{i}_{k}": f"key-{i}-{k}-5d2b" for i in range(len(NAMES)) for k in range(3)
}
# The methods aiohttp's own retry resent once on a new connection; the aiohttp engine keeps
# that for a replayable request (docs/failover.md, "A kept-alive connection lost").
AIOHTTP_RESENDS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


# --- scripted upstreams on real sockets --------------------------------------------------


@dataclass(frozen=True)
class Step:
    """What an upstream does with one request it received (after reading it whole)."""

    kind: str  # "status", "reset", "close", "partial", "hang"
    status: int = 0

    def __repr__(self) -> str:
        if self.kind == "status":
            return str(self.status)
        return f"big {self.status}" if self.kind == "big" else self.kind


@dataclass
class Seen:
    upstream: int
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes


@dataclass(repr=False)
class Scripted:
    """Four scripted upstreams served by threads (one per connection, `Connection: close`
    on every answer: no connection is reused, so nothing depends on a pool's timing), and
    four ports that refuse connections (bound, never listening)."""

    listeners: list[socket.socket] = field(default_factory=list)
    refusing: list[socket.socket] = field(default_factory=list)
    scripts: dict[int, tuple[Step, ...]] = field(default_factory=dict)
    served: dict[int, int] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    closing: bool = False

    def __repr__(self) -> str:
        return "Scripted()"

    def url(self, index: int, *, down: bool) -> str:
        sock = (self.refusing if down else self.listeners)[index]
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def reset(self, scripts: dict[int, tuple[Step, ...]]) -> None:
        with self.lock:
            self.scripts = scripts
            self.served = dict.fromkeys(scripts, 0)
            self.seen = []

    def accept_loop(self, index: int) -> None:
        listener = self.listeners[index]
        while not self.closing:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self.handle, args=(index, conn), daemon=True).start()

    def handle(self, index: int, conn: socket.socket) -> None:
        try:
            conn.settimeout(10)
            request = _read_request(conn)
            if request is None:
                return
            method, target, headers, body = request
            with self.lock:
                number = self.served.get(index, 0)
                self.served[index] = number + 1
                script = self.scripts.get(index, (Step("status", 200),))
                step = script[min(number, len(script) - 1)]
                self.seen.append(Seen(index, method, target, headers, body))
            _act(conn, step, method, f"{NAMES[index]}#{number}".encode())
        except OSError:
            pass
        finally:
            conn.close()


def _read_request(conn: socket.socket) -> tuple[str, str, list[tuple[str, str]], bytes] | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    method, target = lines[0].split(" ")[:2]
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.append((name.strip().lower(), value.strip()))
    fields = dict(headers)
    if "content-length" in fields:
        length = int(fields["content-length"])
        while len(rest) < length:
            chunk = conn.recv(65536)
            if not chunk:
                break
            rest += chunk
        return method, target, headers, rest[:length]
    if fields.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            while b"\r\n" not in rest:
                rest += conn.recv(65536)
            size_line, rest = rest.split(b"\r\n", 1)
            size = int(size_line.split(b";")[0], 16)
            while len(rest) < size + 2:
                rest += conn.recv(65536)
            body, rest = body + rest[:size], rest[size + 2 :]
            if size == 0:
                return method, target, headers, body
    return method, target, headers, b""


def _act(conn: socket.socket, step: Step, method: str, body: bytes) -> None:
    if step.kind in ("status", "big", "badstatus", "framing"):
        status = 600 if step.kind == "badstatus" else step.status
        if step.kind == "big":
            body = body.ljust(MAX_RESPONSE_BODY + 50, b".")
        framing = "transfer-encoding: chunked\r\n" if step.kind == "framing" else ""
        head = (
            f"HTTP/1.1 {status} Scripted\r\ncontent-type: text/plain\r\n{framing}"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        ).encode()
        conn.sendall(head if method == "HEAD" else head + body)
        conn.shutdown(socket.SHUT_WR)
        while conn.recv(65536):  # until the gateway closes: no reset of the answer
            pass
    elif step.kind == "reset":
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    elif step.kind == "partial":
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Ty")
    elif step.kind == "hang":
        while conn.recv(65536):  # until the gateway gives up and closes
            pass
    # "close": closed without a byte of answer


# Without Redis (outside CI) the examples keep to the memory state; under CI it must be there.
REDIS_UP = _reachable(REDIS_HOST, REDIS_PORT)


@pytest.fixture(scope="module")
def scripted() -> Iterator[Scripted]:
    if IN_CI and not REDIS_UP:
        pytest.fail(f"Redis is not reachable at {REDIS_HOST}:{REDIS_PORT} (CI=true)")
    state = Scripted()
    for _ in NAMES:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        state.listeners.append(listener)
        refusing = socket.socket()
        refusing.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        state.refusing.append(refusing)
    threads = [
        threading.Thread(target=state.accept_loop, args=(i,), daemon=True)
        for i in range(len(NAMES))
    ]
    for thread in threads:
        thread.start()
    try:
        yield state
    finally:
        state.closing = True
        for listener in state.listeners:
            listener.shutdown(socket.SHUT_RDWR)  # wakes its accept (a close alone does not)
        for sock in (*state.listeners, *state.refusing):
            sock.close()
        for thread in threads:
            thread.join(timeout=5)


# --- the model ------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    size: int
    retries: int
    strategy: str
    failover_status: tuple[int, ...]
    replayable_methods: tuple[str, ...]
    on_exhausted: str
    breaker: tuple[int, int, float]  # window, min_calls, failure_rate
    rpm: tuple[int | None, ...]
    pools: tuple[int, ...]  # credentials per upstream (1: a single one, not a pool)
    down: tuple[bool, ...]
    scripts: tuple[tuple[Step, ...], ...]
    engine: str
    method: str
    body_size: int
    chunked: bool  # the caller sends no Content-Length
    override: str | None  # the caller's X-HTTP-Method-Override
    replay_with_key: bool  # the route's replay_with_idempotency_key
    idempotency_key: bool  # the caller sends Idempotency-Key
    deadline_header: str | None  # the caller's x-gateway-deadline-ms
    repeat_budget: tuple[float, float]  # percent, min_per_second
    backoff_ms: int  # 5000 only under the caller's 1200 ms deadline: it ends the walk
    requests: int  # one after the other, through one gateway
    redis: bool  # state = "redis://..." (else memory)


@dataclass
class Expected:
    status: int
    code: str | None  # the local error's code (None: an upstream's answer)
    rule: str | None
    attempts: int
    provider: str | None
    skipped: str | None
    received: list[str]
    body: bytes | None  # the upstream answer served (None: a local error)
    # A 503 route_exhausted says when to come back: within the minute, or the cooldown.
    retry_after: str | None = None

    def observed(self) -> dict[str, Any]:
        return {
            "status": self.status, "code": self.code, "rule": self.rule,
            "attempts": self.attempts, "provider": self.provider, "skipped": self.skipped,
            "received": self.received, "body": self.body, "retry_after": self.retry_after,
        }  # fmt: skip


class _Breaker:
    """SPEC §6 while closed (no example outlives a cooldown): open once the last `window`
    outcomes hold at least `min_calls` with the failover-class rate at `failure_rate`."""

    def __init__(self, window: int, min_calls: int, failure_rate: float) -> None:
        self.outcomes: deque[bool] = deque(maxlen=window)
        self.min_calls, self.failure_rate = min_calls, failure_rate
        self.open = False

    def record(self, failure: bool) -> None:
        if self.open:
            return
        self.outcomes.append(failure)
        calls = len(self.outcomes)
        if calls >= self.min_calls and sum(self.outcomes) / calls >= self.failure_rate:
            self.open = True


@dataclass
class World:
    """What outlives one request in one gateway (memory state; every cooldown and window
    is longer than an example lasts): breakers, declared-capacity counts, the repeat
    allowance's counts, pool credentials cooled down or retired and the pools' rotation,
    and how many requests each scripted upstream has received."""

    plan: Plan
    breakers: dict[int, _Breaker] = field(default_factory=dict)
    used: dict[int, int] = field(default_factory=dict)  # attempts (declared rpm)
    firsts: dict[int, int] = field(default_factory=dict)  # repeat allowance
    repeats: dict[int, int] = field(default_factory=dict)
    served: dict[int, int] = field(default_factory=dict)
    unusable: dict[int, set[int]] = field(default_factory=dict)
    retired: dict[int, set[int]] = field(default_factory=dict)
    rotation: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i in range(self.plan.size):
            self.breakers[i] = _Breaker(*self.plan.breaker)
            self.used[i] = self.firsts[i] = self.repeats[i] = self.served[i] = 0
            self.unusable[i], self.retired[i], self.rotation[i] = set(), set(), 0


def model(plan: Plan, world: World, order: Sequence[int]) -> Expected:
    """What SPEC §5 and §6 say the gateway does with one request of `plan`, walking the
    candidates in `order`, from the state `world` (updated)."""
    buffered = plan.body_size <= REPLAY_BUFFER
    overrides = {plan.override} - {plan.method} if plan.override else set()
    keyed = plan.idempotency_key and plan.method == "POST" and plan.replay_with_key
    unreplayable = None
    if overrides - set(plan.replayable_methods):  # the upstream acts on that method
        unreplayable = "method_override"
    elif plan.method in plan.replayable_methods or keyed:
        unreplayable = None if buffered else "not_buffered"
    elif plan.replay_with_key and plan.method == "POST":
        unreplayable = "no_idempotency_key"
    else:
        unreplayable = "not_replayable_method"
    replayable = unreplayable is None
    ceiling = 1 + plan.retries if replayable else 1  # SPEC §12: 1 when not replayable
    deadline = _deadline(plan.deadline_header)
    deadline_left_ms = deadline or ROUTE_DEADLINE_MS  # every answer but a hang is quick
    breakers, used, served = world.breakers, world.used, world.served
    # Pools (SPEC §6): each credential at most once per request, round robin over the
    # usable ones; 401 retires, 403 / 429 / failover-class failures cool down.
    keys_used: dict[int, set[int]] = {i: set() for i in order}
    unusable, rotation = world.unusable, world.rotation
    tried: set[int] = set()
    received: list[str] = []
    skipped: list[str] = []
    attempts = 0
    # (upstream, status, body, over max_response_body): the answer on_exhausted serves
    last_answer: tuple[int, int, bytes, bool] | None = None
    position, attempted_in_pass, same_again = 0, False, False

    def request(index: int, key: int | None) -> Step | None:
        if plan.down[index]:
            return None  # refused: nothing received
        script = plan.scripts[index]
        number = served[index]
        served[index] += 1
        received.append(NAMES[index] if key is None else f"{NAMES[index]}.{key}")
        return script[min(number, len(script) - 1)]

    def answer(index: int, status: int, body: bytes, too_large: bool) -> Expected:
        if too_large:  # refused before the commit point, never failed over
            return Expected(
                502, "response_too_large", "max_response_body", attempts, None,
                _skips(skipped), received, None,
            )  # fmt: skip
        return Expected(status, None, None, attempts, NAMES[index], _skips(skipped), received, body)

    def local(code: str, rule: str) -> Expected:  # a local error after the walk
        status = {"upstream_failed": 502, "route_exhausted": 503, "deadline_exceeded": 504}
        expected = Expected(
            status[code], code, rule, attempts, None, _skips(skipped), received, None
        )
        if code == "route_exhausted":
            expected.retry_after = _comes_back(world, skipped)
        return expected

    def exhausted(rule: str) -> Expected:
        if plan.on_exhausted == "last_response" and last_answer is not None:
            return answer(*last_answer)
        return local("upstream_failed", rule)

    while True:
        # The cursor: the next candidate in order (or the same upstream again, with another
        # credential of its pool), skips cost no attempt, a whole pass of skips ends the walk.
        while True:
            key: int | None = None
            again, same_again = same_again, False
            if again:
                position -= 1
            elif position and position % len(order) == 0:
                if not attempted_in_pass:
                    if attempts == 0:
                        return local("route_exhausted", "no_candidate")
                    return exhausted("no_candidate")
                attempted_in_pass = False
            index = order[position % len(order)]
            position += 1
            pool = plan.pools[index]
            if pool > 1:
                usable = [
                    k for k in range(pool) if k not in keys_used[index] and k not in unusable[index]
                ]
                turn = rotation[index]
                rotation[index] += 1
                key = usable[turn % len(usable)] if usable else None
                if key is None:
                    skipped.append(f"{NAMES[index]};reason=no_credential")
                    if again:
                        assert last_answer is not None
                        return answer(*last_answer)  # that refusal, as it is
                    continue
            reason = None
            repeat = index in tried
            if breakers[index].open:
                reason = "breaker_open"
            elif repeat and not _repeat_allowed(plan, world, index):
                reason = "repeat_budget"
            elif plan.rpm[index] is not None and used[index] >= plan.rpm[index]:
                reason = "capacity"
            if reason is None and repeat and plan.backoff_ms > deadline_left_ms:
                # The deadline passes while the walk waits backoff_ms before the repeat: it
                # is never sent, and gives back what its admission counted.
                return local("deadline_exceeded", "deadline")
            if reason is not None:
                skipped.append(f"{NAMES[index]};reason={reason}")
                if again:
                    assert last_answer is not None
                    return answer(*last_answer)
                if reason == "repeat_budget":
                    return exhausted("repeat_budget")
                continue
            break
        attempts += 1
        used[index] += 1
        if repeat:
            world.repeats[index] += 1
        else:
            world.firsts[index] += 1
        tried.add(index)
        attempted_in_pass = True
        if key is not None:
            keys_used[index].add(key)
        step = request(index, key)
        if step is not None and step.kind == "hang" and deadline is not None:
            return local("deadline_exceeded", "deadline")  # the walk's deadline, first
        if (
            step is not None
            and step.kind in ("reset", "close")
            and plan.engine == "aiohttp"
            and replayable
            and plan.method in AIOHTTP_RESENDS
        ):
            step = request(index, key)  # one resend within the same attempt
            if step is not None and step.kind == "hang" and deadline is not None:
                return local("deadline_exceeded", "deadline")
        if step is not None and step.kind in ("status", "big"):
            body = b"" if plan.method == "HEAD" else f"{NAMES[index]}#{served[index] - 1}".encode()
            too_large = step.kind == "big" and plan.method != "HEAD"
            failover = step.status in plan.failover_status
            breakers[index].record(failover)
            if pool > 1 and key is not None:
                if step.status == 401:
                    world.retired[index].add(key)
                if step.status in (401, 403, 429) or failover:
                    unusable[index].add(key)
            if not failover:
                if (
                    step.status in (401, 403, 429)
                    and pool > 1
                    and len(keys_used[index]) < pool
                    and replayable
                    and attempts < ceiling
                ):
                    # Another credential of the same upstream (SPEC §6).
                    last_answer = (index, step.status, body, too_large)
                    same_again = True
                    continue
                return answer(index, step.status, body, too_large)
            last_answer = (index, step.status, body, too_large)
        else:
            # refused, reset, closed, cut short, timed out, an answer the relay cannot carry
            breakers[index].record(True)
            if pool > 1 and key is not None:
                unusable[index].add(key)
        if unreplayable is not None:
            return exhausted(unreplayable)
        if attempts >= ceiling:
            return exhausted("ceiling")


def _deadline(header: str | None) -> int | None:
    """The caller's x-gateway-deadline-ms when it shortens the route's (SPEC §12: 1-7 ASCII
    digits, not 0; anything else is ignored)."""
    if header is None or not (header.isascii() and header.isdigit() and len(header) <= 7):
        return None
    value = int(header)
    return value if 0 < value < ROUTE_DEADLINE_MS else None


def _repeat_allowed(plan: Plan, world: World, index: int) -> bool:
    """docs/failover.md: repeats in the window + 1 <= percent / 100 x first attempts in the
    window + min_per_second x window (every example lies within one window)."""
    percent, per_second = plan.repeat_budget
    allowance = world.firsts[index] * percent / 100 + per_second * REPEAT_WINDOW_S
    return world.repeats[index] + 1 <= allowance + 1e-9


def _comes_back(world: World, skipped: list[str]) -> str | None:
    """A 503 route_exhausted says Retry-After when a skipped candidate returns by itself,
    and no repeat_budget skip (back sooner than anything the header could say) was made:
    the soonest of a full rpm (within the rolling minute: "minute"), an open breaker or a
    cooled pool credential (the cooldown: "cooldown"); a pool every credential of which a
    401 retired does not return."""
    reasons = [item.split(";reason=") for item in skipped]
    if any(reason == "repeat_budget" for _, reason in reasons):
        return None
    waits = set()
    for name, reason in reasons:
        index = NAMES.index(name)
        if reason == "capacity":
            waits.add("minute")
        elif reason == "breaker_open" or (
            reason == "no_credential" and len(world.retired[index]) < world.plan.pools[index]
        ):
            waits.add("cooldown")
    return "minute" if "minute" in waits else waits.pop() if waits else None


def _skips(skipped: list[str]) -> str | None:
    return ", ".join(dict.fromkeys(skipped)) or None


def orders(plan: Plan) -> list[tuple[int, ...]]:
    """The orders SPEC §12 allows: the plan's own; `random`: its first candidate first,
    then the others in any order (one order for the whole request)."""
    indices = tuple(range(plan.size))
    if plan.strategy == "sequential" or plan.size < 3:
        return [indices]
    return [(0, *rest) for rest in itertools.permutations(indices[1:])]


# --- the real gateway ------------------------------------------------------------------


def config(plan: Plan, scripted: Scripted, state: str = "memory://") -> dict[str, Any]:
    window, min_calls, failure_rate = plan.breaker
    upstreams: dict[str, Any] = {}
    for i in range(plan.size):
        pool = plan.pools[i]
        upstream: dict[str, Any] = {
            "url": scripted.url(i, down=plan.down[i]),
            "auth_env": f"K{i}" if pool == 1 else [f"K{i}_{k}" for k in range(pool)],
            "connect_timeout_ms": 2000,
            "first_byte_timeout_ms": FIRST_BYTE_MS,
        }
        if i % 2:
            upstream |= {"auth_header": "x-api-key", "auth_scheme": ""}
        if plan.rpm[i] is not None:
            upstream["rpm"] = plan.rpm[i]
        upstreams[NAMES[i]] = upstream
    return {
        "gateway": {
            "engine": plan.engine,
            "state": state,
            "replay_buffer": REPLAY_BUFFER,
            "max_response_body": MAX_RESPONSE_BODY,
            "max_request_body": 1 << 16,
            "breaker": {
                "window": window,
                "min_calls": min_calls,
                "failure_rate": failure_rate,
                # No breaker half-opens, no credential returns.
                "cooldown_ms": COOLDOWN_S * 1000,
            },
            "repeat_budget": {
                "percent": plan.repeat_budget[0],
                "min_per_second": plan.repeat_budget[1],
                "window_ms": REPEAT_WINDOW_S * 1000,
            },
        },
        "upstreams": upstreams,
        "routes": [
            {
                "id": "chat",
                "prefix": "/v1/",
                "plan": list(NAMES[: plan.size]),
                "strategy": plan.strategy,
                "retries": plan.retries,
                "backoff_ms": plan.backoff_ms,
                "deadline_ms": ROUTE_DEADLINE_MS,
                "failover_status": list(plan.failover_status),
                "replayable_methods": list(plan.replayable_methods),
                "on_exhausted": plan.on_exhausted,
                "replay_with_idempotency_key": plan.replay_with_key,
            }
        ],
    }


async def run(plan: Plan, scripted: Scripted) -> list[tuple[Expected, httpx.Response, list[Seen]]]:
    """`plan.requests` requests, one after the other, through one gateway."""
    scripted.reset({i: plan.scripts[i] for i in range(plan.size)})
    state, prefix = "memory://", f"fmw-model-{uuid.uuid4().hex}:"
    if plan.redis:
        # Breakers, credential health, capacity and the repeat allowance in Redis (the Lua
        # twins of the memory state), under keys of this example's own.
        state = f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}?prefix={prefix}"
    gateway = Gateway(host_app, config=config(plan, scripted, state), environ=KEYS)
    body = bytes(i % 251 for i in range(plan.body_size))
    headers = {
        "authorization": f"Bearer {CALLER_SECRET}", "x-api-key": CALLER_SECRET,
        "cookie": f"session={CALLER_SECRET}", "x-gateway-attempts": "99",
        "x-gateway-provider": "forged", "x-gateway-skipped": "u0;reason=forged",
    }  # fmt: skip
    if plan.override is not None:
        headers["x-http-method-override"] = plan.override
    if plan.idempotency_key:
        headers["idempotency-key"] = "k-1"
    if plan.deadline_header is not None:
        headers["x-gateway-deadline-ms"] = plan.deadline_header

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 400):
            yield body[start : start + 400]

    results = []
    try:
        async with client_for(gateway) as client:
            for _ in range(plan.requests):
                with scripted.lock:
                    before = len(scripted.seen)
                response = await client.request(
                    plan.method, f"/v1/items?q=1&api_key={CALLER_SECRET}&key={CALLER_SECRET}",
                    content=chunks() if plan.chunked else body,
                    headers=headers,
                )  # fmt: skip
                with scripted.lock:
                    seen = scripted.seen[before:]
                results.append((observe(plan, response, seen), response, seen))
    finally:
        await gateway.aclose()
        if plan.redis:
            await _forget(prefix)
    return results


async def _forget(prefix: str) -> None:
    """Delete the example's keys (they would expire anyway)."""
    import redis.asyncio as aioredis

    client = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


# What each rule's message names (SPEC §12: the configuration that would change it).
# `ceiling`: retries; the candidates' urls when none accepted a connection; a skipped
# candidate and what brings it back when one was skipped (docs/failover.md).
REMEDY = {
    "ceiling": ("retries", "url", "skipped", "auth_env"),
    "not_replayable_method": ("replayable_methods",),
    "method_override": ("replayable_methods",),
    "not_buffered": ("replay_buffer",),
    "no_idempotency_key": ("Idempotency-Key",),
    "no_candidate": ("skipped",),
    "repeat_budget": ("repeat_budget",),
    "max_response_body": ("max_response_body",),
    "deadline": ("x-gateway-deadline-ms", "backoff_ms"),
}


def observe(plan: Plan, response: httpx.Response, seen: list[Seen]) -> Expected:
    code = rule = None
    local = "x-gateway-provider" not in response.headers  # no candidate produced it
    if local and plan.method == "HEAD":
        code = rule = "(a HEAD answer has no body)"
    elif local:
        error = json.loads(response.content)["error"]
        assert error["type"] == "gateway_error"
        code, rule = error["code"], error["rule"]
        # SPEC §12: the message says what configuration would change it, and never
        # echoes an upstream's answer.
        remedies = REMEDY.get(rule, ("",))
        assert any(r in error["message"] for r in remedies), (rule, error["message"])
        assert "#" not in error["message"] and "Scripted" not in error["message"]
    return Expected(
        status=response.status_code,
        code=code,
        rule=rule,
        attempts=int(response.headers["x-gateway-attempts"]),
        provider=response.headers.get("x-gateway-provider"),
        skipped=response.headers.get("x-gateway-skipped"),
        received=[_name(plan, s) for s in seen],
        body=None if code is not None else response.content,
        retry_after=_retry_after(response.headers.get("retry-after")),
    )


def _retry_after(value: str | None) -> str | None:
    if value is None:
        return None
    seconds = int(value)
    if 1 <= seconds <= 60:
        return "minute"
    return "cooldown" if COOLDOWN_S - 60 <= seconds <= COOLDOWN_S else f"{seconds} s"


def expectations(plan: Plan) -> list[list[dict[str, Any]]]:
    """What the model allows for the example's requests: one list per choice of each
    request's candidate order."""
    allowed = []
    for choice in itertools.product(orders(plan), repeat=plan.requests):
        world = World(plan)
        walks = [model(plan, world, order).observed() for order in choice]
        if plan.method == "HEAD":
            for expected in walks:
                if expected["code"] is not None:
                    expected["code"] = expected["rule"] = "(a HEAD answer has no body)"
        if walks not in allowed:
            allowed.append(walks)
    return allowed


def _credential(index: int, key: int | None) -> tuple[str, str]:
    """The header and value candidate `index` is given (`key`: its pool's credential)."""
    value = KEYS[f"K{index}" if key is None else f"K{index}_{key}"]
    return ("x-api-key", value) if index % 2 else ("authorization", f"Bearer {value}")


def _name(plan: Plan, seen: Seen) -> str:
    """The upstream that received a request, and which credential of its pool came."""
    index = seen.upstream
    if plan.pools[index] == 1:
        return NAMES[index]
    keys = [k for k in range(plan.pools[index]) if _credential(index, k) in seen.headers]
    return f"{NAMES[index]}.{keys[0] if len(keys) == 1 else keys}"


def check(plan: Plan, scripted: Scripted) -> None:
    results = asyncio.run(run(plan, scripted))
    actual = [result.observed() for result, _, _ in results]
    allowed = expectations(plan)
    if actual not in allowed:
        shown = "\n".join(map(str, allowed[:3]))
        pytest.fail(f"the gateway did {actual}\nthe model allows {shown}")
    for result, response, _ in results:
        event(f"{result.status} {result.code} {result.rule} skipped={result.skipped is not None}")
        if result.code is not None and result.attempts:
            assert response.headers.get("x-should-retry") == "false"
    seen = [request for _, _, requests in results for request in requests]
    sent = bytes(i % 251 for i in range(plan.body_size))
    for request in seen:
        index = request.upstream
        assert request.method == plan.method
        assert request.target == "/v1/items?q=1", "the caller's query keys are stripped"
        assert request.body == sent, "every attempt carries the caller's body, byte for byte"
        text = repr(request.headers)
        assert not any(name.startswith("x-gateway-") for name, _ in request.headers)
        assert CALLER_SECRET not in text, "a caller's credential reached an upstream"
        given = [v for v in KEYS.values() if v in text]
        assert len(given) == 1, "one credential per request, its candidate's own"
        own = [_credential(index, None if plan.pools[index] == 1 else k) for k in range(3)]
        assert any(credential in request.headers for credential in own)


# --- the strategies ----------------------------------------------------------------------

STATUSES = [200, 201, 400, 401, 403, 404, 429, 500, 502, 503, 504]
FAILING = [Step("status", s) for s in (401, 403, 429, 500, 502, 503, 503, 504)]


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    size = draw(st.integers(1, 4))
    step = st.one_of(
        st.sampled_from([Step("status", s) for s in STATUSES] + FAILING * 2),
        st.sampled_from([Step("reset"), Step("close"), Step("partial"), Step("badstatus"),
                         Step("framing", 200), Step("big", 200), Step("big", 503)]),
    )  # fmt: skip
    scripts = [draw(st.lists(step, min_size=1, max_size=3)) for _ in range(size)]
    if draw(st.integers(0, 19)) == 0:
        # Rarely, and once: a hang costs FIRST_BYTE_MS (or the caller's deadline).
        script = scripts[draw(st.integers(0, size - 1))]
        script.insert(draw(st.integers(0, len(script) - 1)), Step("hang"))
    redis = REDIS_UP and draw(st.integers(0, 3)) == 0
    plan = Plan(
        size=size,
        retries=draw(st.integers(size - 1, 5)),
        strategy=draw(st.sampled_from(["sequential", "random"])),
        failover_status=draw(
            st.sampled_from([(502, 503, 504), (429, 502, 503, 504), (429, 500, 502, 503, 504)])
        ),
        replayable_methods=draw(
            st.sampled_from(
                [
                    ("GET", "HEAD", "OPTIONS"),
                    ("GET", "HEAD", "OPTIONS", "POST"),
                    ("GET", "HEAD", "OPTIONS", "PUT", "DELETE"),
                    ("POST",),
                ]
            )
        ),
        on_exhausted=draw(st.sampled_from(["error", "last_response"])),
        breaker=draw(
            st.sampled_from([(10_000, 10_000, 1.0), (20, 5, 0.5), (2, 2, 1.0), (1, 1, 1.0)])
        ),
        rpm=tuple(draw(st.sampled_from([None, None, 1, 2])) for _ in range(size)),
        pools=tuple(draw(st.sampled_from([1, 1, 2, 3])) for _ in range(size)),
        down=tuple(draw(st.integers(0, 9)) == 0 for _ in range(size)),
        scripts=tuple(map(tuple, scripts)),
        engine=draw(st.sampled_from(["aiohttp", "httpx"])),
        method=draw(
            st.sampled_from(["GET", "GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE"])
        ),
        body_size=draw(
            st.sampled_from([0, 5, REPLAY_BUFFER - 1, REPLAY_BUFFER, REPLAY_BUFFER + 1])
        ),
        chunked=draw(st.booleans()),
        override=draw(st.sampled_from([None, None, None, "POST", "GET", "DELETE"])),
        replay_with_key=draw(st.booleans()),
        idempotency_key=draw(st.booleans()),
        deadline_header=draw(
            st.sampled_from([None, None, "0", "abc", "+900", "12345678", "60000", "1200"])
        ),
        repeat_budget=draw(st.sampled_from([(20.0, 1.0), (0.0, 0.005), (50.0, 0.0)])),
        requests=draw(st.integers(1, 3)),
        backoff_ms=1,
        redis=redis,
    )
    if plan.deadline_header == "1200" and draw(st.booleans()):
        plan = dataclasses.replace(plan, backoff_ms=5000)
    return plan


# CI draws the same examples every run (fast, and deterministic); FMW_MODEL_EXAMPLES=2000
# draws that many fresh ones, to search.
SEARCH = int(os.environ.get("FMW_MODEL_EXAMPLES", "0"))


@settings(
    max_examples=SEARCH or 80,
    deadline=None,
    derandomize=not SEARCH,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(plan=plans())
def test_the_gateway_walks_as_the_model_says(scripted: Scripted, plan: Plan) -> None:
    check(plan, scripted)
