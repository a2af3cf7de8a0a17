"""What `fallback-mw serve` costs, side by side with the floor, under wrk.

One process tree: nginx (the upstream: a fixed chat JSON, SSE, a slow SSE stream, a large
file, a 503-answering port, an OTLP sink), the floor (benchmarks/floor.py: the fewest lines
of ASGI that forward a request, same uvicorn and aiohttp as serve) and `fallback-mw serve`
processes. wrk (-t1, fixed connections, a small chat POST) drives each arm in turn, the
order rotating every round, each arm's window beside a floor window of its own (`--floor
each`, the default: the floor first in one round, second in the next); the table shows
medians over rounds and each arm's per-round ratios to the floor window beside it. With
`--floor once` (every run before the option), one floor window per round stood for all
the arms: a machine that drifted within the round (the floor's CPU per request moved by up
to 1.5x between two rounds of one run) moved an arm's ratio with the distance between its
window and the floor's. Then: SSE time to first event at low load (interleaved requests), and memory
(RSS before, peak and after) for one large stream, many concurrent streams and a long run.
Installs Debian's wrk and nginx-light with apt-get when they are missing (as root).

    .venv/bin/python benchmarks/run.py [--duration 8] [--rounds 3] [--connections 32]
    .venv/bin/python benchmarks/run.py --quick        # seconds, not minutes: smoke run
    .venv/bin/python benchmarks/run.py --no-memory --engines --workers 2   # + httpx, workers
    .venv/bin/python benchmarks/run.py --build compiled   # serve from the compiled core

`--build compiled` runs every `serve` arm from scripts/compile.py's compiled copy of this
checkout (benchmarks/builds.py: built first when missing or out of date); the header names
the build measured.

`--pin split` (the default on 2 or more CPUs) runs every server under test, the floor and
each one-process `serve` alike, on the last CPU, and wrk, nginx and the script's own
clients on the others (`serve --workers N` on every CPU: it is there to use them all);
`--pin none` leaves them to the scheduler, as every run before the option did. Left to it
on 2 cores, a server shares its core with wrk and nginx for a part of each window that
changes from window to window, and sharing changes the work itself (each response wakes a
client that preempts the server, up to 19,000 times a second against about 150 pinned;
requests pile up between its turns): under the same load, one arm's CPU per request moved
by up to 1.39x between rounds unpinned against 1.19x pinned, a round's multiple of the floor
by up to 1.41x against 1.15x (1.8x in an earlier unpinned run, quiet machine). Split is a real
deployment's placement (no client on the server's core); both arms then spend more per
request than on a shared core (the floor 20-35 % on the 2-core machine of
docs/performance.md), their multiple within the unpinned runs' spread. The header says
what was pinned.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import builds
import clients
import procs
from clients import Load, Memory, median
from procs import Tree

CHAT = "/v1/chat/completions"


def gateway_config(
    ok: int,
    backup: int,
    failing: int,
    store: Path | None = None,
    *,
    engine: str = "aiohttp",
    state: str = "memory://",
) -> str:
    """One config for every arm; with `store`, the chat route spends from a SQLite ledger;
    `engine` the upstream client, `state` where breakers and capacity counts live."""
    # max_connections: the floor's pool (512), not the per-upstream default (100), so the
    # 1,000 concurrent streams queue for the pool no longer through serve than the floor.
    upstreams = "".join(
        f'[upstreams.{name}]\nurl = "http://127.0.0.1:{port}"\nauth_env = "BENCH_KEY"\n'
        "max_connections = 512\n"
        for name, port in (("primary", ok), ("backup", backup), ("failing", failing))
    )
    store_line = f'store = "sqlite:///{store}"' if store else ""
    budget_line = 'budget = "bench"' if store else ""
    budget_tables = (
        '[budgets.bench]\nlimit = 1000000000\nwindow = "total"\n'
        '[prices."gpt-4o-mini"]\ninput_per_mtok = 0.15\noutput_per_mtok = 0.60\n'
        if store
        else ""
    )
    # The large stream must not be stopped by max_response_body. The failover arm must
    # really try its failing primary on every request: a breaker that cannot open
    # (min_calls above the window) keeps it from being skipped.
    return f"""
