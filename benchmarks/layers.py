"""CPU per request, layer by layer: what each layer of the gateway costs, in-process.

No sockets, no server, no load generator: an ASGI driver calls the stack directly (the
way uvicorn would: one `http.request` message, then `receive` waits until the response
is complete and returns `http.disconnect`), and the walker's upstream client is a fake
(`FakeClient`, an `UpstreamClient` that answers canned responses). Each row builds its
stack once, warms it up, then drives `--requests` requests through it, `--concurrency`
at a time, on uvloop (what `serve` runs on), with serve's GC settings; CPU is
`time.process_time()` over the timed requests (every thread of the process: the SQLite
ledger's worker threads and the OTel SDK's batch thread count). The number shown is the
lowest of `--rounds` rounds (the steadiest estimate on a shared machine).

Rows build on each other (the `base` column): the per-layer cost is the difference.
`guard-sqlite` is the budget guard alone on the SQLite ledger (in front of a canned
answer, no usage metered); `budget` is the whole gateway with its chat route spending from
a SQLite ledger (run.py's budget arm in process: the hold, the walk, the usage metered,
the settlement with its usage record; the ledger handed in, without run.py's route store
and its once-a-second reload).

With `--nginx` (Debian's nginx, started by the script on loopback as `run.py` does), two
rows leave the fake client for real sockets: a bare in-process aiohttp proxy
(`benchmarks/floor.py`'s app, without uvicorn) and the whole gateway on its real aiohttp
engine. Their difference is what the gateway adds over a bare proxy, in one process,
with the engine seam included: the part of `serve`'s cost the fake-client rows miss.

    .venv/bin/python benchmarks/layers.py [--requests 3000] [--rounds 3] [--only ROW,...]
        [--redis redis://127.0.0.1:6379/0]        # adds the Redis-state row
        [--nginx]                                 # adds the real-engine rows (nginx upstream)
        [--port-base PORT]                        # nginx on PORT .. PORT+9, not ephemeral
    .venv/bin/python benchmarks/layers.py --profile healthy     # cProfile of one row
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import logging
import os
import pstats
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fallback_mw import Gateway
from fallback_mw.budget import Ledger
from fallback_mw.cli.serve import configure_logging, not_found_app, tune_gc
from fallback_mw.config import GatewayConfig, load_config
from fallback_mw.layers.guard import BudgetGuard
from fallback_mw.layers.injector import CredentialInjector
from fallback_mw.layers.resolver import RouteResolver
from fallback_mw.request.types import ASGIApp, Message, Receive, Scope, Send
from fallback_mw.store.ledgers.memory import MemoryLedger
from fallback_mw.store.ledgers.sqlite import SQLiteLedger
from fallback_mw.telemetry import Telemetry
from fallback_mw.upstream.base import UpstreamRequest

CHAT_JSON = (
    b'{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,'
    b'"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant",'
    b'"content":"Hello!"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}}'
)
REQUEST_BODY = (
    b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say hello."}],"max_tokens":16}'
)
# What wrk sends with benchmarks/post_chat.lua, as uvicorn hands it to the app.
REQUEST_HEADERS = [
    (b"host", b"127.0.0.1:8000"),
    (b"content-type", b"application/json"),
    (b"authorization", b"Bearer caller-key-the-gateway-strips"),
    (b"content-length", str(len(REQUEST_BODY)).encode()),
]
PORTS = {"primary": 1001, "backup": 1002, "failing": 1003, "slow": 1004}
SLOW_SECONDS = 0.004  # the hedged route's upstream; its hedge fires after 1 ms


# --- the fake upstream ----------------------------------------------------------------


class FakeResponse:
    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        self._body = body

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        yield self._body

    async def aclose(self) -> None:
        return None


class FakeClient:
    """An UpstreamClient answering by port: `failing` 503, `slow` after SLOW_SECONDS,
    the others at once; `calls` counts sends per upstream (the row checks them)."""

    def __init__(self) -> None:
        self.by_port = {f":{port}": name for name, port in PORTS.items()}
        self.calls = dict.fromkeys(PORTS, 0)
        self.ok = FakeResponse(200, CHAT_JSON)

    async def send(self, request: UpstreamRequest) -> FakeResponse:
        name = self.by_port[request.url[16:21]]  # "http://127.0.0.1" then ":1001"
        self.calls[name] += 1
        if name == "failing":
            return FakeResponse(503, b'{"error":"unavailable"}')
        if name == "slow":
            await asyncio.sleep(SLOW_SECONDS)
        return self.ok

    async def aclose(self) -> None:
        return None


def gateway_config(*, budget: bool = False, state: str = "memory://") -> dict[str, Any]:
    upstreams = {
        name: {"url": f"http://127.0.0.1:{port}", "auth_env": "BENCH_KEY"}
        for name, port in PORTS.items()
    }
    chat: dict[str, Any] = {
        "id": "chat",
        "prefix": "/v1/",
        "plan": ["primary", "backup"],
        "retries": 1,
        "deadline_ms": 120000,
        "replayable_methods": ["GET", "POST"],
    }
    if budget:
        chat["budget"] = "bench"
    return {
        "gateway": {
            "state": state,
            # The failover row really tries its failing primary every time (as run.py).
            "breaker": {"window": 20, "min_calls": 21},
            # Every request of the hedged row may hedge.
            "repeat_budget": {"percent": 1000, "min_per_second": 1000},
        },
        "upstreams": upstreams,
        "routes": [
            chat,
            {
                "id": "failover",
                "prefix": "/fo/",
                "plan": ["failing", "backup"],
                "retries": 1,
                "backoff_ms": 0,
                "replayable_methods": ["GET", "POST"],
            },
            {
                "id": "hedged",
                "prefix": "/hg/",
                "plan": ["slow", "backup"],
                "retries": 2,
                "hedge_after_ms": 1,
                "replayable_methods": ["GET", "POST"],
            },
        ],
        "budgets": {"bench": {"limit": 1_000_000_000, "window": "total"}},
        "prices": {"gpt-4o-mini": {"input_per_mtok": 0.15, "output_per_mtok": 0.60}},
    }


ENVIRON = {"BENCH_KEY": "sk-bench"}
REDIS: list[str] = []  # --redis URL: the Redis-state row's (keys under this run's prefix)
NGINX: list[int] = []  # --nginx: nginx's two chat ports (the real-engine rows)


# --- the stacks -----------------------------------------------------------------------


async def terminal_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Stands in for the walker below a partial stack: answers the canned completion."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(CHAT_JSON)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": CHAT_JSON, "more_body": False})


@dataclass
class Stack:
    app: ASGIApp
    path: str = "/v1/chat/completions"
    provider: str | None = None  # the x-gateway-provider every response must carry
    closers: tuple[Callable[[], Awaitable[None]], ...] = ()
    flush: Callable[[], None] | None = None  # inside the timed region (export work)
    client: FakeClient | None = None


def _config(budget: bool = False) -> GatewayConfig:
    return load_config(gateway_config(budget=budget), environ=ENVIRON)


def partial(layers: int, ledger: Ledger | None = None, budget: bool = False) -> Stack:
    """resolver (1), + guard (2), + injector (3), in front of terminal_app."""
    config = _config(budget)
    app: ASGIApp = terminal_app
    if layers >= 3:
        app = CredentialInjector(app, config=config, environ=ENVIRON)
    closers: tuple[Callable[[], Awaitable[None]], ...] = ()
    if layers >= 2:
        ledger = ledger if ledger is not None else MemoryLedger()
        app = BudgetGuard(app, config=config, ledger=ledger)
        closers = (ledger.aclose,)
    return Stack(RouteResolver(app, config=config), closers=closers)


def slow_machine_ledger(path: Path) -> SQLiteLedger:
    """A SQLite ledger whose calls may wait a minute, not 5 s: under callgrind (about 50x
    slower) on a busy machine, the first call (the file opened and migrated in the worker
    thread) took longer than 5 s and the row failed with 503 budget_unavailable. The
    timeout bounds only a wait: a request's work is the same."""
    return SQLiteLedger(str(path), busy_timeout=60.0)


