"""What a verb's parser shares with other parsers or with its own handler: the options every
verb that reads or changes the store takes (`--store URL`, `--config FILE`, resolved by
cli/target.py), and a number its help text quotes."""

from __future__ import annotations

import argparse


def store_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", metavar="URL", help="sqlite:///path.db or postgresql://...")
    parser.add_argument(
        "--config", metavar="FILE", help="gateway TOML: its store, routes, budgets, allowlist"
    )


INCIDENT_SCAN = 10_000  # newest records `usage --incidents` searches for incidents
