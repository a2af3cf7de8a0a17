"""Output shared by verbs: route descriptions and plain text tables. Names, URLs and
variable names only, never a variable's value."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fallback_mw.cli.app import Console, printable
from fallback_mw.config import RouteConfig, UpstreamConfig
from fallback_mw.rules import shown_variable


def candidate(name: str, upstream: UpstreamConfig | None) -> str:
    if upstream is None:
        return f"{name}=?"
    envs = ",".join(shown_variable(env) for env in upstream.credential_envs)
    return f"{name}={upstream.url}" + (f" (env {envs})" if envs else "")


def route_line(route: RouteConfig, upstreams: Mapping[str, UpstreamConfig], source: str) -> str:
    """One tab-separated line: id, source, prefix, [tenant,] retries, then the plan."""
    plan = " -> ".join(candidate(name, upstreams.get(name)) for name in route.plan)
    tenant = f"tenant={route.tenant}\t" if route.tenant is not None else ""
    return f"{route.id}\t{source}\t{route.prefix}\t{tenant}retries={route.retries}\t{plan}"


def one_line(text: str) -> str:
    """A table cell as a terminal shows it in its column: every character that is not
    printable (a tab, a newline, an escape sequence's ESC) becomes `?`."""
    return printable(text)


def print_table(console: Console, rows: Sequence[Sequence[str]]) -> None:
    # Cells hold stored text (a caller's tenant id, a record written by hand): a tab would
    # break the columns, a newline forge a row, an escape sequence drive the terminal.
    rows = [[one_line(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        console.print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
