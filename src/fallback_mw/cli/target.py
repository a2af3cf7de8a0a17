"""How every admin verb finds its store: `--store URL`, or `--config FILE` (its
`[gateway] store`, and the file's routes, upstreams, budgets and allowlist)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from fallback_mw.cli.app import Refused
from fallback_mw.config import GatewayConfig, load_config
from fallback_mw.store_url import parse_store_url


def store_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", metavar="URL", help="sqlite:///path.db or postgresql://...")
    parser.add_argument(
        "--config", metavar="FILE", help="gateway TOML: its store, routes, budgets, allowlist"
    )


@dataclass(frozen=True)
class StoreTarget:
    config: GatewayConfig  # the file's configuration, or the defaults with --store alone
    url: str
    from_file: bool


def resolve(args: argparse.Namespace) -> StoreTarget:
    """The store URL and the file's configuration. An operator's shell need not hold the
    gateway's secrets, so the file's credential variables are not required to be set."""
    config = GatewayConfig()
    from_file = args.config is not None
    if from_file:
        config = load_config(args.config, check_env=False)
    url = args.store or config.gateway.store
    if not url:
        if from_file:
            raise Refused(f"{args.config}: [gateway] store is not set (pass --store URL)")
        raise Refused("no store: pass --store URL or --config FILE whose [gateway] sets store")
    parse_store_url(url)  # StoreURLError: a refusal
    return StoreTarget(config=config, url=url, from_file=from_file)
