"""`fallback-mw demo`: its flags and help. Its handler is cli/demo.py, imported when the
verb runs: the parser (`--help`, a usage error) imports none of what a verb needs."""

from __future__ import annotations

import argparse
from typing import Any

from fallback_mw.cli.app import Console, leaf
from fallback_mw.cli.serve_options import port_number


def demo(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.demo import demo as run

    run(args, console)


def register(subparsers: Any) -> None:
    parser = leaf(
        subparsers,
        "demo",
        demo,
        "show failover, the POST rule and a budget on loopback ports, then exit",
    )
    parser.add_argument(
        "--port",
        type=port_number,
        default=0,
        help="the gateway's port; the primary gets P+1, the backup P+2 (default: free ports)",
    )
