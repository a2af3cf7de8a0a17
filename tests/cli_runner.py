"""Run a `fallback-mw` command in-process through the public entry point; its exit status."""

from __future__ import annotations

from collections.abc import Sequence


def run_cli(argv: Sequence[str]) -> int:
    from fallback_mw.cli import main

    return main(list(argv))
