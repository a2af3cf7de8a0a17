"""Instructions per request, counted by valgrind's callgrind: a measure that does not move
with the machine's load, for changes smaller than the CPU-time spread of `run.py` and
`ab.py` (±10-15 % on a shared machine, more on a busy one).

    .venv/bin/python benchmarks/instructions.py serve [--requests 1000] [--base SRC]
        [--arms healthy,failover,budget,tracing] [--port-base PORT] [--start-timeout SECONDS]
        [--cache-sim] [--keep DIR]
    .venv/bin/python benchmarks/instructions.py layers healthy,log [--base SRC]
        [--port-base PORT]

`serve`: the floor (bare uvicorn + aiohttp) and `fallback-mw serve` (healthy, and every
request failing over; with `--arms ...,budget` also `run.py`'s budget arm, the chat route
spending from a SQLite ledger, and with `...,tracing` its tracing arm, the OTel SDK
exporting OTLP to nginx's sink, each a server of its own per tree) run under callgrind in front
of the nginx mock upstreams; after a warm-up the counters are zeroed, `--requests`
requests are sent (8 at a time, from a client outside valgrind), and the count is read
from the dump: every thread of the server process, the event loop, the log writer and
the ledger's worker thread included. `layers`: `layers.py` rows
in process, each run twice (500 and 1,500 timed requests) and the difference divided by
1,000, so start-up and imports cancel out. `--base SRC` counts another source tree
beside this one (as `ab.py`), with `PYTHONHASHSEED=0` in every run. "This" is this
checkout's src/ (run from another checkout's virtual environment too), or `PYTHONPATH`
when it is set (`PYTHONPATH=build/compiled`: the compiled copy). Under callgrind a
process runs some 50x slower: `serve` takes about five minutes, a layers row two.
`--port-base PORT`: every server listens on PORT .. PORT+9 (a port taken is passed over),
not on ephemeral ports; `--start-timeout`: how long the servers, started side by side
under callgrind, may take to listen (default 150 s for each of them: 300 s, 450 s with
`--base`; more on a busy machine). `--cache-sim`: callgrind's cache and branch simulation
too (some 2x slower; the last level simulated is one core's L2, the L3 being shared), each
arm's misses per request and a rough cycle estimate (a first-level miss 10 cycles, a
last-level one 100, a mispredicted branch 15): where CPU time and instructions part.
`--keep DIR`: the dumps are moved there, for a reading by function.

Instructions are not time (a cache miss or a system call costs more than its count), so
this is for A/B of Python-level changes; `run.py` keeps the CPU-time numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import procs
import run

HERE = Path(__file__).resolve().parent
BODY = (
    b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say hello."}],"max_tokens":16}'
)
HEADERS = {"content-type": "application/json", "authorization": "Bearer caller-key"}
START_SECONDS_EACH = 150  # imports under callgrind are slow, and share the cores
# --port-base's range: nginx's three, the floor, this tree, --base's, each tree's budget
# server (with --arms ...,budget), room to skip
PORTS = 10
# `budget`: run.py's budget arm (the chat route spending from a SQLite ledger), a server per
# tree; `tracing`: run.py's tracing arm (the OTel SDK exporting OTLP to nginx's sink), the same
SERVE_ARMS = ("healthy", "failover", "budget", "tracing")


def this_tree() -> str:
    """What "this" counts: this checkout's sources (run from another checkout's virtual
    environment, its editable install would be counted instead), or the PYTHONPATH given
    (a compiled copy: `PYTHONPATH=build/compiled`)."""
    return os.environ.get("PYTHONPATH") or str(HERE.parent / "src")


# `--cache-sim`: callgrind's cache and branch simulation (the first level as valgrind reads
# this machine's, the last as `last_level` says), its events per request, and a rough cycle
# estimate from them (cachegrind's manual: a first-level miss some 10 cycles, a last-level
# miss some 100, a mispredicted branch some 15, the rest one an instruction): what
# instructions alone do not count.
CACHE_SIM = ("--cache-sim=yes", "--branch-sim=yes")
# The last level simulated is one core's own (its L2 where the machine says so): the level
# above it is shared with whatever else the machine runs, which no simulation knows.
CORE_CACHE = Path("/sys/devices/system/cpu/cpu0/cache/index2")


def last_level() -> list[str]:
    """valgrind's `--LL=size,ways,line` for one core's L2 (none when the machine does not
    say: valgrind's own choice, the largest level)."""
    try:
        if (CORE_CACHE / "level").read_text().strip() != "2":
            return []
        size = (CORE_CACHE / "size").read_text().strip()
        ways = (CORE_CACHE / "ways_of_associativity").read_text().strip()
        line = (CORE_CACHE / "coherency_line_size").read_text().strip()
    except OSError:
        return []
    units = {"K": 1024, "M": 1024 * 1024}
    number = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return [f"--LL={number},{ways},{line}"]


MISS_CYCLES = {"I1mr": 10, "D1mr": 10, "D1mw": 10, "ILmr": 100, "DLmr": 100, "DLmw": 100}
MISS_CYCLES |= {"Bcm": 15, "Bim": 15}


def callgrind(out: Path, cache_sim: bool = False) -> list[str]:
    sim = [*CACHE_SIM, *last_level()] if cache_sim else []
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-line=no", *sim]


def events(dump: str) -> dict[str, int] | None:
    """A dump's totals by event name (`Ir` alone without `--cache-sim`), None when it
    holds no totals line yet."""
    names = ["Ir"]
    for line in dump.splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith(("summary:", "totals:")):
            return dict(zip(names, (int(n) for n in line.split()[1:]), strict=False))
    return None


def estimated_cycles(per: dict[str, float]) -> float:
    return per.get("Ir", 0.0) + sum(per.get(name, 0.0) * cost for name, cost in MISS_CYCLES.items())


async def drive(url: str, count: int) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        gate = asyncio.Semaphore(8)

        async def one() -> None:
            async with gate, session.post(url, data=BODY, headers=HEADERS) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"{url} answered {response.status}")

        await asyncio.gather(*(one() for _ in range(count)))


