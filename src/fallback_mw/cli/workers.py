"""`serve --workers N`: N gateway processes on one address, one per core.

The supervisor (this process) binds the address first, so a busy or forbidden address is
one error line before anything starts, then forks the workers. Each worker opens its own
listening socket on that address with SO_REUSEPORT, so the kernel spreads new
connections across the workers evenly (one shared accept queue would hand most of them
to whichever worker happens to be idle). Each worker builds its own gateway, OTel SDK,
upstream connection pool and event loop after the fork: nothing with a thread, a socket
or a loop crosses it.

What the workers share is what the configuration shares: breakers and capacity counts
through `gateway.state` (Redis), budgets and usage through `gateway.store` (SQLite on one
machine, PostgreSQL across machines). `serve` refuses N > 1 when either would be kept in
each process's memory (`check_shared`): two workers would each keep their own breakers
and budgets, and the gateway would silently do N times what it was configured to do.

SIGINT / SIGTERM to the supervisor stop every worker (each finishes its requests in
flight, as uvicorn does on SIGTERM). A worker that dies on its own is replaced; one that
fails within its first seconds (a start-up error: it printed its own line) stops them
all, and the supervisor exits with its status."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType

from fallback_mw.cli.app import Console, Refused, dispatch
from fallback_mw.config import GatewayConfig

# A worker that exits within this long of its start failed at start-up: not replaced.
START_UP_SECONDS = 5.0
_STOP_GRACE_SECONDS = 30.0


def check_shared(config: GatewayConfig, workers: int) -> None:
    """Refuse N > 1 workers when breakers, capacity or budgets would be per process."""
    if workers <= 1:
        return
    settings = config.gateway
    if settings.state in ("memory://", "memory", ""):
        raise Refused(
            f'--workers {workers} needs a shared state: gateway.state is "memory://", so each '
            'worker would keep its own breakers and capacity counts; set state = "redis://..."'
        )
    if settings.store is None and any(route.budget for route in config.routes):
        raise Refused(
            f"--workers {workers} needs a shared store: budgets on the in-memory ledger "
            'would be per worker; set gateway.store = "sqlite:///..." or "postgresql://..."'
        )


def _exit_now(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


class Supervisor:
    """Forks `count` workers, each running `worker(sock)` (returns an exit status) on its
    own SO_REUSEPORT socket; replaces a worker that dies after start-up."""

    def __init__(
        self,
        count: int,
        host: str,
        port: int,
        worker: Callable[[socket.socket], int | None],
        *,
        bind: Callable[..., socket.socket],
        console: Console,
    ) -> None:
        self.count = count
        self.host = host
        self.worker = worker
        self.bind = bind  # (host, port, reuse_port=True) -> a bound socket, or Failed
        self.console = console
        # Held (bound, never listening: it receives no connection) until the end, so the
        # port stays ours between worker restarts; port 0 becomes a real port here.
        self.reservation = bind(host, port, reuse_port=True)
        self.port: int = self.reservation.getsockname()[1]
        self.children: dict[int, float] = {}  # pid -> time started
        self.stopping = False

    def _start_one(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the worker
            status = 1
            try:
                # Until uvicorn takes them over (and after: it re-raises the one it stopped
                # on), SIGINT / SIGTERM end the worker through its `finally` blocks, so its
                # OTel SDK still flushes.
                signal.signal(signal.SIGINT, _exit_now)
                signal.signal(signal.SIGTERM, _exit_now)
                self.reservation.close()
                # The worker's own errors are one line and an exit status, as `serve`'s.
                status = dispatch(self._work, argparse.Namespace(), self.console)
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
            finally:
                logging.shutdown()  # os._exit runs no atexit: write the buffered log lines
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        self.children[pid] = time.monotonic()

    def _work(self, _args: argparse.Namespace, _console: Console) -> int | None:
        return self.worker(self.bind(self.host, self.port, reuse_port=True))

    def _stop(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping = True
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def run(self) -> int:
        previous = {
            signum: signal.signal(signum, self._stop) for signum in (signal.SIGINT, signal.SIGTERM)
        }
        status = 0
        try:
            for _ in range(self.count):
                self._start_one()
            while self.children:
                try:
                    pid, wait_status = os.wait()
                except ChildProcessError:
                    break
                started = self.children.pop(pid, None)
                if started is None:
                    continue
                code = os.waitstatus_to_exitcode(wait_status)
                if self.stopping:
                    continue
                if time.monotonic() - started < START_UP_SECONDS:
                    # A start-up failure: the worker said why; the others would fail too.
                    status = code if code > 0 else 1
                    self._stop(signal.SIGTERM, None)
                    continue
                print(
                    f"fallback-mw: worker {pid} exited ({code}); starting another",
                    file=sys.stderr,
                    flush=True,
                )
                self._start_one()
        finally:
            self._reap()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.reservation.close()
        return status

    def _reap(self) -> None:
        """Every worker gone before the supervisor returns (SIGKILL after the grace)."""
        deadline = time.monotonic() + _STOP_GRACE_SECONDS
        while self.children and time.monotonic() < deadline:
            for pid in list(self.children):
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done = pid
                if done:
                    self.children.pop(pid, None)
            time.sleep(0.05)
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.children.pop(pid, None)
