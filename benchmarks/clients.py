"""The load and the clients: wrk at fixed concurrency, a first-event timer for SSE, and the
memory scenarios (one large stream, many concurrent streams, a long run)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from procs import STREAM_EVENTS, Child, die_with_parent, reset_peak, rss_kib

LUA = Path(__file__).resolve().parent / "post_chat.lua"
CHAT_BODY = json.dumps(
    {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hello."}]}
).encode()
SSE_BODY = json.dumps(
    {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
).encode()


@dataclass
class Load:
    rate: float  # requests/s
    p50_ms: float
    p99_ms: float
    bad_status: int  # non-2xx/3xx responses: the arm is broken, its numbers meaningless
    socket_errors: int
    cpu_us: float  # CPU time (user + system) the server process spent per request
    requests: int = 0  # wrk's count of them


def descendants(pid: int) -> list[int]:
    """`pid` and every live process below it (`serve --workers`: the supervisor and its
    workers)."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            queue += [int(child) for child in task.read_text().split()]
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of a process and its live descendants (/proc)."""
    ticks = 0
    for each in descendants(pid):
        fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def run_wrk(wrk: str, url: str, seconds: int, connections: int, pid: int) -> Load:
    """wrk against `url`; `pid` is the server process whose CPU time is counted."""
    command = [
        wrk, "-t1", f"-c{connections}", f"-d{max(1, seconds)}s", "--timeout", "10s",
        "-s", str(LUA), url,
    ]  # fmt: skip
    cpu_before = cpu_seconds(pid)
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        preexec_fn=die_with_parent,  # like every child of the benchmark
    )
    cpu = cpu_seconds(pid) - cpu_before
    line = next((x for x in result.stdout.splitlines() if x.startswith("WRK ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary:\n{result.stdout}\n{result.stderr}")
    fields = {k: int(v) for k, v in (item.split("=") for item in line.split()[1:])}
    return Load(
        rate=fields["requests"] / (fields["duration_us"] / 1e6),
        p50_ms=fields["p50_us"] / 1000,
        p99_ms=fields["p99_us"] / 1000,
        bad_status=fields["status"],
        socket_errors=sum(fields[k] for k in ("connect", "read", "write", "timeout")),
        cpu_us=cpu / max(fields["requests"], 1) * 1e6,
        requests=fields["requests"],
    )


def post(url: str, body: bytes = CHAT_BODY) -> tuple[int, dict[str, str], bytes]:
    """One POST on a connection of its own. A connection closed or reset before any answer
    is said on stderr and asked once more (a server that has just started, on a machine
    running a test suite beside it); a second such end fails the run, naming the URL."""
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"content-type": "application/json"}
    )
    try:
        return _answer(request)
    except (http.client.RemoteDisconnected, ConnectionResetError) as exc:
        what = f"POST {url}: the connection ended without an answer"
        print(f"benchmark: {what} ({exc!r}); asked once more", file=sys.stderr, flush=True)
    time.sleep(0.2)
    try:
        return _answer(request)
    except (http.client.RemoteDisconnected, ConnectionResetError) as exc:
        raise RuntimeError(f"{what}, twice ({exc!r})") from exc


def _answer(request: urllib.request.Request) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers.items()), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers.items()), exc.read()


def first_event_ms(port: int, path: str) -> float:
    """Milliseconds from sending a streaming POST to receiving its first `data:` line."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(SSE_BODY)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        received = b""
        started = time.perf_counter()
        sock.sendall(head + SSE_BODY)
        while b"data:" not in received:
            chunk = sock.recv(65536)
            if not chunk:
                raise RuntimeError(f"no event before the end of the response: {received[:200]!r}")
            received += chunk
        elapsed = time.perf_counter() - started
        while chunk:  # read to the end (Connection: close)
            chunk = sock.recv(65536)
            received += chunk
    if b"[DONE]" not in received:
        raise RuntimeError("the SSE response was cut short")
    return elapsed * 1000


