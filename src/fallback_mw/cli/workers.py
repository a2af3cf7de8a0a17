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
each process's memory (worker_checks.py): two workers would each keep their own
breakers and budgets, and the gateway would silently do N times what it was configured
to do.

SIGINT / SIGTERM / SIGHUP to the supervisor stop every worker (each finishes its requests
in flight, as uvicorn does on SIGTERM); a supervisor that dies otherwise (SIGKILL) takes
its workers with it (Linux: each gets SIGTERM). Each worker tells the supervisor (one line
on a pipe) once it serves. Until all N have served at once, a worker that fails to start (a start-up
error: it printed its own line) stops them all, and the supervisor exits with its status:
the configuration, the store or the host is wrong. From then on the instance has served,
and a replacement that fails to start (the store unreachable, a store route naming an
environment variable this host lacks) is a runtime outage: the other workers keep
serving, and the supervisor starts another after 1 s, 2 s, 4 s, ... up to 30 s apart, one
line each time. A worker that served and dies START_UP_SECONDS or more after its start is
replaced at once; one that dies younger waits its turn in the same backoff. A worker
whose event loop has not run for `hang_timeout` seconds is killed, then replaced so
(liveness.py)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType

from fallback_mw.cli.app import Console, dispatch
from fallback_mw.cli.liveness import Heartbeats, die_with
from fallback_mw.telemetry.line_writer import flush_request_lines

# A worker that served and exits this long or more after its start is replaced at once;
# one that exits sooner, or never served, is retried with the backoff (once established).
START_UP_SECONDS = 5.0
_STOP_GRACE_SECONDS = 30.0
# Once the instance has served, a replacement that fails to start is retried after 1 s,
# then 2, 4, ... up to 30 s (back to 1 s once a worker serves again).
_RETRY_FIRST_SECONDS = 1.0
_RETRY_MAX_SECONDS = 30.0
_POLL_SECONDS = 0.1  # how soon the supervisor notices a worker's death
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def _ending(code: int) -> str:
    """How a worker ended, from its exit code (negative: the signal that killed it)."""
    if code >= 0:
        return f"exited ({code})"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def say(line: str) -> None:
    """One line of the supervisor on stderr, best effort: once its reader is gone (`serve
    ... | logger` whose logger died, a terminal that closed), the supervisor supervises on
    in silence, as the workers log on in silence (logging drops what it cannot write). A
    failed line had killed the supervisor: the workers were left without a SIGTERM for
    the stop grace, then SIGKILLed."""
    try:
        print(line, file=sys.stderr, flush=True)
    except BrokenPipeError:  # for good: what is buffered, and what follows, goes nowhere
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stderr.fileno())
            os.close(devnull)
            sys.stderr.flush()
    except (OSError, ValueError):
        pass  # e.g. a full disk: this line is lost, the next may be written