def full(
    path: str = "/v1/chat/completions",
    provider: str = "primary",
    telemetry: Telemetry | None = None,
    flush: Callable[[], None] | None = None,
    state: str = "memory://",
    ledger: Path | None = None,
) -> Stack:
    """The whole gateway on the fake client; with `ledger`, the chat route spends from a
    SQLite ledger in that file. Handed in (`Gateway(ledger=...)`), not as run.py's `store`:
    a store's reloader opens the file once a second, work per second that callgrind's
    slowdown would count as per request, more on a busier machine."""
    client = FakeClient()
    own = None if ledger is None else slow_machine_ledger(ledger)
    gateway = Gateway(
        not_found_app,
        config=gateway_config(state=state, budget=own is not None),
        environ=ENVIRON,
        client=client,
        telemetry=telemetry,
        ledger=own,
    )
    closers = (gateway.aclose,) if own is None else (gateway.aclose, own.aclose)
    return Stack(gateway, path, provider, closers, flush, client)


def floor_module() -> Any:
    """benchmarks/floor.py, pointed at the nginx upstream (it reads it when it loads)."""
    os.environ["FLOOR_UPSTREAM"] = f"http://127.0.0.1:{NGINX[0]}"
    import floor

    return floor


def bare_proxy(workdir: Path) -> Stack:
    """The in-process floor: benchmarks/floor.py's app itself (read the body, one pooled
    aiohttp session to nginx, relay the response chunk by chunk), without uvicorn."""
    floor = floor_module()

    async def close() -> None:
        if floor.session is not None:
            await floor.session.close()
            floor.session = None

    return Stack(floor.app, provider=None, closers=(close,))


