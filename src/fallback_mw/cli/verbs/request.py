"""`fallback-mw request`: its flags and help. Its handler is cli/request.py, imported when
the verb runs: the parser (`--help`, a usage error) imports none of what a verb needs."""

from __future__ import annotations

import argparse
from typing import Any

from fallback_mw.cli.app import Console, leaf


def request(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.request import request as run

    run(args, console)


def register(subparsers: Any) -> None:
    parser = leaf(
        subparsers,
        "request",
        request,
        "send one request through the gateway serve would build and print its whole trace",
        epilog="Exit status: 0 when the client would have received a 2xx in full, 1 "
        "otherwise (no route --route names included, nothing sent), 2 for a bad invocation "
        "or config. Never printed: a credential, a header "
        "value you passed (except the tenant the gateway read from tenant_header, a label "
        "spans and the log line carry too), the query string, a body (unless --show-body).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", metavar="FILE", help="gateway TOML file, as for serve")
    source.add_argument("--store", metavar="URL", help="route store, with default settings")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--route", metavar="ID", help="send to this route's prefix")
    target.add_argument("--path", metavar="/PATH", help="request target (may carry ?query)")
    parser.add_argument("--method", help="HTTP method (default GET; POST with --body)")
    parser.add_argument(
        "--header", action="append", metavar="'NAME: VALUE'", help="request header (repeatable)"
    )
    parser.add_argument(
        "--body",
        metavar="FILE",
        help="request body from FILE, or - for stdin (JSON is sent as application/json "
        "unless a --header names a type)",
    )
    parser.add_argument("--show-body", action="store_true", help="print the response body")
    parser.add_argument("--json", action="store_true", help="print the trace as one JSON object")
