"""Output shared by verbs: route descriptions and plain text tables. Names, URLs and
variable names only, never a variable's value."""

from __future__ import annotations

import codecs
import unicodedata
from collections.abc import Callable, Mapping, Sequence

from fallback_mw.cli.app import Console
from fallback_mw.config import RouteConfig, UpstreamConfig
from fallback_mw.quoting import printable
from fallback_mw.rules import shown_variable


def candidate(name: str, upstream: UpstreamConfig | None) -> str:
    if upstream is None:
        return f"{name}=?"
    envs = ",".join(shown_variable(env) for env in upstream.credential_envs)
    return f"{name}={upstream.url}" + (f" (env {envs})" if envs else "")


def route_line(route: RouteConfig, upstreams: Mapping[str, UpstreamConfig], source: str) -> str:
    """One tab-separated line: id, source, prefix, [tenant,] retries, then the plan. A prefix
    or tenant may hold any character but a control one (a right-to-left override, a
    zero-width space): shown as `?`, as a terminal would otherwise act on it."""
    plan = " -> ".join(candidate(name, upstreams.get(name)) for name in route.plan)
    tenant = f"tenant={printable(route.tenant)}\t" if route.tenant is not None else ""
    prefix = printable(route.prefix)
    return f"{route.id}\t{source}\t{prefix}\t{tenant}retries={route.retries}\t{plan}"


def one_line(text: str) -> str:
    """A table cell as a terminal shows it in its column: every character that is not
    printable (a tab, a newline, an escape sequence's ESC) becomes `?`."""
    return printable(text)


def print_table(console: Console, rows: Sequence[Sequence[str]]) -> None:
    # Cells hold stored text (a caller's tenant id, a record written by hand): a tab would
    # break the columns, a newline forge a row, an escape sequence drive the terminal.
    shown = _as_shown(console)
    rows = [[shown(one_line(cell)) for cell in row] for row in rows]
    widths = [max(display_width(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        console.print(
            "  ".join(
                cell + " " * (width - display_width(cell))
                for cell, width in zip(row, widths, strict=True)
            ).rstrip()
        )


def display_width(text: str) -> int:
    """The columns a terminal gives `text`: two for a wide East Asian character (`日`),
    none for a combining mark (the accent of `e` + U+0301), one for any other. Measured
    as `len`, a tenant `日本語` pushed every later column of its row three places right."""
    if text.isascii():
        return len(text)
    return sum(_char_width(char) for char in text)


def _char_width(char: str) -> int:
    if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me"):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def _as_shown(console: Console) -> Callable[[str], str]:
    """A cell as the console writes it: escaped (`\\xe9`) where its encoding lacks a
    character (an ASCII locale: cli/app.py), so its width is the escape's."""
    encoding = getattr(console.out, "encoding", None) or "utf-8"
    try:
        if codecs.lookup(encoding).name == "utf-8":
            return str
    except LookupError:
        return str

    def shown(cell: str) -> str:
        if cell.isascii():
            return cell
        return cell.encode(encoding, "backslashreplace").decode(encoding)

    return shown