def exit_now(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


class Supervisor:
    """Forks `count` workers, each running `worker(sock, ready, slot)` (returns an exit
    status) on its own SO_REUSEPORT socket and calling `ready()` once it serves; replaces a
    worker that dies, and retries one that fails to start once the instance has served.
    `slot` (0 .. count-1) is the worker's place: a replacement takes the slot of the worker
    it replaces, so what a slot names (its `/metrics` port) stays the same across restarts."""

    def __init__(
        self,
        count: int,
        host: str,
        port: int,
        worker: Callable[[socket.socket, Callable[[], None], int], int | None],
        *,
        bind: Callable[..., socket.socket],
        console: Console,
        stop_grace: float = _STOP_GRACE_SECONDS,
        hang_timeout: float = 0.0,
    ) -> None:
        self.count = count
        # A worker whose event loop has not run for this long is killed (0: never).
        self.hang_timeout = hang_timeout
        self.heartbeats = Heartbeats(count)
        self.hung: set[int] = set()
        self.stop_grace = stop_grace  # from a stop signal to SIGKILL, per worker
        self.host = host
        self.worker = worker
        self.bind = bind  # (host, port, *, reuse_port) -> a bound socket, or Failed
        self.console = console
        # First a socket without SO_REUSEPORT, refused while anything holds the address:
        # Linux lets a SO_REUSEPORT socket join any SO_REUSEPORT listener of the same user,
        # so a second `serve --workers` on this address started and silently took a share
        # of the first one's connections. Port 0 becomes a real port here.
        with bind(host, port) as probe:
            port = probe.getsockname()[1]
        # Held (bound, never listening: it receives no connection) until the end, so the
        # port stays ours between worker restarts.
        self.reservation = bind(host, port, reuse_port=True)
        self.port: int = self.reservation.getsockname()[1]
        self.children: dict[int, float] = {}  # pid -> time started
        self.slots: dict[int, int] = {}  # pid -> its slot (0 .. count-1)
        self._slot = 0  # in a worker: its own slot
        self.ready: set[int] = set()  # the children that said they serve
        # True once all `count` workers served at the same time: from then on a worker
        # that fails to start is a runtime outage (retried), no longer a start-up error.
        self.established = False
        # (when due, slot) of each pending replacement
        self.restarts: list[tuple[float, int]] = []
        self.failures = 0  # replacements failed in a row (the backoff's exponent)
        self.stopping = False
        # Each worker writes "PID\n" here once it serves (one write, under PIPE_BUF: atomic).
        self._ready_read, self._ready_write = os.pipe()
        os.set_blocking(self._ready_read, False)
        self._ready_buffer = b""

    def _start_one(self, slot: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        supervisor = os.getpid()
        self.heartbeats.clear(slot)  # unwatched until the new worker's loop beats
        # The stop signals are held across the fork: one that reached the new worker before
        # its own handlers ran the supervisor's (inherited) there, which noted a "stop",
        # told the supervisor's copy of the other workers to stop, and served on.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            pid = os.fork()
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            raise
        if pid == 0:  # the worker
            status = 1
            try:
                # Until uvicorn takes them over (and after: it re-raises the one it stopped
                # on), SIGINT / SIGTERM end the worker through its `finally` blocks, so its
                # OTel SDK still flushes.
                signal.signal(signal.SIGINT, exit_now)
                signal.signal(signal.SIGTERM, exit_now)
                # A terminal's hangup reaches the whole group: the supervisor stops the
                # workers (SIGTERM, graceful); the inherited handler is the supervisor's.
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
                signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a held stop ends it now
                die_with(supervisor)
                self.reservation.close()
                os.close(self._ready_read)
                self._slot = slot
                # The worker's own errors are one line and an exit status, as `serve`'s.
                status = dispatch(self._work, argparse.Namespace(), self.console)
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
            finally:
                # The worker is ending: a further stop (on a terminal Ctrl-C reaches every
                # worker, and the supervisor passes a second one on) must not raise out of
                # here, past os._exit, into the supervisor's loop.
                for signum in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(signum, signal.SIG_IGN)
                # os._exit runs no atexit: write the buffered log lines (the request log's
                # own handler too: uvicorn's dictConfig took it out of logging's list).
                # Whatever fails here (a reader gone: BrokenPipeError), the worker ends
                # here: an exception let past os._exit ran the supervisor's loop in it.
                with contextlib.suppress(Exception):
                    flush_request_lines()
                    logging.shutdown()
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        stream.flush()
                os._exit(status)
        self.children[pid] = time.monotonic()
        self.slots[pid] = slot
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a stop held meanwhile: handled
        if self.stopping:  # a SIGTERM that arrived during the fork
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def _work(self, _args: argparse.Namespace, _console: Console) -> int | None:
        sock = self.bind(self.host, self.port, reuse_port=True)
        return self.worker(sock, self._serving, self._slot)

    def _serving(self) -> None:
        """In a worker: tell the supervisor this worker serves."""
        with contextlib.suppress(OSError):  # the supervisor is gone: nobody to tell
            os.write(self._ready_write, f"{os.getpid()}\n".encode())
        self.heartbeats.start(self._slot)  # from its event loop, until that loop ends

    def _stop(self, signum: int, _frame: FrameType | None) -> None:
        # A stop reaches each worker as SIGTERM: on a terminal, Ctrl-C reached the workers
        # too, and a SIGINT from here would be their second (a forced stop). A SIGINT after
        # a stop is the second Ctrl-C (uvicorn's force quit, as one `serve` takes it), also
        # where it reaches the supervisor alone (`docker run`'s signal proxy, `kill -INT`):
        # passed on as SIGINT, so each worker cuts its requests now.
        forced = signum == signal.SIGINT and self.stopping
        self.stopping = True
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT if forced else signal.SIGTERM)

    def run(self) -> int:
        # SIGHUP (the terminal that started it closed) stops the workers too: left to its
        # default it killed the supervisor alone, and its workers served on.
        # Under `nohup` (SIGHUP ignored) it stays ignored: the operator asked for that.
        stops = [signal.SIGINT, signal.SIGTERM]
        if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
            stops.append(signal.SIGHUP)
        previous = {signum: signal.signal(signum, self._stop) for signum in stops}
        status = 0
        try:
            for slot in range(self.count):
                self._start_one(slot)
            # Once stopping, the workers are waited for in `_reap`: for the stop grace, then
            # SIGKILL (a worker stuck in its shutdown held the supervisor, and the port,
            # forever).
            while (self.children or self.restarts) and not self.stopping:
                self._wait(self._next_due())
                self._read_ready()  # before the deaths: a worker may serve, then die
                while self.children:
                    try:
                        pid, wait_status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        self.children.clear()
                        break
                    if pid == 0:
                        break
                    failed = self._exited(pid, os.waitstatus_to_exitcode(wait_status))
                    if failed is not None:
                        status = failed
                        self._stop(signal.SIGTERM, None)
                self._kill_hung()
                now = time.monotonic()
                while self.restarts and self.restarts[0][0] <= now and not self.stopping:
                    _due, slot = self.restarts.pop(0)
                    self._start_one(slot)
        finally:
            # Left by an exception (a bug): the workers still get their graceful stop.
            if not self.stopping:
                self._stop(signal.SIGTERM, None)
            self._reap()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.reservation.close()
            os.close(self._ready_read)
            os.close(self._ready_write)
            self.heartbeats.close()
        return status

    def _next_due(self) -> float:
        """Seconds until the next pending replacement, at most _POLL_SECONDS."""
        if not self.restarts:
            return _POLL_SECONDS
        return max(0.0, min(_POLL_SECONDS, self.restarts[0][0] - time.monotonic()))

    def _wait(self, timeout: float) -> None:
        """Until a worker says it serves, or `timeout` (deaths are polled after it)."""
        with contextlib.suppress(InterruptedError):
            select.select([self._ready_read], [], [], timeout)

    def _read_ready(self) -> None:
        try:
            self._ready_buffer += os.read(self._ready_read, 4096)
        except BlockingIOError:
            return
        *lines, self._ready_buffer = self._ready_buffer.split(b"\n")
        for line in lines:
            pid = int(line)
            if pid in self.children:
                self.ready.add(pid)
                self.failures = 0
        if len(self.ready) >= self.count and not self.established:
            self.established = True
            say(
                f"fallback-mw: all {self.count} workers serving; "
                "one that fails to start from now on is retried"
            )

    def _kill_hung(self) -> None:
        """SIGKILL each worker whose event loop has been silent for hang_timeout: it is
        then replaced as any worker that dies."""
        if self.hang_timeout <= 0:
            return
        for pid in self.heartbeats.hung(self.slots, self.hang_timeout):
            if pid not in self.hung:
                self.hung.add(pid)
                say(
                    f"fallback-mw: worker {pid} has not run its event loop for "
                    f"{self.hang_timeout:g} s (hung); killing it"
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _exited(self, pid: int, code: int) -> int | None:
        """One worker gone: the supervisor's exit status when it stops everything (a
        start-up failure before the instance ever served), else None (replaced)."""
        started = self.children.pop(pid, None)
        slot = self.slots.pop(pid, 0)
        served = pid in self.ready
        self.ready.discard(pid)
        self.hung.discard(pid)
        if started is None or self.stopping:
            return None
        lived = time.monotonic() - started
        if not self.established and not served:
            # A start-up failure: the worker said why; the others would fail too. One
            # killed by a signal (the OOM killer, SIGKILL) said nothing: serve exited 1
            # without a word after "serving on ...". The supervisor says it then.
            if code <= 0:
                say(
                    f"fallback-mw: error: worker {pid} {_ending(code)} before it served; "
                    "stopping the others"
                )
            return code if code > 0 else 1
        if served and lived >= START_UP_SECONDS:
            say(f"fallback-mw: worker {pid} {_ending(code)}; starting another")
            self._start_one(slot)
            return None
        # It failed to start (store unreachable, an env variable this host lacks, ...) or
        # died young: the others keep serving; retried later and later, up to 30 s apart.
        delay = min(_RETRY_MAX_SECONDS, _RETRY_FIRST_SECONDS * 2.0**self.failures)
        self.failures = min(self.failures + 1, 16)  # 2.0**1024 would overflow in a long outage
        what = _ending(code) if served or code < 0 else f"failed to start ({code})"
        say(f"fallback-mw: worker {pid} {what}; starting another in {delay:g} s")
        self.restarts.append((time.monotonic() + delay, slot))
        self.restarts.sort()
        return None

    def _reap(self) -> None:
        """Every worker gone before the supervisor returns (SIGKILL after the grace)."""
        deadline = time.monotonic() + self.stop_grace
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
