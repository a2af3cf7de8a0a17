"""The process tree of a benchmark run: nginx (the upstream), the floor, gateways.

Every process is a child of the benchmark (and dies with it: PR_SET_PDEATHSIG), listens on
127.0.0.1 on a free port, and writes its output to a file in the run's temporary directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHAT_JSON = (
    '{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,'
    '"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant",'
    '"content":"Hello!"},"finish_reason":"stop"}],'
    '"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}}'
)
SSE_EVENT = '{"id":"chatcmpl-bench","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hi"}}]}'  # noqa: E501
SSE_BODY = f"data: {SSE_EVENT}\\n\\ndata: [DONE]\\n\\n"  # nginx string escapes
STREAM_EVENTS = 40  # events in the slow SSE stream used for the concurrent-streams test
STREAM_RATE = 2048  # bytes/s nginx sends that stream at (each stream lasts ~3 s)


class ToolMissing(RuntimeError):
    """wrk or nginx is not installed and cannot be installed here."""


def ensure_tools() -> tuple[str, str]:
    """Paths of wrk and nginx, installing Debian's packages with apt-get when missing."""

    def find() -> tuple[str | None, str | None]:
        nginx = shutil.which("nginx") or next(
            (p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None
        )
        return shutil.which("wrk"), nginx

    wrk, nginx = find()
    if wrk and nginx:
        return wrk, nginx
    missing = [p for p, found in (("wrk", wrk), ("nginx-light", nginx)) if not found]
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ToolMissing(f"install {' '.join(missing)} (apt-get install {' '.join(missing)})")
    print(f"installing {' '.join(missing)} with apt-get ...", file=sys.stderr, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *missing]):
        subprocess.run(command, env=env, check=False, stdout=subprocess.DEVNULL)
    wrk, nginx = find()
    if not (wrk and nginx):
        raise ToolMissing(f"apt-get could not install {' '.join(missing)}")
    return wrk, nginx


# `use_ports`: [next, end) of an allotted range the ports are taken from; empty: ephemeral.
_RANGE: list[int] = []


def use_ports(base: int, count: int) -> None:
    """Take every port `free_port` gives from `base` .. `base + count - 1` (a shared
    machine's allotted range), not from the ephemeral ones."""
    _RANGE[:] = [base, base + count]


