"""The `fallback-mw` command tree (also `python -m fallback_mw`).

Each verb's parser lives in `cli/verbs/<verb>.py`, exposing `register(subparsers)`; VERBS
lists them, in help order. Its handler there imports the verb's own module (`cli/<verb>.py`)
when the verb runs, so `fallback-mw --help` or a usage error imports no verb's work, and a
verb only its own. To add a verb, write both and add the parser module here. The
exit-status and output convention is in `cli/app.py`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, TextIO

from fallback_mw.cli.app import (
    EXIT_FAILED,
    EXIT_REFUSED,
    EXIT_SIGPIPE,
    PROG,
    Console,
    Parser,
    Refused,
    argv_is_text,
    default_console,
    dispatch,
    silence_stdout,
)
from fallback_mw.cli.verbs import (
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

VERBS = (
    serve, demo, check, request, routes, faults, budgets, usage, capacity, evaluate, gameday,
)  # fmt: skip


class _Version(argparse.Action):
    """`--version`: the release and the build (`pure Python`, or the compiled core and
    whether it is whole: compiled_core.py), worked out only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.update(nargs=0, default=argparse.SUPPRESS)
        super().__init__(option_strings, argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        import sys

        from fallback_mw.cli.compiled_core import version_line

        parser._print_message(version_line() + "\n", sys.stdout)
        parser.exit()


def build_parser() -> Parser:
    parser = Parser(prog=PROG, description="An ASGI API / LLM gateway with ordered failover.")
    parser.add_argument(
        "--version", action=_Version, help="show the release and the build (pure or compiled)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for verb in VERBS:
        verb.register(subparsers)
    return parser


def option_before_its_verb(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """`fallback-mw routes --store URL list`: argparse took the option's value for the verb
    and said "invalid choice: 'URL'". An option a verb below takes, given before that verb
    is named, is refused saying where it goes."""
    words = [PROG]
    for arg in argv:
        verbs = _verbs(parser)
        if verbs is None or arg in verbs:
            if verbs is None:
                return
            parser = verbs[arg]
            words.append(arg)
            continue
        option = arg.split("=", 1)[0]
        own = {option for action in parser._actions for option in action.option_strings}
        if option.startswith("--") and option not in own and option in _options_below(parser):
            place = "VERB" if len(words) > 1 else "COMMAND"
            named = " ".join(words)
            raise Refused(
                f"{option} goes after the {place.lower()} ({named} {place} {option} ...; "
                f"`{named} --help` lists the {place.lower()}s)"
            )
        return


def _verbs(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return None


def _options_below(parser: argparse.ArgumentParser) -> set[str]:
    verbs = _verbs(parser)
    if verbs is None:
        return {option for action in parser._actions for option in action.option_strings}
    return {option for verb in verbs.values() for option in _options_below(verb)}


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
        option_before_its_verb(parser, args_list)
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
    except BrokenPipeError:  # `fallback-mw --help | head -1`: nothing to report
        silence_stdout(console)
        return EXIT_SIGPIPE
    except OSError as exc:  # --help, --version on a full disk: said, not dropped
        silence_stdout(console)  # the interpreter's flush at exit would fail on it again
        console.error(f"cannot write the output: {exc.strerror or exc}")
        return EXIT_FAILED
    return dispatch(args.handler, args, console)
