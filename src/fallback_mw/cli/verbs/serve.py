"""`fallback-mw serve`: its flags and help. Its handler is cli/serve.py, imported when the
verb runs: the parser (`--help`, a usage error) imports none of what a verb needs."""

from __future__ import annotations

import argparse
from typing import Any

from fallback_mw.cli.app import Console, leaf
from fallback_mw.cli.serve_options import (
    DEFAULT_GRACEFUL_SECONDS,
    DEFAULT_KEEP_ALIVE_SECONDS,
    add_worker_options,
    bind_host,
    graceful_seconds,
    keep_alive_seconds,
    port_number,
)


def serve(args: argparse.Namespace, console: Console) -> int | None:
    from fallback_mw.cli.serve import serve as run

    return run(args, console)


def register(subparsers: Any) -> None:
    parser = leaf(subparsers, "serve", serve, "run the gateway on uvicorn")
    parser.add_argument("--config", required=True, metavar="FILE", help="gateway TOML file")
    parser.add_argument(
        "--host", type=bind_host, default="127.0.0.1", help="bind address (default 127.0.0.1)"
    )
    parser.add_argument("--port", type=port_number, default=8000, help="bind port (default 8000)")
    add_worker_options(parser)
    parser.add_argument(
        "--timeout-graceful-shutdown",
        type=graceful_seconds,
        default=DEFAULT_GRACEFUL_SECONDS,
        metavar="SECONDS",
        help="on SIGTERM / Ctrl-C, how long requests in flight may finish before they are "
        f"cut (their holds settled as cut short; default {DEFAULT_GRACEFUL_SECONDS:g})",
    )
    parser.add_argument(
        "--timeout-keep-alive",
        type=keep_alive_seconds,
        default=DEFAULT_KEEP_ALIVE_SECONDS,
        metavar="SECONDS",
        help="how long an idle connection is kept for its next request; behind a load "
        "balancer or proxy that keeps connections, above its idle timeout (AWS ALB: 60) "
        f"(default {DEFAULT_KEEP_ALIVE_SECONDS:g})",
    )