def engine_seam(workdir: Path) -> Stack:
    """The bare proxy's work through the gateway's engine seam (`AiohttpClient.send`, the
    response's `iter_chunks` and `aclose`: the connection cap, the first-byte and idle
    timers, the head checks) instead of aiohttp directly: what the seam costs alone."""
    from fallback_mw.upstream.aiohttp_engine import AiohttpClient
    from fallback_mw.upstream.base import Timeouts

    floor = floor_module()  # the same upstream and hop-by-hop set as the bare proxy
    client = AiohttpClient(max_connections=512)
    upstream = floor.UPSTREAM
    timeouts = Timeouts(connect=3.0, first_byte=30.0, idle=60.0)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        request = UpstreamRequest(
            method=scope["method"], url=upstream + scope["path"],
            headers=[("content-type", "application/json")], body=body, timeouts=timeouts,
            max_connections=100, pool_key="primary",
        )  # fmt: skip
        response = await client.send(request)
        try:
            headers = [(k, v) for k, v in response.headers if k not in floor.HOP_BY_HOP]
            await send(
                {"type": "http.response.start", "status": response.status, "headers": headers}
            )
            async for chunk in response.iter_chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    return Stack(app, provider=None, closers=(client.aclose,))


def real_engine(workdir: Path) -> Stack:
    """The whole gateway (as the healthy row) on its real aiohttp engine, to nginx."""
    config = gateway_config()
    ok, backup = NGINX[0], NGINX[1]  # two ports: a fallback may not be its primary's endpoint
    config["upstreams"] = {
        name: {"url": f"http://127.0.0.1:{port}", "auth_env": "BENCH_KEY"}
        for name, port in (("primary", ok), ("backup", backup))
    }
    config["routes"] = [r for r in config["routes"] if r["id"] == "chat"]
    gateway = Gateway(not_found_app, config=config, environ=ENVIRON)
    return Stack(gateway, provider="primary", closers=(gateway.aclose,))


def quiet_logging() -> logging.Logger:
    """Rows without the log row's handler log nothing (not even failovers' WARNING)."""
    root = logging.getLogger("fallback_mw")
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(logging.NullHandler())
    root.propagate = False
    root.setLevel(logging.CRITICAL + 1)
    return root


def with_request_log(stack: Stack, workdir: Path) -> Stack:
    """serve's logging (cli/serve.py configure_logging: INFO, a line per request), the
    stream a file."""
    root = quiet_logging()
    configure_logging()
    stream = open(workdir / "requests.log", "a")  # noqa: SIM115 (closed by the closer)
    for handler in root.handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(stream)

    async def close() -> None:
        quiet_logging()
        stream.close()

    stack.closers = (*stack.closers, close)
    return stack


def with_sdk(workdir: Path) -> Stack:
    """The OTel SDK as serve configures it for OTLP (batch span processor, six metric
    instruments), with an exporter that encodes each batch to OTLP protobuf exactly as
    serve's OTLP exporter does (serve's in-place encoder, the SDK's in a tree before it),
    and keeps only the byte count (no socket)."""
    try:
        from fallback_mw.cli.otlp_spans import encode_spans
    except ImportError:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class EncodingExporter(SpanExporter):
        def __init__(self) -> None:
            self.spans = 0
            self.bytes = 0

        def export(self, spans: Any) -> SpanExportResult:
            batch: list[ReadableSpan] = list(spans)
            self.bytes += len(encode_spans(batch).SerializePartialToString())
            self.spans += len(batch)
            return SpanExportResult.SUCCESS

    try:  # serve's Resource (a tree before serve_resource: the one serve made then)
        from fallback_mw.cli.otel_setup import serve_resource

        resource = serve_resource({}, "fallback-mw", None)
    except ImportError:
        from opentelemetry.sdk.resources import Resource

        resource = Resource.create({"service.name": "fallback-mw"})

    exporter = EncodingExporter()
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])

    def flush() -> None:
        tracer_provider.force_flush()
        reader.get_metrics_data()  # one collection, as a periodic reader would do

    telemetry = Telemetry(tracer_provider=tracer_provider, meter_provider=meter_provider)
    stack = with_request_log(full(telemetry=telemetry, flush=flush), workdir)

    async def close() -> None:
        tracer_provider.shutdown()
        meter_provider.shutdown()
        if exporter.spans == 0:
            raise RuntimeError("the SDK row exported no spans")

    stack.closers = (*stack.closers, close)
    return stack


