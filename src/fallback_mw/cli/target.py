"""How every admin verb finds its store: `--store URL`, or `--config FILE` (its
`[gateway] store`, and the file's routes, upstreams, budgets and allowlist)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from fallback_mw.budget import Ledger
from fallback_mw.cli.app import Console, Failed, Refused
from fallback_mw.config import GatewayConfig, load_config
from fallback_mw.store.ledgers import open_ledger
from fallback_mw.store.model import Fault, StoredRoute
from fallback_mw.store.routes import RouteStore, open_store
from fallback_mw.store_url import parse_store_url

# A file without a store (the README's has none): there is no URL to pass, since each
# gateway kept its usage and spend in its own memory. Say what to add.
NO_STORE_IN_FILE = (
    "[gateway] store is not set, so there is no store for this command to read or change: "
    "without one each gateway keeps its usage records and budget spend in its own memory, "
    "out of any command's reach, and has no stored routes or faults. Add "
    'store = "sqlite:///gateway.db" under [gateway] (postgresql://... for gateways on '
    "several hosts) and restart the gateways, or pass --store URL"
)


@dataclass(frozen=True)
class StoreTarget:
    config: GatewayConfig  # the file's configuration, or the defaults with --store alone
    url: str
    from_file: bool
    # A SQLite file that does not exist, for a verb that stores nothing new: not created.
    absent: Path | None = None


def resolve(args: argparse.Namespace, console: Console, *, creates: bool) -> StoreTarget:
    """The store URL and the file's configuration. An operator's shell need not hold the
    gateway's secrets, so the file's credential variables are not required to be set.

    Only a verb that `creates` something (`routes add`, `faults set`, `budgets set`,
    `gameday`) creates a SQLite store file that is not there: for every other verb a missing
    file is most likely a typo in the path, and creating it would hide that behind "no
    routes" / "no usage records". It is read as empty (`open_route_store`, `open_ledger_of`)
    and said once (a caveat: a warning line beside the result, or part of the error line);
    the exit status is the empty store's. So is a relative SQLite store from `--config` that
    resolves, from here, to another file than the one beside the config file."""
    config = GatewayConfig()
    from_file = args.config is not None
    if from_file:
        config = load_config(args.config, check_env=False)
    url = args.store or config.gateway.store
    if not url:
        if from_file:
            raise Refused(f"{args.config}: {NO_STORE_IN_FILE}")
        raise Refused("no store: pass --store URL or --config FILE whose [gateway] sets store")
    parse_store_url(url)  # StoreURLError: a refusal
    if from_file and not args.store:
        elsewhere = relative_store_elsewhere(args.config, url)
        if elsewhere is not None:
            console.caveat(elsewhere)
    absent = None if creates else missing_sqlite_file(url)
    if absent is not None:
        console.caveat(no_store_file(absent))
    return StoreTarget(config=config, url=url, from_file=from_file, absent=absent)


def missing_sqlite_file(url: str) -> Path | None:
    """The SQLite store's file when it does not exist in a directory that does. (In a
    missing directory nothing could ever have been stored: opening it fails, exit 1.)"""
    parsed = parse_store_url(url)
    if parsed.kind != "sqlite":
        return None
    path = Path(parsed.target)
    if path.exists() or not path.parent.is_dir():
        return None
    return path.resolve()


def no_store_file(path: Path) -> str:
    return (
        f"no store file at {path}: nothing is recorded there yet (check the path; a gateway, "
        "`routes add`, `faults set` or `budgets set` creates it)"
    )


def open_route_store(target: StoreTarget) -> RouteStore:
    return AbsentStore(target.absent) if target.absent is not None else open_store(target.url)


def open_ledger_of(target: StoreTarget) -> Ledger:
    # An empty ledger in memory stands for the file that is not there.
    return open_ledger(None if target.absent is not None else target.url)


class AbsentStore:
    """The route store of a SQLite file that does not exist: no routes, no faults; the
    changes that need something there find nothing, and nothing is created."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def load_routes(self, *, unreadable: list[str] | None = None) -> list[StoredRoute]:
        return []

    async def insert_route(self, stored: StoredRoute) -> None:
        raise Failed(f"no store file at {self.path}")  # verbs that create open the file

    async def replace_route(self, stored: StoredRoute, *, expected: str | None = None) -> bool:
        raise Failed(f"no store file at {self.path}")

    async def replace_route_clearing(
        self, stored: StoredRoute, *, expected: str | None, dropped: Collection[str]
    ) -> int | None:
        raise Failed(f"no store file at {self.path}")

    async def remove_route(
        self, route_id: str, *, keep_upstreams: Collection[str] = (), keep_pin: bool = False
    ) -> int | None:
        return None

    async def clock(self) -> float:
        return time.time()

    async def load_faults(self, unreadable: list[str] | None = None) -> list[Fault]:
        return []

    async def set_fault(self, fault: Fault, *, replace: bool = False) -> Fault | None:
        raise Failed(f"no store file at {self.path}")

    async def clear_faults(
        self,
        *,
        upstream: str | None = None,
        route: str | None = None,
        expires_at: float | None = None,
    ) -> int:
        return 0

    async def schema_version(self, component: str) -> int:
        return 0

    async def change_serials(self) -> tuple[int, int]:
        return 0, 0

    async def wait_for_change(self, poll_interval: float) -> None:
        return None

    async def aclose(self) -> None:
        return None


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
