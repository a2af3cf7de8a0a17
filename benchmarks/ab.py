"""A/B through `serve`: the gateway from another source tree beside this one, with the
floor, under wrk, in rotating rounds; CPU per request from /proc (as `run.py` counts it).

For a change whose effect is smaller than the run-to-run spread of `run.py` (±10-15 % on
a shared machine): both trees serve the same config at the same time, and each round
drives every arm in turn, so both see the same noise.

    git worktree add /tmp/base HEAD~3
    .venv/bin/python benchmarks/ab.py /tmp/base/src [--rounds 3] [--duration 5]
        [--arms healthy,failover,budget,redis] [--engine httpx]

`--arms` picks the gateway arms (default healthy and failover); `budget` is `run.py`'s:
the chat route spending from a SQLite ledger, each tree with a ledger file of its own;
`redis` is healthy with breakers and capacity counts in Redis (`--redis`, each tree under
a key prefix of its own).

The other tree runs on this checkout's virtual environment (`PYTHONPATH` put in front):
only `src/fallback_mw` differs between the arms. `--build compiled` runs each tree's
compiled core instead (its scripts/compile.py --out copy in its build/compiled, built
first when missing or out of date: benchmarks/builds.py); the header names both builds.
`--pin` as `run.py`'s (its docstring says why `split`, the default, holds the per-round
multiples still): every server, both trees' and the floor, on the same CPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import builds
import clients
import procs
import run

ARMS = ("healthy", "failover", "budget", "redis")
SIDES = ("base", "this")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", type=Path, help="the other tree's src directory")
    parser.add_argument("--rounds", type=run.at_least(1), default=3)
    parser.add_argument("--duration", type=run.at_least(1), default=5, help="seconds per arm")
    parser.add_argument("--connections", type=run.at_least(1), default=32)
    parser.add_argument("--arms", default="healthy,failover", help="of " + ",".join(ARMS))
    parser.add_argument("--engine", default="aiohttp", choices=("aiohttp", "httpx"))
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="for --arms redis")
    parser.add_argument(
        "--build",
        choices=builds.BUILDS,
        default="pure",
        help="both trees' build: pure (their sources) or compiled (compile.py --out copies)",
    )
    parser.add_argument("--pin", choices=procs.PINS, default="split", help="as run.py's")
    args = parser.parse_args()
    chosen = [a for a in args.arms.split(",") if a]
    if not chosen or any(a not in ARMS for a in chosen):
        print(f"ab: --arms takes names from {', '.join(ARMS)}", file=sys.stderr)
        return 2
    if not (args.base / "fallback_mw" / "__init__.py").exists():
        print(f"ab: {args.base} holds no fallback_mw package", file=sys.stderr)
        return 2
    try:
        base_env = {"PYTHONPATH": builds.pythonpath(args.build, args.base)}
        this_env = builds.environment(args.build)
    except builds.BuildFailed as exc:
        print(f"ab: {exc}", file=sys.stderr)
        return 2
    print(f"gateway builds: base {builds.named(base_env)}; this {builds.named(this_env)}")
    try:
        wrk, nginx = procs.ensure_tools()
    except procs.ToolMissing as exc:
        print(f"ab: {exc}", file=sys.stderr)
        return 3
    print(f"{procs.pin(args.pin)}; load average {os.getloadavg()[0]:.1f}", flush=True)
    tree = procs.Tree(Path(tempfile.mkdtemp(prefix="fmw-ab-")))
    try:
        upstream, backup, failing = procs.start_nginx(tree, nginx, 8)
        engine = args.engine
        config = run.gateway_config(upstream.port, backup, failing, engine=engine)
        floor = procs.start_floor(tree, upstream.url())

        def pair(kind: str, config_of: Callable[[str], str]) -> dict[str, procs.Child]:
            """One gateway from each tree, each with the config `config_of(side)`."""
            return {
                side: procs.start_gateway(
                    tree,
                    f"{kind}-{side}",
                    config_of(side),
                    base_env if side == "base" else this_env,
                )
                for side in SIDES
            }

        plain = pair("gateway", lambda side: config)  # the healthy and failover arms
        gateways = {"healthy": plain, "failover": plain}
        if "budget" in chosen:
            gateways["budget"] = pair(
                "budget",
                lambda side: run.gateway_config(
                    upstream.port,
                    backup,
                    failing,
                    store=tree.workdir / f"ledger-{side}.db",
                    engine=engine,
                ),
            )
        if "redis" in chosen:
            gateways["redis"] = pair(
                "redis",
                lambda side: run.gateway_config(
                    upstream.port,
                    backup,
                    failing,
                    state=f"{args.redis}?prefix=fmw-ab-{side}-{os.getpid()}:",
                    engine=engine,
                ),
            )
        arms = {"floor": (floor.url(run.CHAT), floor.pid)}
        for arm in chosen:
            for side in SIDES:
                gateway = gateways[arm][side]
                path = "/fo" + run.CHAT if arm == "failover" else run.CHAT
                arms[f"{arm} ({side})"] = (gateway.url(path), gateway.pid)
        run.probe(arms)
        for url, pid in arms.values():
            clients.run_wrk(wrk, url, 1, args.connections, pid)  # warm-up
        loads: dict[str, list[clients.Load]] = {name: [] for name in arms}
        names = list(arms)
        for number in range(args.rounds):
            shift = number % len(names)
            for name in names[shift:] + names[:shift]:
                url, pid = arms[name]
                loads[name].append(clients.run_wrk(wrk, url, args.duration, args.connections, pid))
        floor_cpu = statistics.median(load.cpu_us for load in loads["floor"])
        print(
            f"wrk -t1 -c{args.connections} -d{args.duration}s, {args.rounds} rounds, "
            f"engine {engine}, build {args.build}"
        )
        for name, runs in loads.items():
            cpu = [round(load.cpu_us) for load in runs]
            rate = [round(load.rate) for load in runs]
            median = statistics.median(cpu)
            rounds = [
                f"{a.cpu_us / f.cpu_us:.2f}" for a, f in zip(runs, loads["floor"], strict=True)
            ]
            print(
                f"{name:15} CPU us/req {cpu} median {median:.0f} "
                f"({median / floor_cpu:.2f}x floor), req/s {rate}, x floor by round "
                f"{' '.join(rounds)}",
                flush=True,
            )
        return 0
    finally:
        tree.close()
        shutil.rmtree(tree.workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