@dataclass(frozen=True)
class Row:
    name: str
    label: str
    base: str | None  # the row this one adds a layer to
    budget_us: float  # what this row may add over its base (the table's budget)
    build: Callable[[Path], Stack]


ROWS = (
    Row(
        "driver",
        "ASGI driver + canned answer (the harness)",
        None,
        0,
        lambda w: Stack(terminal_app),
    ),
    Row("resolver", "resolver", "driver", 15, lambda w: partial(1)),
    Row("guard", "+ guard, no budget (memory ledger)", "resolver", 20, lambda w: partial(2)),
    Row(
        "guard-memory",
        "+ guard, budget on the memory ledger",
        "guard",
        25,
        lambda w: partial(2, MemoryLedger(), budget=True),
    ),
    Row(
        "guard-sqlite",
        "+ guard, budget on the SQLite ledger",
        "guard",
        300,
        lambda w: partial(2, slow_machine_ledger(w / "ledger.db"), budget=True),
    ),
    Row("injector", "+ injector", "guard", 10, lambda w: partial(3)),
    Row("healthy", "+ walker, healthy (whole gateway)", "injector", 80, lambda w: full()),
    Row(
        "failover",
        "+ walker, every request fails over",
        "healthy",
        60,
        lambda w: full("/fo/chat/completions", "backup"),
    ),
    Row(
        "hedged",
        "+ walker, every request hedged",
        "healthy",
        80,
        lambda w: full("/hg/chat/completions", "slow"),
    ),
    Row(
        "budget",
        "+ walker, budget on the SQLite ledger",
        "healthy",
        150,
        lambda w: full(ledger=w / "budget.db"),
    ),
    Row(
        "log",
        "+ request log line (INFO, to a file)",
        "healthy",
        15,
        lambda w: with_request_log(full(), w),
    ),
    Row(
        "redis",
        "+ Redis state (breakers, capacity counts)",
        "healthy",
        150,
        lambda w: full(state=f"{REDIS[0]}?prefix=fmw-layers-{os.getpid()}:"),
    ),
    Row("sdk", "+ OTel SDK (batch spans, OTLP encoding; metrics)", "log", 150, with_sdk),
    Row("aiohttp", "bare aiohttp proxy to nginx (in-process floor)", None, 0, bare_proxy),
    Row("seam", "bare proxy through the gateway's engine seam", "aiohttp", 15, engine_seam),
    # What the gateway may add over a bare proxy: its layers' budgets (without the log line).
    Row("engine", "whole gateway, real aiohttp engine to nginx", "aiohttp", 125, real_engine),
)
REAL_ENGINE_ROWS = ("aiohttp", "seam", "engine")


# --- the driver -----------------------------------------------------------------------


class Checked(RuntimeError):
    """A response was not what the row expects: its numbers would mean nothing."""


async def one_request(app: ASGIApp, path: str, provider: str | None) -> None:
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": REQUEST_HEADERS,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    sent = False
    complete = asyncio.Event()
    status = 0
    served_by: bytes | None = None

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": REQUEST_BODY, "more_body": False}
        await complete.wait()  # uvicorn: disconnect once the response is complete
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, served_by
        if message["type"] == "http.response.start":
            status = message["status"]
            for name, value in message["headers"]:
                if name == b"x-gateway-provider":
                    served_by = value
        elif not message.get("more_body", False):
            complete.set()

    await app(scope, receive, send)
    if status != 200 or (provider is not None and served_by != provider.encode()):
        raise Checked(f"{path}: status {status}, provider {served_by!r}, want {provider}")


async def drive(stack: Stack, requests: int, concurrency: int) -> None:
    per_worker, extra = divmod(requests, concurrency)

    async def worker(count: int) -> None:
        for _ in range(count):
            await one_request(stack.app, stack.path, stack.provider)

    await asyncio.gather(*(worker(per_worker + (i < extra)) for i in range(concurrency)))


