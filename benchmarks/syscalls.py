"""Where the CPU time that instructions do not count goes: user vs system time, system
calls by kind and context switches per request, for the floor and `fallback-mw serve`
(healthy, and every request failing over) under run.py's load (wrk -t1, fixed
connections, the small chat POST), run.py's processes, configs and pinning.

    .venv/bin/python benchmarks/syscalls.py [--duration 5] [--connections 32]
        [--build pure|compiled] [--pin split|none] [--port-base PORT] [--top 20]

For each arm, two wrk runs after a warm-up: the first reads /proc (utime and stime of
every thread, its voluntary and involuntary context switches) before and after; the
second counts every system call of the server process by kind with `perf stat` on the
syscalls:sys_enter_* tracepoints (in-kernel counters: the server runs near full speed,
unlike under strace). Each number is per request (wrk's count). The table ends with the
gateway minus the floor for each system call the gateway makes more of.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import builds
import clients
import procs
import run


@dataclass
class Threads:
    """Per thread name (comm): user and system clock ticks, voluntary and involuntary
    context switches, summed over the threads of that name."""

    ticks: dict[str, tuple[int, int]] = field(default_factory=dict)
    switches: dict[str, tuple[int, int]] = field(default_factory=dict)


def read_threads(pid: int) -> Threads:
    found = Threads()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            status = (task / "status").read_text()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        user, system = found.ticks.get(name, (0, 0))
        found.ticks[name] = (user + int(fields[11]), system + int(fields[12]))
        numbers = dict(
            (key, int(value))
            for key, _, value in (line.partition(":") for line in status.splitlines())
            if key.endswith("ctxt_switches")
        )
        voluntary, involuntary = found.switches.get(name, (0, 0))
        found.switches[name] = (
            voluntary + numbers["voluntary_ctxt_switches"],
            involuntary + numbers["nonvoluntary_ctxt_switches"],
        )
    return found


def wrk(tool: str, url: str, seconds: int, connections: int, pid: int) -> int:
    """Requests wrk completed against `url` in `seconds` (run.py's runner: clients.run_wrk)."""
    load = clients.run_wrk(tool, url, seconds, connections, pid)
    if load.bad_status:
        raise RuntimeError(f"{url}: {load.bad_status} non-2xx responses")
    return load.requests


@dataclass
class Arm:
    requests: int = 0
    user_us: float = 0.0
    system_us: float = 0.0
    threads: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)
    calls_requests: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    switches: int = 0  # sched:sched_switch events (the server off its CPU), perf's count

    def per_call(self, name: str) -> float:
        return self.calls.get(name, 0) / max(self.calls_requests, 1)


def split(tool: str, url: str, pid: int, seconds: int, connections: int) -> Arm:
    """User and system µs per request, and per thread name CPU and switches."""
    tick = 1e6 / os.sysconf("SC_CLK_TCK")
    before = read_threads(pid)
    requests = wrk(tool, url, seconds, connections, pid)
    after = read_threads(pid)
    arm = Arm(requests=requests)
    for name, (user, system) in after.ticks.items():
        user0, system0 = before.ticks.get(name, (0, 0))
        voluntary, involuntary = after.switches[name]
        voluntary0, involuntary0 = before.switches.get(name, (0, 0))
        arm.threads[name] = (
            (user - user0) * tick / requests,
            (system - system0) * tick / requests,
            (voluntary - voluntary0) / requests,
            (involuntary - involuntary0) / requests,
        )
        arm.user_us += (user - user0) * tick / requests
        arm.system_us += (system - system0) * tick / requests
    return arm


def count_calls(
    perf: str, tool: str, url: str, pid: int, seconds: int, connections: int, arm: Arm
) -> None:
    """System calls by kind of every thread of `pid`, counted by perf during a wrk run."""
    out = Path(tempfile.mkstemp(prefix="fmw-syscalls-", suffix=".txt")[1])
    command = [
        perf, "stat", "-x", ",", "-o", str(out), "-p", str(pid),
        "-e", "syscalls:sys_enter_*", "-e", "sched:sched_switch",
    ]  # fmt: skip
    counting = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=procs.die_with_parent
    )
    try:
        time.sleep(1.0)  # perf opens some 700 counters before it counts
        arm.calls_requests = wrk(tool, url, seconds, connections, pid)
    finally:
        counting.send_signal(2)  # SIGINT: perf writes its counts and ends
        _, errors = counting.communicate(timeout=60)
    text = out.read_text()
    out.unlink()
    for line in text.splitlines():
        parts = line.split(",")
        if len(parts) < 3 or not parts[0].strip().isdigit():
            continue
        event = parts[2]
        if event == "sched:sched_switch":
            arm.switches = int(parts[0])
        elif event.startswith("syscalls:sys_enter_") and int(parts[0]):
            arm.calls[event.removeprefix("syscalls:sys_enter_")] = int(parts[0])
    if not arm.calls:
        raise RuntimeError(f"perf counted no system calls:\n{errors.decode()[-2000:]}\n{text}")


