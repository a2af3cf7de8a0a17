"""The one way every `fallback-mw` verb prints, fails and exits.

Exit status: 0 done; 2 a usage error or a refusal (nothing started, nothing stored);
1 a runtime failure (store unreachable, port in use, a result not found). Every failure is
exactly one line on stderr, `fallback-mw: error: ...`, and never a traceback; a command
line that names no command (`fallback-mw`, `fallback-mw routes`) has the commands it could
have named listed before that line. A warning is
one line, `fallback-mw: warning: ...`, beside a result that stands; a caveat (about where the
command looked for its store) is a warning after the result, or joins the error line
(`...; note: ...`) when there is no result.

A verb's parser module (cli/verbs/) exposes `register(subparsers)`; each leaf parser sets
`handler`, a function `(args, console)` that prints through the console and raises `Refused`
or `Failed` (or returns an exit status itself, printing its one error line in the same
format).
"""

from __future__ import annotations

import argparse
import errno
import io
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TextIO, TypeVar, cast

from fallback_mw.error_chain import error_chain
from fallback_mw.quoting import printable

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2
EXIT_SIGPIPE = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader left
PROG = "fallback-mw"

T = TypeVar("T")


class Refused(Exception):
    """A usage error or a refusal: exit status 2, nothing started or stored. `usage`, when
    given, is printed on stderr before the error line: the commands a command line that
    named none could have named."""

    def __init__(self, message: str, *, usage: str = "") -> None:
        super().__init__(message)
        self.usage = usage


class Failed(Exception):
    """A runtime failure (store unreachable, port in use, not found): exit status 1."""


@dataclass
class Console:
    out: TextIO
    err: TextIO
    caveats: list[str] = field(default_factory=list)

    def print(self, line: str = "") -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def warning(self, message: str) -> None:
        """One line on stderr beside a result that stands (exit status unchanged)."""
        self.err.write(f"{PROG}: warning: {_one_line(str(message))}\n")
        self.err.flush()

    def caveat(self, message: str) -> None:
        """Something about where the command looked for its store that may explain its
        result: said once it ends, as a warning line beside a result that stands, or within
        the one error line of a failure."""
        self.caveats.append(message)

    def flush_caveats(self) -> None:
        for message in self.caveats:
            self.warning(message)
        self.caveats.clear()

    def error(self, message: str) -> None:
        # One line, whatever the message holds (a multi-line error would break the rule).
        text = _one_line(str(message)) or "failed"
        notes = "".join(f"; note: {_one_line(c)}" for c in self.caveats)
        self.caveats.clear()
        self.err.write(f"{PROG}: error: {text}{notes}\n")
        self.err.flush()


def _one_line(message: str) -> str:
    """A message as one terminal line: whitespace runs become one space, and a character
    a terminal would act on from an argument or a stored value the message quotes becomes
    `?` (`printable`)."""
    return printable(" ".join(message.split()))


Handler = Callable[[argparse.Namespace, Console], int | None]


class Parser(argparse.ArgumentParser):
    """argparse, except that a usage error becomes `Refused` (one line, exit 2) instead of
    argparse's usage block. Subparsers inherit this class."""

    def error(self, message: str) -> NoReturn:
        # Console.error adds the `fallback-mw: error:` prefix; name the verb only.
        verb = self.prog.removeprefix(PROG).strip()
        text = f"{verb}: {message}" if verb else message
        if self._names_no_command(message):
            # `fallback-mw` or `fallback-mw routes` alone: the one line would name only
            # COMMAND / VERB, so the commands it could have named come first (as git does).
            raise Refused(f"{text} (one of those listed above)", usage=self.format_help())
        raise Refused(text)

    def _print_message(self, message: str, file: Any = None) -> None:
        # argparse drops a write's error (--version > /dev/full: nothing written, exit
        # status 0): --help and --version fail as any verb's output does (cli.main).
        stream = file if file is not None else sys.stderr
        if message and stream is not None:
            stream.write(message)
            stream.flush()

    def _names_no_command(self, message: str) -> bool:
        required = message.removeprefix("the following arguments are required: ")
        if required == message:
            return False
        commands = self._subparsers._group_actions if self._subparsers else []
        return any(action.metavar in required.split(", ") for action in commands)