[gateway]
max_response_body = 1073741824
engine = "{engine}"
state = "{state}"
{store_line}
[gateway.breaker]
window = 20
min_calls = 21
{upstreams}
[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retries = 1
deadline_ms = 120000
replayable_methods = ["GET", "POST"]
{budget_line}
[[routes]]
id = "failover"
prefix = "/fo/"
plan = ["failing", "backup"]
retries = 1
replayable_methods = ["GET", "POST"]
{budget_tables}"""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def probe(arms: dict[str, tuple[str, int]]) -> None:
    """Each arm answers what it is meant to answer, before any number is taken."""
    for name, (url, _) in arms.items():
        status, headers, body = clients.post(url)
        check(status == 200 and b"chatcmpl-bench" in body, f"{name}: status {status}")
        if name.startswith("failover"):
            attempts, provider = (
                headers.get("x-gateway-attempts"),
                headers.get("x-gateway-provider"),
            )
            check(attempts == "2" and provider == "backup", f"failover: {attempts=} {provider=}")
        elif name != "floor":
            check(headers.get("x-gateway-provider") == "primary", f"{name}: not routed")


def ratio_cells(load: list[Load], floor: list[Load]) -> tuple[float, float]:
    rate = median([a.rate / f.rate for a, f in zip(load, floor, strict=True)])
    p99 = median([a.p99_ms / f.p99_ms for a, f in zip(load, floor, strict=True)])
    return rate, p99


TARGETS = {  # arm: (min req/s ratio to the floor's healthy, max p99 ratio or None)
    "healthy": (0.5, 1.5),
    "failover": (0.35, None),
    "tracing": (0.3, None),
    "budget": (0.25, None),
}
CPU_TARGETS = {"healthy": 2.0, "failover": 3.0, "tracing": 3.5, "budget": 4.0}  # x floor
LABELS = {
    "floor": "floor (bare ASGI + aiohttp)",
    "healthy": "serve, healthy",
    "failover": "serve, every request fails over",
    "tracing": "serve, tracing on (OTLP sink)",
    "budget": "serve, budget on SQLite ledger",
    # --engines: the same two arms on the other upstream client
    "healthy-httpx": "serve, healthy, httpx engine",
    "failover-httpx": "serve, fails over, httpx engine",
    # --workers N: the healthy arm with breakers in Redis, one process and N
    "redis-1": "serve, healthy, Redis state",
    "redis-n": "serve --workers N, Redis state",
}


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def throughput(
    args: argparse.Namespace, wrk: str, arms: dict[str, tuple[str, int]]
) -> tuple[list[str], bool]:
    """`arms`: name -> (URL, pid of the server process behind it)."""
    results: dict[str, list[Load]] = {name: [] for name in arms}
    # The floor each arm's ratios are taken against: the window beside it (--floor each),
    # or the round's one floor window (--floor once).
    floors: dict[str, list[Load]] = {name: [] for name in arms}
    if not args.quick:  # the smoke run's numbers mean nothing anyway
        for url, pid in arms.values():
            clients.run_wrk(wrk, url, 1, args.connections, pid)  # warm-up
    names = [name for name in arms if name != "floor"]

    def window(round_number: int, name: str) -> Load:
        url, pid = arms[name]
        load = clients.run_wrk(wrk, url, args.duration, args.connections, pid)
        results[name].append(load)
        print(
            f"  round {round_number + 1} {name:9s} {load.rate:8.0f} req/s "
            f"p50 {load.p50_ms:6.1f} ms p99 {load.p99_ms:6.1f} ms "
            f"CPU {load.cpu_us:5.0f} us/req",
            flush=True,
        )
        return load

    for round_number in range(args.rounds):
        if args.floor == "once":
            order = ["floor", *names]
            shift = round_number % len(order)
            for name in order[shift:] + order[:shift]:
                window(round_number, name)
            for name in names:
                floors[name].append(results["floor"][-1])
            continue
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            # A floor window beside each arm's, first in one round and second in the
            # next: a machine that drifts within a round moves both alike.
            if round_number % 2 == 0:
                floors[name].append(window(round_number, "floor"))
                window(round_number, name)
            else:
                window(round_number, name)
                floors[name].append(window(round_number, "floor"))
    floors["floor"] = results["floor"]
    lines = [
        f"{'arm':34s} {'req/s':>7s} {'p50 ms':>7s} {'p99 ms':>7s} {'CPU us':>7s} "
        f"{'x floor':>8s} {'p99 x':>6s}  target",
    ]
    broken = False
    for name, loads in results.items():
        rate, p99 = ratio_cells(loads, floors[name])
        target = ""
        if name in TARGETS:
            want_rate, want_p99 = TARGETS[name]
            target = f">= {want_rate}x {verdict(rate >= want_rate)}"
            if want_p99 is not None:
                target += f", p99 <= {want_p99}x {verdict(p99 <= want_p99)}"
        errors = sum(x.bad_status for x in loads), sum(x.socket_errors for x in loads)
        if errors[0]:
            broken = True
            target += f"  BROKEN: {errors[0]} non-2xx responses"
        if errors[1]:
            target += f"  ({errors[1]} socket errors)"
        label = LABELS[name].replace(" N,", f" {args.workers},")
        lines.append(
            f"{label:34s} {median([x.rate for x in loads]):7.0f} "
            f"{median([x.p50_ms for x in loads]):7.1f} {median([x.p99_ms for x in loads]):7.1f} "
            f"{median([x.cpu_us for x in loads]):7.0f} {rate:7.2f}x {p99:5.2f}x  {target}"
        )
    beside = "beside it" if args.floor == "each" else "in the same round"
    lines.append(f"CPU per request, x the floor's window {beside} (max/min over rounds):")
    for name, loads in list(results.items())[1:]:
        cpu = [a.cpu_us / f.cpu_us for a, f in zip(loads, floors[name], strict=True)]
        want = CPU_TARGETS.get(name)
        target = f"  target <= {want}x {verdict(median(cpu) <= want)}" if want else ""
        lines.append(
            f"  {LABELS[name].replace(' N,', f' {args.workers},'):32s} "
            + " ".join(f"{x:.2f}" for x in cpu)
            + f"  median {median(cpu):.2f}x ({max(cpu) / min(cpu):.2f}){target}"
        )
    return lines, broken


def first_event(args: argparse.Namespace, floor: procs.Child, gateway: procs.Child) -> list[str]:
    times = clients.first_event_pairs(
        {"floor": floor, "serve": gateway}, "/v1/sse", args.sse_samples
    )
    f50, g50 = median(times["floor"]), median(times["serve"])
    delta = g50 - f50
    return [
        f"SSE time to first event, {args.sse_samples} interleaved requests one at a time:",
        f"  floor median {f50:.2f} ms, serve median {g50:.2f} ms, "
        f"serve - floor {delta:+.2f} ms (target within 1 ms: {verdict(delta <= 1.0)})",
    ]


def memory_line(label: str, memory: Memory, limit_mib: float | None) -> str:
    target = ""
    if limit_mib is not None:
        ok = memory.added_mib < limit_mib and not memory.failed
        target = f"  (target < {limit_mib:.0f} MiB, all complete: {verdict(ok)})"
    return (
        f"  {label:28s} before {memory.before / 1024:6.1f} MiB  peak {memory.peak / 1024:6.1f} MiB"
        f"  after {memory.after / 1024:6.1f} MiB  added {memory.added_mib:+6.1f} MiB{target}"
        f"  [{memory.note}]"
    )


def memory(args: argparse.Namespace, tree: Tree, wrk: str, config: str, upstream: str) -> list[str]:
    lines = ["Memory (VmRSS / VmHWM of one fresh process per scenario, after a warm-up):"]
    size = args.big_mib * 1024 * 1024
    for label, start in (
        ("floor", lambda: procs.start_floor(tree, upstream)),
        ("serve", lambda: procs.start_gateway(tree, "gateway-memory", config)),
    ):
        target = label == "serve"
        child = start()
        lines.append(
            memory_line(
                f"{label}: one {args.big_mib} MiB stream",
                clients.memory_big(child, size),
                30 if target else None,
            )
        )
        tree.stop(child)
        child = start()
        streams = clients.memory_streams(child, args.streams)
        lines.append(
            memory_line(f"{label}: {args.streams} SSE streams", streams, 150 if target else None)
        )
        tree.stop(child)
    child = procs.start_gateway(tree, "gateway-long", config)
    before, samples, total = clients.memory_long_run(
        wrk, child, args.long_seconds, args.segments, args.connections
    )
    tree.stop(child)
    growth = (samples[-1] - samples[1]) / 1024
    lines.append(
        f"  serve: long run, {total} requests: RSS before {before / 1024:.1f} MiB, after each "
        f"segment "
        + " ".join(f"{s / 1024:.1f}" for s in samples)
        + f" MiB; growth after the 2nd segment {growth:+.1f} MiB"
        f" (target flat, < 2 MiB: {verdict(growth < 2)})"
    )
    return lines


def at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is less than {low}")
        return value

    return parse


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=at_least(1), default=8, help="seconds per wrk run")
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--connections", type=at_least(1), default=32)
    parser.add_argument("--sse-samples", type=at_least(1), default=300)
    parser.add_argument("--big-mib", type=at_least(1), default=200)
    parser.add_argument("--streams", type=at_least(1), default=1000)
    parser.add_argument("--long-seconds", type=at_least(1), default=60)
    parser.add_argument(
        "--segments", type=at_least(2), default=6, help="RSS samples in the long run"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory scenarios")
    parser.add_argument("--memory-only", action="store_true", help="only the memory scenarios")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument(
        "--engines", action="store_true", help="also the healthy and failover arms on httpx"
    )
    parser.add_argument(
        "--workers",
        type=at_least(2),
        default=None,
        metavar="N",
        help="also healthy with Redis state on 1 and on N worker processes",
    )
    parser.add_argument(
        "--redis", default="redis://127.0.0.1:6379/0", help="the Redis for --workers"
    )
    parser.add_argument(
        "--build",
        choices=builds.BUILDS,
        default="pure",
        help="the gateway's build: pure (this checkout's sources) or compiled "
        "(scripts/compile.py --out's copy, built when missing)",
    )
    parser.add_argument("--pin", choices=procs.PINS, default="split", help="see the docstring")
    parser.add_argument(
        "--floor",
        choices=("each", "once"),
        default="each",
        help="a floor window beside each arm's (each), or one per round (once); see the docstring",
    )
    args = parser.parse_args()
    if args.quick:
        args.duration, args.rounds, args.sse_samples = 1, 1, 5
        args.big_mib, args.streams, args.long_seconds, args.segments = 8, 20, 3, 3
    return args


def otlp_sink(upstream: procs.Child) -> dict[str, str]:
    """The tracing arm's environment: the OTel SDK exporting spans and metrics as OTLP to
    nginx's sink."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": upstream.url("/otlp"),  # nginx answers 200
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "otlp",
    }


