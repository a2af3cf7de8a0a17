"""`fallback-mw serve --config FILE`: the gateway on uvicorn, in front of a bare 404 app.
Every refusal happens before a socket is opened."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import gc
import importlib.util
import logging
import signal
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fallback_mw.cli.app import Console, Failed, Refused
from fallback_mw.cli.check import resolve_routes
from fallback_mw.cli.compiled_core import version_line
from fallback_mw.cli.config_warnings import config_warnings
from fallback_mw.cli.open_files import raise_open_file_limit
from fallback_mw.cli.own_address import upstream_at_own_address
from fallback_mw.cli.serve_logging import CutRequestLine, configure_logging, uvicorn_colours
from fallback_mw.cli.serve_options import (
    host_port,
    listen_family,
)
from fallback_mw.config import GatewayConfig, load_config
from fallback_mw.extras import require
from fallback_mw.request.types import Receive, Scope, Send
from fallback_mw.store.routes import MergedRoutes
from fallback_mw.telemetry.redact import http_method

# serve turns uvicorn's access log off (it prints query strings): without this line a
# request no route takes (an SDK whose base_url lacks the route's /v1) left no trace.
_request_log = logging.getLogger("fallback_mw.request")
NO_ROUTE_LINE = (
    "no route: a %s request matched no route (by prefix, methods and tenant) and was answered "
    "404 (its path is not logged; `fallback-mw check --config FILE` prints each route's "
    "prefix, methods and tenant, and an SDK's base_url must include its route's prefix, such "
    "as http://HOST:PORT/v1)"
)


async def not_found_app(scope: Scope, receive: Receive, send: Send) -> None:
    """The bare host app behind `serve`: a plain 404 for anything no route matched, and one
    INFO line on `fallback_mw.request` saying so (the method only: the path is the caller's)."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] == "websocket":
        # Refuse the handshake explicitly (the server answers 403). Returning without a
        # message would make the server log an error and answer 500.
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008})
        return
    if scope["type"] != "http":
        return
    if _request_log.isEnabledFor(logging.INFO):
        _request_log.info(NO_ROUTE_LINE, http_method(scope.get("method", "?"), ())[0])
    body = b"Not Found\n"
    await send(
        {
            "type": "http.response.start",
            "status": 404,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def server_options() -> dict[str, str]:
    """uvloop and httptools when installed (third-party speedups), uvicorn's choice otherwise."""
    installed = importlib.util.find_spec
    return {
        "loop": "uvloop" if installed("uvloop") is not None else "auto",
        "http": "httptools" if installed("httptools") is not None else "auto",
    }


# A routed request leaves no reference cycles behind, so at serve's request rate the cyclic
# GC finds nothing to free; at Python's default threshold (700 net container allocations)
# it still ran every few requests, and every few hundred traversed the whole heap. Serve
# collects once, freezes what startup loaded (never traversed again) and collects young
# objects when this many more are alive than at the last collection.
SERVE_GC_THRESHOLD = 50_000
# After that wait, how long a worker may take to settle, close and exit before SIGKILL.
STOP_MARGIN_SECONDS = 5.0


async def finish_forced_stop(server: Any) -> None:
    """After uvicorn's shutdown on a second Ctrl-C (its force quit). uvicorn then stops
    waiting for the requests in flight and skips the lifespan shutdown: the event loop's
    teardown cancelled the requests and the lifespan task, uvicorn logged "Exception in
    'lifespan' protocol" with a traceback, and the gateway was never closed (its upstream
    sessions, its ledger's records kept through an outage). Cut the requests now, as the
    graceful timeout does (each settles its hold, shielded), then run the lifespan
    shutdown; all of it bounded by STOP_MARGIN_SECONDS."""
    tasks = [task for task in server.server_state.tasks if not task.done()]
    for task in tasks:
        task.cancel(msg="forced stop")
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(STOP_MARGIN_SECONDS):
            if tasks:
                await asyncio.wait(tasks)
            await server.lifespan.shutdown()


def tune_gc() -> None:
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(SERVE_GC_THRESHOLD, older, oldest)


def serve(args: argparse.Namespace, console: Console) -> int | None:
    require("serve", "the serve command")
    from fallback_mw.cli.server_limits import uvicorn_limits
    from fallback_mw.cli.worker_checks import check_shared, more_than_cpus
    from fallback_mw.cli.workers import Supervisor, exit_now

    config = load_config(args.config)
    check_shared(config, args.workers)  # N > 1 on per-process state: refused, one line
    # The store's routes, loaded and refused once here, as `check` does (the connection
    # closed before any worker forks): an unreachable store or a route the rules refuse is
    # one line, not one per worker. The gateway (each worker's) loads them again as it
    # starts. What `check` warns about is said once, when the address is bound, before
    # "serving on" (a start that fails stays one error line); its Redis line aside: the
    # gateway says an unusable Redis itself, at its start.
    merged, from_store, ledger_version = resolve_routes(config)
    # An upstream at serve's own address routes each request back to itself (508 at its
    # second pass): the file's refused, the store's warned about (own_address.py).
    looped = upstream_at_own_address(_routes(merged, from_store, False), args.host, args.port)
    if looped is not None:
        raise Refused(looped)
    warnings = config_warnings(args.config, config, merged, from_store, ledger_version).lines()
    stored = _routes(merged, from_store, True)
    looped = upstream_at_own_address(stored, args.host, args.port, stored=True)
    if looped is not None:
        warnings.append(looped)
    # The Prometheus exporter: one port per worker, none of them the gateway's, checked up
    # front (with --port 0, once the supervisor has the port; one process cannot clash).
    from fallback_mw.cli.otel_setup import TelemetrySetupError, check_workers

    try:
        check_workers(args.workers, gateway_port=args.port, gateway_host=args.host)
    except TelemetrySetupError as exc:
        raise Refused(str(exc)) from None
    options: dict[str, Any] = server_options()
    # The server itself refuses an oversized or slow request head before buffering it,
    # drops chunked trailer fields, and sends no `server` header (server_limits).
    options.update(uvicorn_limits(config.gateway, options["http"]))
    # A stop (SIGTERM, SIGINT) waits this long for requests in flight (an endless stream
    # would hold it forever), then cancels them: their holds settle as cut short.
    options["timeout_graceful_shutdown"] = args.timeout_graceful_shutdown
    # A load balancer in front reuses its idle connections for as long as its own idle
    # timeout: a request it sends on one the gateway has just closed is its 502 to a caller.
    options["timeout_keep_alive"] = args.timeout_keep_alive
    options["use_colors"] = uvicorn_colours()
    if args.workers > 1:
        if (crowded := more_than_cpus(args.workers)) is not None:
            warnings.append(crowded)
        # Each worker sets up its own OTel SDK and gateway after the fork (cli/workers.py).
        supervisor = Supervisor(
            args.workers,
            args.host,
            args.port,
            lambda sock, ready, slot: run_server(
                config, options, sock, args, console, workers=True, ready=ready, slot=slot
            ),
            bind=listen_socket,
            console=console,
            # The workers' own wait, then time to settle, close and exit, before SIGKILL.
            stop_grace=args.timeout_graceful_shutdown + STOP_MARGIN_SECONDS,
            hang_timeout=args.worker_timeout,
        )
        try:
            check_workers(args.workers, gateway_port=supervisor.port, gateway_host=args.host)
        except TelemetrySetupError as exc:
            supervisor.reservation.close()
            raise Refused(str(exc)) from None
        for warning in warnings:
            console.warning(warning)
        announce(
            console,
            f"serving on {address(supervisor.reservation)} with {args.workers} worker "
            "processes (Ctrl-C to stop)",
        )
        return supervisor.run()
    # SIGTERM, like Ctrl-C, is a clean stop (exit status 0) once uvicorn has shut down: it
    # re-raises the signal it stopped on, and the default action would end the process
    # with -15 (a worker of `serve --workers` does the same, cli/workers.py).
    signal.signal(signal.SIGTERM, exit_now)
    run_server(config, options, None, args, console, workers=False, warnings=warnings)
    return None


def _routes(merged: MergedRoutes, from_store: set[str], stored: bool) -> MergedRoutes:
    """The file's routes (`stored` False) or the store's, with every upstream."""
    routes = tuple(route for route in merged.routes if (route.id in from_store) is stored)
    return MergedRoutes(routes, merged.upstreams)


def announce(console: Console, line: str) -> None:
    """One of serve's own lines on stdout ("serving on ..."): a stdout that is closed (`>&-`,
    a supervisor that starts it so) or that nobody reads any more must not keep the gateway
    from serving. The line is dropped; the log (stderr) is written as always."""
    with contextlib.suppress(Failed, OSError, ValueError):
        console.print(line)


def address(sock: socket.socket) -> str:
    bound = sock.getsockname()
    return f"http://{host_port(bound[0], bound[1])}"


def run_server(
    config: GatewayConfig,
    options: dict[str, Any],
    sock: socket.socket | None,
    args: argparse.Namespace,
    console: Console,
    *,
    workers: bool,
    ready: Callable[[], None] | None = None,
    slot: int = 0,
    warnings: Sequence[str] = (),
) -> None:
    """One gateway on uvicorn: `serve` itself, or one worker of `serve --workers N` (then
    `sock` is the worker's own listening socket, log lines carry the process id,
    `ready()` tells the supervisor once the worker serves, and a Prometheus `/metrics`
    endpoint listens on its configured port + `slot`: one scrape target per worker)."""
    import uvicorn

    from fallback_mw.cli.otel_setup import TelemetrySetupError, configure_opentelemetry
    from fallback_mw.gateway import Gateway
    from fallback_mw.telemetry.line_writer import queue_server_lines

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and ready is not None:
                ready()  # listening, its lifespan started: the supervisor's count of it

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await super().shutdown(sockets=sockets)
            if self.force_exit:  # a second Ctrl-C: cut, settle and close, not abandon
                await finish_forced_stop(self)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # SIGHUP (the terminal or ssh session that started `serve` went away) is a
            # stop like SIGTERM: uvicorn handles only SIGINT and SIGTERM, and left to its
            # default SIGHUP killed the process mid-request (holds left held, the request
            # lines and spans of the last moments lost). A worker of `serve --workers`
            # ignores it: its supervisor stops it; so does `serve` under `nohup`.
            if workers or signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
                with super().capture_signals():
                    yield
                return
            hangup = signal.signal(
                signal.SIGHUP, lambda _signum, frame: self.handle_exit(signal.SIGTERM, frame)
            )
            try:
                with super().capture_signals():
                    yield
            finally:
                signal.signal(signal.SIGHUP, hangup)

    try:
        telemetry = configure_opentelemetry(
            metrics_port_offset=slot, worker=slot if workers else None
        )
    except TelemetrySetupError as exc:
        raise Refused(str(exc)) from None
    if telemetry.prometheus_address is not None:
        metrics_host, metrics_port = telemetry.prometheus_address
        # Best effort, as every line of serve's own (a worker's replacement whose reader is
        # gone, a stdout closed): the gateway serves all the same.
        announce(
            console,
            f"metrics on http://{host_port(metrics_host, metrics_port)}/metrics (Prometheus)",
        )
    try:
        gateway = Gateway(not_found_app, config=config)
        if gateway.config_error is not None:  # e.g. a store route the file's rules refuse
            raise Refused(gateway.config_error)
        if sock is None:
            sock = listen_socket(args.host, args.port)
            for warning in warnings:  # `check`'s, once the address is bound
                console.warning(warning)
            announce(console, f"serving on {address(sock)} (Ctrl-C to stop)")
        configure_logging(with_pid=workers)
        # Which build serves (pure Python or the compiled core, and whether it is whole).
        logging.getLogger("fallback_mw").info("starting %s", version_line())
        if (raised := raise_open_file_limit()) is not None:  # systemd's soft 1024 (open_files.py)
            logging.getLogger("fallback_mw").info(
                "open-file limit raised from %d to %d (the hard limit)", *raised
            )
        tune_gc()
        server = Server(
            uvicorn.Config(
                gateway,
                host=args.host,
                port=args.port,
                lifespan="on",
                # uvicorn's access log prints query strings; our request log line replaces it.
                access_log=False,
                # The gateway reads neither the client address nor the scheme: uvicorn's
                # rewrite of them from X-Forwarded-* is work nothing uses.
                proxy_headers=False,
                **options,
            )
        )
        # After uvicorn's dictConfig.
        logging.getLogger("uvicorn.error").addFilter(CutRequestLine(lambda: server.force_exit))
        queue_server_lines()  # a stderr nobody reads must not hold up the loop, nor the exit
        with sock, contextlib.suppress(KeyboardInterrupt):
            # uvicorn re-raises the SIGINT it stopped on once it has shut down (uvicorn.run
            # swallows it the same way): Ctrl-C is a clean stop, exit status 0.
            server.run(sockets=[sock])
        if not server.started:
            raise Failed("the gateway did not start (the reason is logged above)")
    finally:
        # A second Ctrl-C while the exporters flush stops at once, and is a clean stop
        # (exit status 0) as uvicorn's own second Ctrl-C is: it was 130, "error: interrupted".
        with contextlib.suppress(KeyboardInterrupt):
            telemetry.shutdown()


def listen_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """The listening socket, bound before uvicorn starts: a busy or forbidden address is one
    `fallback-mw: error:` line and exit 1, not uvicorn's log lines and exit 3. With
    `reuse_port` (SO_REUSEPORT: `serve --workers`), every worker binds its own socket to
    the same address and the kernel spreads new connections across them."""
    sock = socket.socket(listen_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise Failed(f"cannot listen on {host_port(host, port)}: {reason}") from None
    sock.set_inheritable(True)
    return sock