def leaf(
    verbs: Any, name: str, handler: Handler, help_text: str, **kwargs: Any
) -> argparse.ArgumentParser:
    """A verb's parser with its handler set."""
    parser: argparse.ArgumentParser = verbs.add_parser(
        name, help=help_text, description=help_text, **kwargs
    )
    parser.set_defaults(handler=handler, verb_parser=parser)
    return parser


def run(work: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a verb's async work on a fresh event loop (the CLI owns no loop of its own)."""
    import asyncio  # here: parsing a command line (`--help`) needs no event loop

    return asyncio.run(work())


async def closing(work: Awaitable[T], close: Callable[[], Awaitable[None]]) -> T:
    try:
        return await work
    finally:
        await close()


def dispatch(handler: Handler, args: argparse.Namespace, console: Console) -> int:
    """Call a handler and turn what it raised into an exit status and one stderr line."""
    from fallback_mw.rules import ConfigError
    from fallback_mw.store.model import StoreError
    from fallback_mw.store_url import StoreURLError

    quiet_library_warnings()
    try:
        status = handler(args, console)
    except (Refused, ConfigError, StoreURLError) as exc:
        console.error(str(exc))
        return EXIT_REFUSED
    except (Failed, StoreError) as exc:
        console.error(str(exc))
        return EXIT_FAILED
    except BrokenPipeError:
        # The reader went away (`fallback-mw demo | head`): nothing to report, and the
        # interpreter's own flush at exit must not fail on that pipe either.
        silence_stdout(console)
        return EXIT_SIGPIPE
    except OSError as exc:
        # e.g. the store's directory is missing, a port is taken: name what failed, no path
        # to a secret is ever part of these.
        console.error(
            _no_descriptors(exc)
            or _directory_gone(exc)
            or f"{type(exc).__name__}: {exc.strerror or exc}"
        )
        return EXIT_FAILED
    except KeyboardInterrupt:
        console.error("interrupted")
        return 130
    except Exception as exc:
        # A bug, not the operator's fault: still one line, and nothing the exception holds
        # (its message could quote a value) beyond its type. Unless the host is what failed
        # (the event loop could not start: no descriptor left).
        console.error(
            _no_descriptors(exc)
            or f"unexpected internal error ({type(exc).__name__}); please report it"
        )
        return EXIT_FAILED
    console.flush_caveats()
    return EXIT_OK if status is None else status


def _no_descriptors(exc: BaseException) -> str | None:
    """The one line for a command the host's open-file limit stopped (EMFILE / ENFILE
    anywhere in the error's chain: under `ulimit -n 12` uvicorn's event loop could not even
    start, and the command said 'unexpected internal error (RuntimeError); please report
    it'), naming the limit to raise; None for any other error."""
    for current in error_chain(exc):
        if isinstance(current, OSError) and current.errno in (errno.EMFILE, errno.ENFILE):
            import resource

            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
            return (
                f"out of file descriptors ({errno.errorcode[current.errno]}): raise the "
                f"open-file limit (ulimit -n, now {limit}; systemd LimitNOFILE)"
            )
    return None


def _directory_gone(exc: OSError) -> str | None:
    """The line for a relative path that failed because the current directory has been
    removed (a release directory a deploy replaced): "No such file or directory" alone
    named neither the path nor why."""
    if not isinstance(exc, FileNotFoundError):
        return None
    try:
        os.getcwd()
    except FileNotFoundError:
        return (
            f"{exc.strerror or 'not found'}: the current directory no longer exists (deleted "
            "or moved), so no relative path can be found; run from a directory that exists, "
            "or give absolute paths"
        )
    return None


def silence_stdout(console: Console) -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, console.out.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # not a real file (a test's StringIO): nothing to silence


def quiet_library_warnings() -> None:
    """The package's own warnings (e.g. "ledger unavailable") would reach stderr through
    logging's last-resort handler as a second line; a command reports its failure once.
    `serve` installs a real handler for its request log."""
    import logging

    package = logging.getLogger("fallback_mw")
    if not package.handlers:
        package.addHandler(logging.NullHandler())


def argv_is_text(argv: list[str]) -> None:
    """Arguments must be UTF-8 text: a non-UTF-8 byte (decoded by Python as a surrogate)
    would otherwise reach the store or a terminal. Python decodes them by the locale, so
    under LC_ALL=C without its UTF-8 mode (a cron job's environment) a UTF-8 argument (a
    tenant `日本語`) is one too: refused saying so, and how to pass it (read as UTF-8 here,
    it would be right as a tenant and wrong as a path, which that locale cannot open)."""
    for position, arg in enumerate(argv, start=1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            try:
                os.fsencode(arg).decode("utf-8")
            except UnicodeError:
                raise Refused(f"argument {position} is not valid UTF-8 text") from None
            raise Refused(
                f"argument {position} is UTF-8 text this locale's encoding "
                f"({sys.getfilesystemencoding()}) cannot read: run the command with "
                "PYTHONUTF8=1 (or under a UTF-8 locale such as C.UTF-8)"
            ) from None


class _ClosedStdout(io.TextIOBase):
    """stdout of a process started without one (`>&-`; Python's sys.stdout is None): the
    first result printed fails the command in the convention's one line."""

    def write(self, text: str) -> int:
        raise Failed(
            "stdout is closed (the command was started with it closed): nothing can be printed"
        )


def default_console() -> Console:
    out = sys.stdout if sys.stdout is not None else cast(TextIO, _ClosedStdout())
    # Without stderr an error line has nowhere to go: the exit status still says it.
    err: TextIO = sys.stderr if sys.stderr is not None else io.StringIO()
    # `surrogateescape` is what Python gives stdout under the C / POSIX locale without its
    # UTF-8 mode: it writes back the bytes of an undecodable argument, and fails on any
    # other character the encoding lacks, as `strict` does.
    if isinstance(out, io.TextIOWrapper) and out.errors in ("strict", "surrogateescape"):
        # Under an ASCII or Latin-1 locale (LC_ALL=C without UTF-8 mode, PYTHONIOENCODING),
        # one character the encoding lacks (a tenant asked for, eval's verdict dash) made
        # the result an 'unexpected internal error' after its work was done: escape it, as
        # Python's own stderr does.
        out.reconfigure(errors="backslashreplace")
    return Console(out=out, err=err)


def writable_out(out: Path, shown: str) -> None:
    """Refuse (exit 2) an `--out` that cannot take the report, before the work that makes
    it runs (minutes of eval arms, a game day's fault): its results are never lost at the
    end. Its directory is made if missing."""
    if out.is_dir():
        raise Refused(f"--out {shown} is a directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Refused(f"--out {shown}: {exc.strerror or exc}") from None
    if not os.access(out.parent, os.W_OK):
        raise Refused(f"--out {shown}: the directory is not writable")


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a file beside it renamed over it: a disk that fills up
    (or a stop) half-way leaves the file as it was, never truncated or half-written, and no
    stray temporary file. The file keeps its mode (a new one gets the umask's, as an
    `open` gives it: mkstemp's 0600 made a report that others or a web server read
    unreadable to them). A symlink (`latest.json` -> a shared volume's file) is written
    through: the file it names is replaced, the link kept, as an in-place write did."""
    import secrets
    import stat

    if path.is_symlink():
        path = path.resolve()
    try:
        kept: int | None = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        kept = None
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # less the umask
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            if kept is not None:
                os.fchmod(out.fileno(), kept)
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