def speed_arms(
    args: argparse.Namespace, tree: Tree, wrk: str, upstream: procs.Child, backup: int, failing: int
) -> tuple[list[str], bool]:
    """Throughput and latency under wrk, then SSE time to first event."""
    config = gateway_config(upstream.port, backup, failing)
    floor = procs.start_floor(tree, upstream.url())
    gateway = procs.start_gateway(tree, "gateway", config)
    traced = procs.start_gateway(tree, "gateway-traced", config, otlp_sink(upstream))
    ledger = gateway_config(upstream.port, backup, failing, store=tree.workdir / "ledger.db")
    budgeted = procs.start_gateway(tree, "gateway-budget", ledger)
    arms = {
        "floor": (floor.url(CHAT), floor.pid),
        "healthy": (gateway.url(CHAT), gateway.pid),
        "failover": (gateway.url("/fo" + CHAT), gateway.pid),
        "tracing": (traced.url(CHAT), traced.pid),
        "budget": (budgeted.url(CHAT), budgeted.pid),
    }
    extra: list[procs.Child] = [traced, budgeted]
    if args.engines:
        httpx_config = gateway_config(upstream.port, backup, failing, engine="httpx")
        on_httpx = procs.start_gateway(tree, "gateway-httpx", httpx_config)
        arms["healthy-httpx"] = (on_httpx.url(CHAT), on_httpx.pid)
        arms["failover-httpx"] = (on_httpx.url("/fo" + CHAT), on_httpx.pid)
        extra.append(on_httpx)
    if args.workers:
        # Breakers and capacity counts in Redis (a key prefix of this run's own): the
        # state several workers need; one process and N on the same config.
        state = f"{args.redis}?prefix=fmw-bench-{os.getpid()}:"
        shared = gateway_config(upstream.port, backup, failing, state=state)
        one = procs.start_gateway(tree, "gateway-redis-1", shared)
        many = procs.start_gateway(tree, "gateway-redis-n", shared, workers=args.workers)
        arms["redis-1"] = (one.url(CHAT), one.pid)
        arms["redis-n"] = (many.url(CHAT), many.pid)
        extra += [one, many]
    probe(arms)
    print(
        f"wrk -t1 -c{args.connections} -d{args.duration}s, {args.rounds} rounds, POST {CHAT}",
        flush=True,
    )
    table, broken = throughput(args, wrk, arms)
    otlp_log = tree.workdir / "otlp.log"
    exported = otlp_log.read_text().count("\n") if otlp_log.exists() else 0
    check(exported > 0, "the tracing arm exported no spans")
    for child in extra:
        tree.stop(child)
    lines = [*table, f"(tracing arm: {exported} OTLP span exports received by the sink)", ""]
    lines += first_event(args, floor, gateway)
    for child in (gateway, floor):
        tree.stop(child)
    return lines, broken


