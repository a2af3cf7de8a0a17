"""`fallback-mw demo [--port P]`: show failover, the POST rule and a budget on loopback
ports, then exit. The story itself is in demo_story.py, imported when the demo runs."""

from __future__ import annotations

import argparse

from fallback_mw.cli.app import Console, Failed, Refused
from fallback_mw.extras import require


def demo(args: argparse.Namespace, console: Console) -> None:
    if args.port and args.port > 65533:
        raise Refused("--port must leave room for two more ports (P+1, P+2): at most 65533")
    require("serve", "the demo command")
    from fallback_mw.cli.demo_story import run_story

    if not run_story(args.port, console.print):
        raise Failed("demo finished: some results were unexpected")
    console.print("demo finished")