def free_port() -> int:
    if _RANGE:
        while _RANGE[0] < _RANGE[1]:
            port = _RANGE[0]
            _RANGE[0] += 1
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue  # taken: the next one
            return port
        raise RuntimeError(f"no free port left in the range ending at {_RANGE[1] - 1}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:
    # Linux: the child gets SIGTERM when the benchmark dies, even by SIGKILL.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# `--pin`: where each process may run. `split` puts every server under test (the floor and
# each one-process `serve`) on the last CPU and the load (wrk, nginx, the benchmark's own
# clients: they inherit the benchmark's affinity) on the others; `none` leaves all to the
# scheduler. Why split is the default: run.py's docstring.
PINS = ("split", "none")
_SERVER_CPUS: set[int] = set()  # empty: not pinned
_EVERY_CPU: set[int] = set()


def pin(mode: str) -> str:
    """Place this benchmark (and so wrk, nginx and its clients) and the servers started
    from now on as `mode` says; returns the header's line saying what is pinned."""
    cpus = sorted(os.sched_getaffinity(0))
    _SERVER_CPUS.clear()
    if mode == "none" or len(cpus) < 2:
        why = "--pin none" if mode == "none" else f"only CPU {cpus[0]} to run on"
        return f"pinned: nothing ({why}); servers, wrk and nginx where the scheduler puts them"
    server, load = cpus[-1], cpus[:-1]
    _EVERY_CPU.update(cpus)
    _SERVER_CPUS.add(server)
    os.sched_setaffinity(0, load)
    return (
        f"pinned: each server under test on CPU {server}; wrk, nginx and the clients on "
        f"CPU {','.join(map(str, load))} (`serve --workers N`: on every CPU)"
    )


def server_cpus(workers: int = 1) -> set[int]:
    """Where a server runs under `pin` (several workers: every CPU, they are there to use
    them all); empty when nothing is pinned."""
    return set(_SERVER_CPUS if workers == 1 else _EVERY_CPU) if _SERVER_CPUS else set()


def _server_preexec(workers: int) -> Callable[[], None]:
    cpus = server_cpus(workers)

    def preexec() -> None:  # in the child, before exec: every thread and worker inherits it
        die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return preexec


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@dataclass
class Tree:
    """Starts children and stops every one of them on exit."""

    workdir: Path
    children: list[Child] = field(default_factory=list)

    def start(
        self,
        name: str,
        command: list[str],
        port: int,
        env: dict[str, str],
        wait: float = 30,
        preexec: Callable[[], None] = die_with_parent,
    ) -> Child:
        """Start `command`; wait up to `wait` seconds for its port (0: return at once, then
        `listening(child, seconds)`); `preexec` runs in the child before the command."""
        log = self.workdir / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                command,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=preexec,
            )
        child = Child(name, process, port, log)
        self.children.append(child)
        if wait:
            self.listening(child, wait)
        return child

    def listening(self, child: Child, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if child.process.poll() is not None:
                raise RuntimeError(
                    f"{child.name} exited ({child.process.returncode}):\n"
                    f"{child.log.read_text()[-3000:]}"
                )
            try:
                socket.create_connection(("127.0.0.1", child.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(
            f"{child.name} never opened port {child.port}:\n{child.log.read_text()[-3000:]}"
        )

    def stop(self, child: Child) -> None:
        if child.process.poll() is None:
            child.process.terminate()
            try:
                child.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        if child in self.children:
            self.children.remove(child)

    def close(self) -> None:
        for child in list(reversed(self.children)):
            self.stop(child)

    def report(self, lines: int = 20) -> None:
        """The last lines of each child's log on stderr (a run that failed: the working
        directory and its logs are removed on the way out)."""
        for child in self.children:
            status = child.process.poll()
            state = "running" if status is None else f"exited ({status})"
            tail = child.log.read_text(errors="replace").splitlines()[-lines:]
            print(f"--- {child.name}, {state}, its log's last lines:", file=sys.stderr)
            print("\n".join(tail) or "(empty)", file=sys.stderr, flush=True)


def nginx_conf(workdir: Path, ok: int, backup: int, failing: int, big_mib: int) -> str:
    files = workdir / "files"
    files.mkdir(exist_ok=True)
    event = f"data: {SSE_EVENT}\n\n"
    (files / "stream.txt").write_text(event * STREAM_EVENTS + "data: [DONE]\n\n")
    with (files / "big.bin").open("wb") as big:  # sparse: reads as zeros, costs no disk
        big.truncate(big_mib * 1024 * 1024)
    temp = "\n".join(
        f"  {kind}_temp_path {workdir}/nginx-{kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""
daemon off;
master_process off;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log error;
worker_rlimit_nofile 16384;
events {{ worker_connections 8192; }}
http {{
{temp}
  access_log off;
  keepalive_requests 10000000;
  keepalive_timeout 120s;
  sendfile on;
  server {{
    listen 127.0.0.1:{ok} reuseport backlog=4096;
    listen 127.0.0.1:{backup} reuseport backlog=4096;
    location / {{ default_type application/json; return 200 '{CHAT_JSON}'; }}
    location /v1/sse {{ default_type text/event-stream; return 200 '{SSE_BODY}'; }}
    location = /v1/stream {{
      alias {files}/stream.txt; default_type text/event-stream;
      limit_rate_after 512; limit_rate {STREAM_RATE};
    }}
    location = /v1/big {{ alias {files}/big.bin; default_type application/octet-stream; }}
    location = /otlp/v1/traces {{
      access_log {workdir}/otlp.log; default_type application/x-protobuf; return 200 '';
    }}
    location = /otlp/v1/metrics {{ default_type application/x-protobuf; return 200 ''; }}
  }}
  server {{
    listen 127.0.0.1:{failing} reuseport backlog=4096;
    location / {{
      default_type application/json;
      return 503 '{{"error":{{"message":"overloaded","type":"server_error"}}}}';
    }}
  }}
}}
"""


def start_nginx(tree: Tree, nginx: str, big_mib: int) -> tuple[Child, int, int]:
    """nginx answering on three ports; returns it, the backup's port and the failing port."""
    ok, backup, failing = free_port(), free_port(), free_port()
    conf = tree.workdir / "nginx.conf"
    conf.write_text(nginx_conf(tree.workdir, ok, backup, failing, big_mib))
    command = [
        nginx,
        "-p",
        str(tree.workdir),
        "-c",
        str(conf),
        "-e",
        str(tree.workdir / "nginx-error.log"),
    ]
    child = tree.start("nginx", command, ok, dict(os.environ))
    return child, backup, failing


def uvicorn_options() -> list[str]:
    from fallback_mw.cli.serve import server_options  # the server options `serve` uses

    options = server_options()
    return ["--loop", options["loop"], "--http", options["http"]]


def start_floor(tree: Tree, upstream: str, *, wrap: Sequence[str] = (), wait: float = 30) -> Child:
    """The floor; `wrap` goes in front of the command (e.g. valgrind), `wait` as Tree.start."""
    port = free_port()
    command = [
        *wrap, sys.executable, "-m", "uvicorn", "floor:app", "--app-dir", str(HERE),
        "--host", "127.0.0.1", "--port", str(port), "--no-access-log",
        "--lifespan", "off", "--log-level", "warning", *uvicorn_options(),
    ]  # fmt: skip
    env = {**os.environ, "FLOOR_UPSTREAM": upstream}
    return tree.start("floor", command, port, env, wait, _server_preexec(1))


def start_gateway(
    tree: Tree,
    name: str,
    config: str,
    env: dict[str, str] | None = None,
    workers: int = 1,
    *,
    wrap: Sequence[str] = (),
    wait: float = 30,
) -> Child:
    """`fallback-mw serve` with `config`; `wrap` and `wait` as start_floor."""
    port = free_port()
    path = tree.workdir / f"{name}.toml"
    path.write_text(config)
    command = [
        *wrap,
        sys.executable,
        "-m",
        "fallback_mw",
        "serve",
        "--config",
        str(path),
        "--port",
        str(port),
        "--workers",
        str(workers),
    ]
    environment = {**os.environ, "BENCH_KEY": "bench-upstream-key", **(env or {})}
    return tree.start(name, command, port, environment, wait, _server_preexec(workers))


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak since start or since reset_peak) in KiB."""
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0])
    return values


def reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when not permitted."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True