def main() -> int:
    args = parse_args()
    try:
        wrk, nginx = procs.ensure_tools()
    except procs.ToolMissing as exc:
        print(f"benchmark: {exc}", file=sys.stderr)
        return 3
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        # Every process started from here on inherits it (the floor imports no fallback_mw).
        os.environ.update(builds.environment(args.build))
    except builds.BuildFailed as exc:
        print(f"benchmark: {exc}", file=sys.stderr)
        return 2
    build = f"gateway build: {builds.named({})}\n{procs.pin(args.pin)}"
    print(build, flush=True)
    load_at_start = os.getloadavg()[0]  # the machine's other work, for the reader
    workdir = Path(tempfile.mkdtemp(prefix="fmw-bench-"))
    tree = Tree(workdir)
    try:
        upstream, backup, failing = procs.start_nginx(tree, nginx, args.big_mib)
        config = gateway_config(upstream.port, backup, failing)
        lines: list[str] = [build]
        broken = False
        if not args.memory_only:
            speed, broken = speed_arms(args, tree, wrk, upstream, backup, failing)
            lines += speed
        if not args.no_memory:
            lines += ["", *memory(args, tree, wrk, config, upstream.url())]
        lines.append(
            f"load average: {load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
        )
        print("\n" + "\n".join(lines), flush=True)
        return 1 if broken else 0
    except Exception:
        tree.report()
        raise
    finally:
        tree.close()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