async def measure(row: Row, workdir: Path, args: argparse.Namespace) -> float:
    """CPU microseconds per request: the lowest over the rounds."""
    stack = row.build(workdir)
    try:
        await drive(stack, args.warmup, args.concurrency)
        best = float("inf")
        for _ in range(args.rounds):
            gc.collect()
            started = time.process_time()
            await drive(stack, args.requests, args.concurrency)
            if stack.flush is not None:
                stack.flush()
            best = min(best, (time.process_time() - started) / args.requests * 1e6)
        if stack.client is not None and row.name == "hedged":
            hedges = stack.client.calls["slow"] - (args.warmup + args.requests * args.rounds)
            if hedges < args.requests:
                raise Checked(f"hedged: only {hedges} hedges fired")
        return best
    finally:
        for close in stack.closers:
            await close()


async def profile(row: Row, workdir: Path, args: argparse.Namespace) -> None:
    stack = row.build(workdir)
    try:
        await drive(stack, args.warmup, args.concurrency)
        profiler = cProfile.Profile()
        profiler.enable()
        await drive(stack, args.requests, args.concurrency)
        profiler.disable()
        stats = pstats.Stats(profiler)
        if args.profile_out:
            stats.dump_stats(args.profile_out)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(40)
    finally:
        for close in stack.closers:
            await close()


def table(results: dict[str, float]) -> list[str]:
    lines = [
        f"{'layer stack':50s} {'CPU us/req':>10s} {'adds':>7s} {'budget':>7s}  verdict",
    ]
    for row in ROWS:
        if row.name not in results:
            continue
        value = results[row.name]
        if row.base is None or row.base not in results:
            lines.append(f"{row.label:50s} {value:10.1f} {'':>7s} {'':>7s}")
            continue
        adds = value - results[row.base]
        verdict = "met" if adds <= row.budget_us else "OVER"
        lines.append(
            f"{row.label:50s} {value:10.1f} {adds:+7.1f} {row.budget_us:7.0f}  "
            f"{verdict} (over {row.base})"
        )
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="timed requests per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--only", default="", help="comma-separated row names")
    parser.add_argument("--profile", metavar="ROW", help="cProfile one row instead")
    parser.add_argument("--profile-out", metavar="FILE", help="also write --profile's stats")
    parser.add_argument(
        "--redis", default="", metavar="URL", help="a Redis for the Redis-state row"
    )
    parser.add_argument(
        "--nginx", action="store_true", help="start nginx and add the real-engine rows"
    )
    parser.add_argument(
        "--port-base", type=int, metavar="PORT",
        help="--nginx listens on PORT .. PORT+9 only (default: ephemeral ports)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.redis:
        REDIS.append(args.redis)
    names = {row.name for row in ROWS}
    wanted = [n for n in args.only.split(",") if n] + ([args.profile] if args.profile else [])
    unknown = [n for n in wanted if n not in names]
    if unknown or min(args.requests, args.rounds, args.concurrency) < 1 or args.warmup < 0:
        parser.error(f"unknown rows {unknown}; rows: {', '.join(sorted(names))}")
    return args


async def main_async(args: argparse.Namespace) -> int:
    only = {n for n in args.only.split(",") if n}
    with tempfile.TemporaryDirectory(prefix="fmw-layers-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        if args.nginx:
            import procs  # benchmarks/procs.py: nginx as run.py starts it

            try:
                _, nginx = procs.ensure_tools()
            except procs.ToolMissing as exc:
                print(f"layers: {exc}", file=sys.stderr)
                return 3
            if args.port_base is not None:
                procs.use_ports(args.port_base, 10)
            tree = procs.Tree(workdir)
            stack.callback(tree.close)
            child, backup, _ = procs.start_nginx(tree, nginx, 1)
            NGINX.extend((child.port, backup))
        if args.profile:
            await profile(next(r for r in ROWS if r.name == args.profile), workdir, args)
            return 0
        results: dict[str, float] = {}
        for row in ROWS:
            if only and row.name not in only:
                continue
            if row.name == "redis" and not REDIS:
                print("  redis         skipped (no --redis URL)", flush=True)
                continue
            if row.name in REAL_ENGINE_ROWS and not NGINX:
                print(f"  {row.name:13s} skipped (no --nginx)", flush=True)
                continue
            results[row.name] = await measure(row, workdir, args)
            print(f"  {row.name:13s} {results[row.name]:8.1f} us/request", flush=True)
    print(
        f"\n{args.requests} requests x {args.rounds} rounds per row, {args.concurrency} "
        f"concurrent, lowest round shown\n"
    )
    print("\n".join(table(results)), flush=True)
    return 0


def main() -> int:
    args = parse_args()
    quiet_logging()
    tune_gc()
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        try:
            return runner.run(main_async(args))
        except Checked as exc:
            print(f"layers: {exc}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
