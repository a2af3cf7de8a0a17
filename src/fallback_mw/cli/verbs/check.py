"""`fallback-mw check`: its flags and help. Its handler is cli/check.py, imported when the
verb runs: the parser (`--help`, a usage error) imports none of what a verb needs."""

from __future__ import annotations

import argparse
from typing import Any

from fallback_mw.cli.app import Console, leaf


def check(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.check import check as run

    run(args, console)


def register(subparsers: Any) -> None:
    parser = leaf(
        subparsers,
        "check",
        check,
        "validate a configuration as serve would and print its routes and plans",
    )
    parser.add_argument("--config", required=True, metavar="FILE", help="gateway TOML file")
