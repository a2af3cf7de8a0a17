"""`fallback-mw routes ...`: its flags and help. Its handler is cli/routes.py, imported when
the verb runs: the parser (`--help`, a usage error) imports none of what a verb needs."""

from __future__ import annotations

import argparse
from typing import Any

from fallback_mw.cli.app import Console, leaf
from fallback_mw.cli.verbs.shared import store_options


def routes_add(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.routes import routes_add as run

    run(args, console)


def routes_set_fallback(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.routes import routes_set_fallback as run

    run(args, console)


def routes_set(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.routes import routes_set as run

    run(args, console)


def routes_clear_fallback(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.routes import routes_clear_fallback as run

    run(args, console)


def routes_list(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.routes import routes_list as run

    run(args, console)


def routes_remove(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.routes import routes_remove as run

    run(args, console)


def _credentials(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    parser.add_argument(
        f"--{prefix}auth-header",
        metavar="HEADER",
        help="the header the credential goes in (default authorization, sent as 'Bearer KEY'; "
        "any other header carries the bare key)",
    )
    parser.add_argument(
        f"--{prefix}auth-env", metavar="VAR", help="the variable's NAME; its value is never read"
    )


def _check_env(parser: argparse.ArgumentParser, *, names: bool = True) -> None:
    what = (
        "refuse when this route names a credential variable not set in this shell, and warn "
        "when another store route does"
        if names
        else "warn when a store route names a credential variable not set in this shell"
    )
    parser.add_argument(
        "--check-env",
        action="store_true",
        help=f"also {what} (a gateway lacking it too refuses the whole store, this change "
        "included): for a shell with the gateways' environment",
    )


def register(subparsers: Any) -> None:
    routes = subparsers.add_parser(
        "routes", help="route store administration", description="route store administration"
    )
    verbs = routes.add_subparsers(dest="routes_verb", metavar="VERB", required=True)

    add = leaf(verbs, "add", routes_add, "add a route to the store")
    store_options(add)
    add.add_argument("--id", required=True, help="the new route's id (letters, digits, -_.:)")
    add.add_argument(
        "--prefix", required=True, help="the path prefix it routes, e.g. /api/ (longest wins)"
    )
    add.add_argument("--tenant", help="only this tenant's requests (default: any tenant)")
    add.add_argument(
        "--upstream", required=True, metavar="URL", help="the primary, e.g. https://api.a.com"
    )
    _credentials(add)
    add.add_argument(
        "--retries",
        type=int,
        default=0,
        help="attempts after the first (default 0; >= 1 to reach the fallback)",
    )
    add.add_argument("--fallback", metavar="URL", help="the candidate tried after the primary")
    _credentials(add, "fallback-")
    _check_env(add)

    setfb = leaf(verbs, "set-fallback", routes_set_fallback, "set a store route's fallback")
    store_options(setfb)
    setfb.add_argument("--id", required=True, help="the store route to change")
    setfb.add_argument("--upstream", required=True, metavar="URL", help="the new fallback")
    _credentials(setfb)
    setfb.add_argument(
        "--retries", type=int, help="also set the route's retries (>= 1 to reach the fallback)"
    )
    _check_env(setfb)

    set_ = leaf(verbs, "set", routes_set, "change a store route's retries")
    store_options(set_)
    set_.add_argument("--id", required=True, help="the store route to change")
    set_.add_argument(
        "--retries", type=int, required=True, metavar="N", help="attempt ceiling = 1 + N"
    )
    _check_env(set_, names=False)

    clear = leaf(verbs, "clear-fallback", routes_clear_fallback, "drop a store route's fallback")
    store_options(clear)
    clear.add_argument("--id", required=True, help="the store route to change")
    _check_env(clear, names=False)

    list_ = leaf(verbs, "list", routes_list, "list file and store routes")
    store_options(list_)
    list_.add_argument(
        "--tenant", help="only the routes this tenant's requests can match (its own and any-tenant)"
    )
    list_.add_argument(
        "--check-env",
        action="store_true",
        help="also warn when a store route names a credential variable not set in this shell "
        "(a gateway lacking it too refuses the whole store): for a shell with the gateways' "
        "environment",
    )

    remove = leaf(verbs, "remove", routes_remove, "remove a store route")
    store_options(remove)
    remove.add_argument("--id", required=True, help="the store route to remove")
    _check_env(remove, names=False)