def counted(process: subprocess.Popen[bytes], out: Path, url: str, count: int) -> dict[str, float]:
    """Events per request (`Ir`: instructions) for `count` requests to `url` (counters
    zeroed first)."""
    subprocess.run(["callgrind_control", "-z", str(process.pid)], capture_output=True, check=True)
    asyncio.run(drive(url, count))
    before = set(out.parent.glob(out.name + "*"))
    subprocess.run(["callgrind_control", "-d", str(process.pid)], capture_output=True, check=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for dump in set(out.parent.glob(out.name + "*")) - before:
            totals = events(dump.read_text(errors="replace"))
            if totals is not None:
                return {name: value / count for name, value in totals.items()}
        time.sleep(0.5)
    raise RuntimeError("callgrind wrote no dump")


def serve_arms(args: argparse.Namespace) -> int:
    os.environ["PYTHONHASHSEED"] = "0"  # inherited by every server: the same dict layouts
    wrk, nginx = procs.ensure_tools()
    del wrk
    if args.port_base is not None:
        procs.use_ports(args.port_base, PORTS)
    tree = procs.Tree(Path(tempfile.mkdtemp(prefix="fmw-instr-")))
    try:
        upstream, backup, failing = procs.start_nginx(tree, nginx, 8)
        config = run.gateway_config(upstream.port, backup, failing)
        sides = ([("base", {"PYTHONPATH": str(args.base)})] if args.base is not None else []) + [
            ("this", {"PYTHONPATH": this_tree()})
        ]
        # name -> (config, environment); a budget arm is a process of its own (its config
        # spends the chat route from a SQLite ledger), each tree with its own ledger file.
        gateways: dict[str, tuple[str, dict[str, str]]] = {}
        if "healthy" in args.arms or "failover" in args.arms:
            gateways.update((side, (config, env)) for side, env in sides)
        if "budget" in args.arms:
            for side, env in sides:
                ledger = tree.workdir / f"ledger-{side}.db"
                budgeted = run.gateway_config(upstream.port, backup, failing, store=ledger)
                gateways[f"budget-{side}"] = (budgeted, env)
        if "tracing" in args.arms:
            sink = run.otlp_sink(upstream)
            for side, env in sides:
                gateways[f"tracing-{side}"] = (config, {**env, **sink})
        outs = {name: tree.workdir / f"{name}.callgrind" for name in ("floor", *gateways)}
        sim = args.cache_sim
        floor_wrap = callgrind(outs["floor"], sim)
        servers = {"floor": procs.start_floor(tree, upstream.url(), wrap=floor_wrap, wait=0)}
        for name, (text, env) in gateways.items():
            servers[name] = procs.start_gateway(
                tree, name, text, env, wrap=callgrind(outs[name], sim), wait=0
            )
        start = args.start_timeout or START_SECONDS_EACH * len(servers)
        started = time.monotonic()
        for child in servers.values():  # started side by side: imports under callgrind are slow
            tree.listening(child, max(start - (time.monotonic() - started), 1.0))
        ports = sorted([*(child.port for child in tree.children), backup, failing])
        print(f"listening after {time.monotonic() - started:.0f} s on ports {ports}")
        arms: list[tuple[str, str, str]] = [("floor", "floor", run.CHAT)]
        for side, _ in sides:
            for arm in args.arms:
                if arm in ("budget", "tracing"):
                    arms.append((f"{arm} ({side})", f"{arm}-{side}", run.CHAT))
                else:
                    path = "/fo" + run.CHAT if arm == "failover" else run.CHAT
                    arms.append((f"{arm} ({side})", side, path))
        for _, name, path in arms:  # warm-up: pools, caches, first-call work
            asyncio.run(drive(servers[name].url(path), 100))
        results: dict[str, dict[str, float]] = {}
        for arm, name, path in arms:
            child = servers[name]
            results[arm] = counted(child.process, outs[name], child.url(path), args.requests)
        floor_count = results["floor"]["Ir"]
        print(f"instructions per request (callgrind, {args.requests} requests, 8 at a time)")
        for arm, per in results.items():
            value = per["Ir"]
            print(f"  {arm:<18} {value / 1000:8.0f}k  {value / floor_count:5.2f}x floor")
        if sim:
            print_cache_sim(results)
    finally:
        tree.close()
        if args.keep is not None:  # the dumps, for a reading by function
            args.keep.mkdir(parents=True, exist_ok=True)
            for dump in tree.workdir.glob("*.callgrind*"):
                shutil.move(dump, args.keep / dump.name)
        shutil.rmtree(tree.workdir, ignore_errors=True)  # dumps, logs, ledgers: ~10 MB a run
    return 0


def print_cache_sim(results: dict[str, dict[str, float]]) -> None:
    floor = results["floor"]
    names = [name for name in floor if name != "Ir"]
    print("simulated cache and branch events per request (--cache-sim), and cycles estimated")
    print(f"  {'':<18} " + " ".join(f"{name:>7}" for name in names) + "   cycles  x floor")
    for arm, per in results.items():
        cycles = estimated_cycles(per)
        row = " ".join(f"{per.get(name, 0.0):7.0f}" for name in names)
        print(f"  {arm:<18} {row} {cycles / 1000:7.0f}k {cycles / estimated_cycles(floor):6.2f}x")


def layer_rows(args: argparse.Namespace) -> int:
    from layers import REAL_ENGINE_ROWS  # the rows that need nginx

    trees = [("base", str(args.base))] if args.base is not None else []
    trees.append(("this", this_tree()))
    print("instructions per request in process (callgrind, 1500 - 500 requests)")
    for row in args.rows.split(","):
        for name, path in trees:
            counts = []
            for requests in (500, 1500):
                command = [
                    *callgrind(Path(os.devnull)), sys.executable, str(HERE / "layers.py"),
                    "--only", row, "--rounds", "1", "--warmup", "100", "--requests", str(requests),
                    *(["--nginx"] if row in REAL_ENGINE_ROWS else []),  # real sockets
                    *(["--port-base", str(args.port_base)] if args.port_base else []),
                ]  # fmt: skip
                env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": path}
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                found = [ln for ln in done.stderr.splitlines() if "Collected :" in ln]
                if done.returncode != 0 or not found:
                    print(
                        f"layers.py --only {row} failed:\n{done.stderr[-3000:]}",
                        file=sys.stderr,
                    )
                    return 1
                counts.append(int(found[-1].split(":")[-1]))
            print(f"  {row:<10} {name:<5} {(counts[1] - counts[0]) / 1000 / 1000:8.0f}k")
    return 0


def serve_arm_names(text: str) -> list[str]:
    names = [name for name in text.split(",") if name]
    if not names or any(name not in SERVE_ARMS for name in names):
        raise argparse.ArgumentTypeError(f"takes names from {', '.join(SERVE_ARMS)}")
    return names


def port_base(text: str) -> int:
    base = run.at_least(1024)(text)
    if base + PORTS - 1 > 65535:
        raise argparse.ArgumentTypeError(f"{base} leaves no room for {PORTS} ports below 65536")
    return base


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    serve = sub.add_parser("serve", help="the floor and serve, healthy and failing over")
    serve.add_argument("--requests", type=run.at_least(10), default=1000)
    serve.add_argument(
        "--arms", type=serve_arm_names, default=["healthy", "failover"],
        help=f"of {','.join(SERVE_ARMS)} (default healthy,failover)",
    )  # fmt: skip
    serve.add_argument(
        "--port-base", type=port_base, metavar="PORT",
        help=f"listen on PORT .. PORT+{PORTS - 1} only (default: ephemeral ports)",
    )  # fmt: skip
    serve.add_argument(
        "--cache-sim", action="store_true",
        help="simulate the caches and branches too (slower): misses per request, cycles",
    )  # fmt: skip
    serve.add_argument(
        "--keep", type=Path, metavar="DIR", help="move the callgrind dumps to DIR at the end"
    )
    serve.add_argument(
        "--start-timeout", type=run.at_least(1), metavar="SECONDS",
        help=f"for the servers to listen (default: {START_SECONDS_EACH} s for each)",
    )  # fmt: skip
    layers = sub.add_parser("layers", help="layers.py rows, in process")
    layers.add_argument("rows", help="comma-separated layers.py row names")
    layers.add_argument(
        "--port-base", type=port_base, metavar="PORT",
        help="the real-engine rows' nginx on PORT .. PORT+9 (default: ephemeral ports)",
    )  # fmt: skip
    for each in (serve, layers):
        each.add_argument("--base", type=Path, help="another tree's src directory, counted beside")
    args = parser.parse_args()
    if args.base is not None and not (args.base / "fallback_mw" / "__init__.py").exists():
        print(f"instructions: {args.base} holds no fallback_mw package", file=sys.stderr)
        return 2
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("instructions: needs valgrind (Debian: apt-get install valgrind)", file=sys.stderr)
        return 3
    return serve_arms(args) if args.what == "serve" else layer_rows(args)


if __name__ == "__main__":
    sys.exit(main())
