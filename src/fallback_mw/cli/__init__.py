"""The `fallback-mw` command tree (also `python -m fallback_mw`).

Each verb lives in its own module exposing `register(subparsers)`; VERBS lists them, in
help order. To add a verb, write `cli/<verb>.py` with `register` and add it here. The
exit-status and output convention is in `cli/app.py`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

from fallback_mw.cli import (
    budgets,
    capacity,
    check,
    demo,
    evaluate,
    faults,
    gameday,
    request,
    routes,
    serve,
    usage,
)
from fallback_mw.cli.app import (
    EXIT_REFUSED,
    PROG,
    Console,
    Parser,
    Refused,
    argv_is_text,
    default_console,
    dispatch,
)

VERBS = (
    serve, demo, check, request, routes, faults, budgets, usage, capacity, evaluate, gameday,
)  # fmt: skip


def build_parser() -> Parser:
    from fallback_mw import __version__

    parser = Parser(prog=PROG, description="An ASGI API / LLM gateway with ordered failover.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for verb in VERBS:
        verb.register(subparsers)
    return parser


def main(
    argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    """Run one command; returns its exit status (0 done, 1 failed, 2 usage error/refused)."""
    import sys

    console = default_console()
    console = Console(out=stdout or console.out, err=stderr or console.err)
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        argv_is_text(args_list)
        parser = build_parser()
        args, unknown = parser.parse_known_args(args_list)
        if unknown:  # named with the verb they were given to, as its other usage errors
            verb_parser = getattr(args, "verb_parser", parser)
            verb_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except Refused as exc:
        console.err.write(exc.usage)
        console.error(str(exc))
        return EXIT_REFUSED
    except SystemExit as exc:  # --help, --version: argparse printed and asked to exit
        return exc.code if isinstance(exc.code, int) else 0
    return dispatch(args.handler, args, console)
