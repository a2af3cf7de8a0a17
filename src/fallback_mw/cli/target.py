"""How every admin verb finds its store: `--store URL`, or `--config FILE` (its
`[gateway] store`, and the file's routes, upstreams, budgets and allowlist)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from fallback_mw.cli.app import Console, Refused
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


def resolve(args: argparse.Namespace, console: Console) -> StoreTarget:
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
    if from_file and not args.store:
        elsewhere = relative_store_elsewhere(args.config, url)
        if elsewhere is not None:
            console.caveat(elsewhere)
    return StoreTarget(config=config, url=url, from_file=from_file)


def relative_sqlite_path(url: str) -> Path | None:
    """Where a relative SQLite store (`sqlite:///gw.db`) resolves: against the working
    directory of the process that opens it, never against the config file naming it (a
    deployment may depend on that). None for any other store."""
    parsed = parse_store_url(url)
    if parsed.kind != "sqlite" or Path(parsed.target).is_absolute():
        return None
    return Path(parsed.target).resolve()


def relative_store_elsewhere(config_path: str, url: str) -> str | None:
    """A warning when the config file's relative SQLite store resolves, from this working
    directory, to another file than the one beside the config file: the command would
    read or write a store the gateways (started elsewhere) never read."""
    here = relative_sqlite_path(url)
    if here is None:
        return None
    beside = (Path(config_path).parent / parse_store_url(url).target).resolve()
    if here == beside:
        return None
    return (
        f"{config_path}: store {url} is relative to the working directory, not to the "
        f"config file: this command uses {here}, not {beside} beside the config file (a "
        "gateway started in another directory uses yet another file); name one file for "
        f'every command and gateway with an absolute path: store = "sqlite:///{beside}"'
    )