def report(arms: dict[str, Arm], top: int) -> list[str]:
    floor = arms["floor"]
    lines = [
        "CPU per request (/proc utime + stime of every thread), µs:",
        f"  {'arm':9s} {'req':>7s} {'user':>7s} {'system':>7s} {'total':>7s} {'sys %':>6s}"
        f" {'x floor':>8s} {'user x':>7s} {'sys x':>6s}",
    ]
    for name, arm in arms.items():
        total = arm.user_us + arm.system_us
        floor_total = floor.user_us + floor.system_us
        lines.append(
            f"  {name:9s} {arm.requests:7d} {arm.user_us:7.1f} {arm.system_us:7.1f} {total:7.1f}"
            f" {100 * arm.system_us / total:5.1f}% {total / floor_total:7.2f}x"
            f" {arm.user_us / floor.user_us:6.2f}x {arm.system_us / floor.system_us:5.2f}x"
        )
    lines.append("Per thread name: user µs, system µs, voluntary, involuntary switches / request")
    for name, arm in arms.items():
        for thread, (user, system, voluntary, involuntary) in sorted(arm.threads.items()):
            lines.append(
                f"  {name:9s} {thread:16s} {user:7.1f} {system:7.1f} {voluntary:7.3f}"
                f" {involuntary:7.3f}"
            )
    lines.append(
        "System calls per request (perf stat, syscalls:sys_enter_*; "
        + ", ".join(f"{n} {a.calls_requests} requests" for n, a in arms.items())
        + "):"
    )
    names = sorted(
        {call for arm in arms.values() for call in arm.calls},
        key=lambda call: -max(arm.per_call(call) for arm in arms.values()),
    )
    lines.append("  " + f"{'call':22s}" + "".join(f"{n:>10s}" for n in arms))
    for call in names[:top]:
        lines.append(f"  {call:22s}" + "".join(f"{a.per_call(call):10.3f}" for a in arms.values()))
    totals = {n: sum(a.calls.values()) / max(a.calls_requests, 1) for n, a in arms.items()}
    switches = {n: a.switches / max(a.calls_requests, 1) for n, a in arms.items()}
    lines.append(f"  {'all':22s}" + "".join(f"{v:10.3f}" for v in totals.values()))
    lines.append(f"  {'(sched_switch)':22s}" + "".join(f"{v:10.3f}" for v in switches.values()))
    for name, arm in list(arms.items())[1:]:
        more = [
            f"{call} {arm.per_call(call) - floor.per_call(call):+.2f}"
            for call in names
            if abs(arm.per_call(call) - floor.per_call(call)) >= 0.05
        ]
        lines.append(f"{name} minus the floor, per request: " + (", ".join(more) or "nothing"))
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=run.at_least(1), default=5, help="seconds per run")
    parser.add_argument("--connections", type=run.at_least(1), default=32)
    parser.add_argument("--build", choices=builds.BUILDS, default="pure")
    parser.add_argument("--pin", choices=procs.PINS, default="split")
    parser.add_argument("--port-base", type=run.at_least(1024), metavar="PORT")
    parser.add_argument("--top", type=run.at_least(1), default=20, help="system calls shown")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    perf = shutil.which("perf")
    if perf is None:
        print("syscalls: needs perf (Debian: apt-get install linux-perf)", file=sys.stderr)
        return 3
    try:
        tool, nginx = procs.ensure_tools()
    except procs.ToolMissing as exc:
        print(f"syscalls: {exc}", file=sys.stderr)
        return 3
    os.environ.update(builds.environment(args.build))
    if args.port_base is not None:
        procs.use_ports(args.port_base, 10)
    print(f"gateway build: {builds.named({})}\n{procs.pin(args.pin)}", flush=True)
    load = os.getloadavg()[0]
    tree = procs.Tree(Path(tempfile.mkdtemp(prefix="fmw-syscalls-")))
    try:
        upstream, backup, failing = procs.start_nginx(tree, nginx, 1)
        floor = procs.start_floor(tree, upstream.url())
        config = run.gateway_config(upstream.port, backup, failing)
        gateway = procs.start_gateway(tree, "gateway", config)
        targets = {
            "floor": (floor.url(run.CHAT), floor.pid),
            "healthy": (gateway.url(run.CHAT), gateway.pid),
            "failover": (gateway.url("/fo" + run.CHAT), gateway.pid),
        }
        run.probe(targets)
        arms: dict[str, Arm] = {}
        for name, (url, pid) in targets.items():
            wrk(tool, url, 1, args.connections, pid)  # warm-up
            arms[name] = split(tool, url, pid, args.duration, args.connections)
            count_calls(perf, tool, url, pid, args.duration, args.connections, arms[name])
        print(f"wrk -t1 -c{args.connections} -d{args.duration}s, POST {run.CHAT}")
        print("\n".join(report(arms, args.top)))
        print(f"load average: {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    finally:
        tree.close()
        shutil.rmtree(tree.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