def first_event_pairs(targets: dict[str, Child], path: str, samples: int) -> dict[str, list[float]]:
    """Interleaved samples, one request at a time (low load), so noise hits every arm alike."""
    times: dict[str, list[float]] = {name: [] for name in targets}
    names = list(targets)
    for i in range(samples):
        for name in names[i % 2 :] + names[: i % 2]:
            times[name].append(first_event_ms(targets[name].port, path))
    return times


class ScenarioFailed(Exception):
    """Requests of a memory scenario failed: reported, not raised out of the run."""


@dataclass
class Memory:
    before: int  # KiB, after a warm-up
    peak: int
    after: int
    note: str
    failed: bool = False  # the scenario did not complete: the memory target is missed

    @property
    def added_mib(self) -> float:
        return (self.peak - self.before) / 1024


async def _big(url: str, expected: int) -> str:
    received, started = 0, time.monotonic()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
        if response.status != 200:
            raise RuntimeError(f"large stream: status {response.status}")
        async for chunk in response.content.iter_any():
            received += len(chunk)
    if received != expected:
        raise RuntimeError(f"large stream: {received} of {expected} bytes")
    return f"{expected / 2**20 / (time.monotonic() - started):.0f} MiB/s"


async def _streams(url: str, count: int) -> str:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    started = time.monotonic()

    async def one(session: aiohttp.ClientSession) -> str:
        async with session.get(url) as response:
            body = await response.read()
        events = body.count(b"data: ")
        return (
            "ok"
            if response.status == 200 and events == STREAM_EVENTS + 1
            else (f"status {response.status}, {events} events")
        )

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        results = await asyncio.gather(
            *(one(session) for _ in range(count)), return_exceptions=True
        )
    outcomes = Counter(r if isinstance(r, str) else repr(r)[:100] for r in results)
    elapsed = time.monotonic() - started
    if outcomes["ok"] != count:
        failures = ", ".join(f"{n}x {what}" for what, n in outcomes.most_common() if what != "ok")
        raise ScenarioFailed(f"{outcomes['ok']} of {count} complete in {elapsed:.1f} s; {failures}")
    return f"{count} complete in {elapsed:.1f} s"


def warm(child: Child, path: str) -> None:
    for _ in range(50):
        post(child.url(path))


def memory_big(child: Child, size: int) -> Memory:
    return _memory(child, lambda: asyncio.run(_big(child.url("/v1/big"), size)))


def memory_streams(child: Child, count: int) -> Memory:
    return _memory(child, lambda: asyncio.run(_streams(child.url("/v1/stream"), count)))


def _memory(child: Child, scenario: Callable[[], str]) -> Memory:
    warm(child, "/v1/chat/completions")
    before = rss_kib(child.pid)["VmRSS"]
    exact = reset_peak(child.pid)
    try:
        note, failed = scenario(), False
    except ScenarioFailed as exc:
        note, failed = str(exc), True
    status = rss_kib(child.pid)
    time.sleep(1.0)  # let the server close its connections
    after = rss_kib(child.pid)["VmRSS"]
    if not exact:
        note += " (peak since start: clear_refs not permitted)"
    return Memory(before, status["VmHWM"], after, note, failed)


def memory_long_run(
    wrk: str, child: Child, seconds: int, segments: int, connections: int
) -> tuple[int, list[int], int]:
    """RSS (KiB) after a warm-up and after each of `segments` wrk runs."""
    warm(child, "/v1/chat/completions")
    before = rss_kib(child.pid)["VmRSS"]
    samples, total, each = [], 0, max(1, seconds // segments)
    for _ in range(segments):
        load = run_wrk(wrk, child.url("/v1/chat/completions"), each, connections, child.pid)
        total += round(load.rate * each)
        samples.append(rss_kib(child.pid)["VmRSS"])
    return before, samples, total


def median(values: list[float]) -> float:
    return statistics.median(values)
