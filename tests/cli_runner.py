"""Run a `fallback-mw` verb in-process and return its exit status (SystemExit included)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def run_cli(argv: Sequence[str]) -> int:
    from fallback_mw.evaluation.cli import register as register_eval

    parser = argparse.ArgumentParser(prog="fallback-mw")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register_eval(subparsers)
    try:
        args = parser.parse_args(list(argv))
        status: int = args.handler(args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return status
