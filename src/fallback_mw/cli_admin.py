"""Route store administration (SPEC §10): `routes add/set-fallback/clear-fallback/list/remove`
and `faults set/clear/list`. Every verb finds the store from `--store URL` or `--config FILE`.
Refusals exit with status 2 and store nothing."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from fallback_mw.config import (
    ConfigError,
    GatewayConfig,
    RouteConfig,
    UpstreamConfig,
    load_config,
)
from fallback_mw.store.routes import (
    Fault,
    RouteStore,
    StoredRoute,
    StoreError,
    build_model,
    fallback_name,
    make_upstream,
    merge_routes,
    open_store,
    primary_name,
)
from fallback_mw.store.url import StoreURLError, parse_store_url

EXIT_REFUSED = 2
EXIT_NOT_FOUND = 1
MAX_TTL_SECONDS = 7 * 24 * 3600


class Refused(Exception):
    """An admin command the store refuses: exit status 2, nothing stored."""


class NotFound(Exception):
    pass


@dataclass
class Target:
    config: GatewayConfig  # the file's configuration, or defaults when only --store is given
    store: RouteStore
    from_file: bool


def _resolve_target(args: argparse.Namespace) -> Target:
    config = GatewayConfig()
    from_file = False
    if args.config:
        # The admin's shell need not hold the gateway's secrets: variables are not checked.
        config = load_config(args.config, check_env=False)
        from_file = True
    url = args.store or config.gateway.store
    if not url:
        raise Refused("no store: pass --store URL or --config FILE whose [gateway] sets store")
    try:
        parse_store_url(url)
    except StoreURLError as exc:
        raise Refused(str(exc)) from None
    return Target(config=config, store=open_store(url), from_file=from_file)


async def _check_and_write(
    target: Target, stored: StoredRoute, write: Callable[[StoredRoute], Awaitable[None]]
) -> None:
    """Refuse what the config loader refuses, against the merged view the gateways will
    build (file routes + every other store route + this one), then write."""
    existing = [s for s in await target.store.load_routes() if s.route.id != stored.route.id]
    await asyncio.to_thread(merge_routes, target.config, [*existing, stored])
    await write(stored)


def _find_stored(routes: list[StoredRoute], route_id: str) -> StoredRoute:
    for stored in routes:
        if stored.route.id == route_id:
            return stored
    raise NotFound(f"no route {route_id!r} in the store")


def _refuse_unset_variables(route_id: str, upstreams: dict[str, UpstreamConfig]) -> None:
    """SPEC §3/§10: the store refuses what the loader refuses, an unset credential variable
    included (named; its value is never printed). Run the admin command where the
    gateway's credential variables are set, or the gateways would refuse the route."""
    for name, upstream in upstreams.items():
        for var in upstream.credential_envs:
            if not os.environ.get(var):
                raise Refused(
                    f"route {route_id!r}: upstream {name!r}: environment variable {var} is not set"
                )


def _refuse_orphan_credentials(args: argparse.Namespace) -> None:
    if getattr(args, "fallback", None) is None and (
        args.fallback_auth_header is not None or args.fallback_auth_env is not None
    ):
        raise Refused(
            f"route {args.id!r}: --fallback-auth-header/--fallback-auth-env given without "
            "--fallback (credentials for a fallback upstream that does not exist)"
        )


# --- routes -------------------------------------------------------------------------------


async def routes_add(args: argparse.Namespace, target: Target, out: TextIO) -> None:
    _refuse_orphan_credentials(args)
    where = f"route {args.id!r}"
    upstreams = {
        primary_name(args.id): make_upstream(
            args.upstream, args.auth_header, args.auth_env, f"{where}, --upstream"
        )
    }
    plan = [primary_name(args.id)]
    if args.fallback is not None:
        upstreams[fallback_name(args.id)] = make_upstream(
            args.fallback, args.fallback_auth_header, args.fallback_auth_env, f"{where}, --fallback"
        )
        plan.append(fallback_name(args.id))
    route = build_model(
        RouteConfig,
        {"id": args.id, "prefix": args.prefix, "plan": plan, "retries": args.retries},
        where,
    )
    _refuse_unset_variables(args.id, upstreams)
    stored = StoredRoute(route=route, upstreams=upstreams)
    await _check_and_write(target, stored, target.store.insert_route)
    out.write(f"route {args.id!r} added: {' -> '.join(plan)}\n")


async def routes_set_fallback(args: argparse.Namespace, target: Target, out: TextIO) -> None:
    if any(r.id == args.id for r in target.config.routes):
        raise Refused(f"route {args.id!r} is defined in the config file; edit the file instead")
    current = _find_stored(await target.store.load_routes(), args.id)
    where = f"route {args.id!r}"
    primary = current.route.plan[0]
    upstreams = {primary: current.upstreams[primary]} if primary in current.upstreams else {}
    upstreams[fallback_name(args.id)] = make_upstream(
        args.upstream, args.auth_header, args.auth_env, f"{where}, --upstream"
    )
    route = build_model(
        RouteConfig,
        {**current.route.model_dump(), "plan": [primary, fallback_name(args.id)]},
        where,
    )
    _refuse_unset_variables(args.id, {fallback_name(args.id): upstreams[fallback_name(args.id)]})
    await _check_and_write(
        target, StoredRoute(route=route, upstreams=upstreams), target.store.replace_route
    )
    out.write(f"route {args.id!r}: fallback set ({primary} -> {fallback_name(args.id)})\n")


async def routes_clear_fallback(args: argparse.Namespace, target: Target, out: TextIO) -> None:
    if any(r.id == args.id for r in target.config.routes):
        raise Refused(f"route {args.id!r} is defined in the config file; edit the file instead")
    current = _find_stored(await target.store.load_routes(), args.id)
    primary = current.route.plan[0]
    upstreams = {primary: current.upstreams[primary]} if primary in current.upstreams else {}
    route = build_model(
        RouteConfig, {**current.route.model_dump(), "plan": [primary]}, f"route {args.id!r}"
    )
    await _check_and_write(
        target, StoredRoute(route=route, upstreams=upstreams), target.store.replace_route
    )
    out.write(f"route {args.id!r}: fallback cleared ({primary} only)\n")


def _describe_route(route: RouteConfig, upstreams: dict[str, Any], source: str) -> str:
    candidates = []
    for name in route.plan:
        upstream = upstreams.get(name)
        url = upstream.url if upstream is not None else "?"
        envs = ",".join(upstream.credential_envs) if upstream is not None else ""
        candidates.append(f"{name}={url}" + (f" (env {envs})" if envs else ""))
    return f"{route.id}\t{source}\t{route.prefix}\tretries={route.retries}\t" + " -> ".join(
        candidates
    )


async def routes_list(args: argparse.Namespace, target: Target, out: TextIO) -> None:
    stored = await target.store.load_routes()
    lines = [
        _describe_route(r, dict(target.config.upstreams), "file") for r in target.config.routes
    ]
    lines += [_describe_route(s.route, dict(s.upstreams), "store") for s in stored]
    if not lines:
        out.write("no routes\n")
    for line in lines:
        out.write(line + "\n")


async def routes_remove(args: argparse.Namespace, target: Target, out: TextIO) -> None:
    if any(r.id == args.id for r in target.config.routes):
        raise Refused(f"route {args.id!r} is defined in the config file; edit the file instead")
    if not await target.store.remove_route(args.id):
        raise NotFound(f"no route {args.id!r} in the store")
    out.write(f"route {args.id!r} removed\n")


# --- faults -------------------------------------------------------------------------------


async def _known(target: Target) -> tuple[dict[str, tuple[str, ...]], set[str]]:
    routes = {r.id: r.plan for r in target.config.routes}
    upstreams = set(target.config.upstreams)
    for stored in await target.store.load_routes():
        routes[stored.route.id] = stored.route.plan
        upstreams.update(stored.upstreams)
    return routes, upstreams


async def faults_set(args: argparse.Namespace, target: Target, out: TextIO) -> None:
    if not 0 < args.ttl <= MAX_TTL_SECONDS:
        raise Refused(f"--ttl must be between 1 and {MAX_TTL_SECONDS} seconds")
    routes, upstreams = await _known(target)
    expires_at = time.time() + args.ttl
    if args.kind == "pin":
        if args.route is None or args.candidate is None:
            raise Refused("faults set pin needs --route ID and --candidate NAME")
        if args.upstream is not None:
            raise Refused("faults set pin takes --route and --candidate, not --upstream")
        plan = routes.get(args.route)
        if plan is None and target.from_file:
            # With --store alone a file route cannot be seen, so it cannot be checked.
            raise Refused(f"unknown route {args.route!r}")
        if plan is not None and args.candidate not in plan:
            raise Refused(
                f"route {args.route!r}: {args.candidate!r} is not one of its candidates "
                f"({', '.join(plan)})"
            )
        fault = Fault(
            kind="pin", target=args.route, expires_at=expires_at, candidate=args.candidate
        )
        what = f"pin route {args.route!r} to {args.candidate!r}"
    else:
        if args.upstream is None:
            raise Refused(f"faults set {args.kind} needs --upstream NAME")
        if args.route is not None or args.candidate is not None:
            raise Refused(f"faults set {args.kind} takes --upstream only")
        if args.upstream not in upstreams and target.from_file:
            raise Refused(f"unknown upstream {args.upstream!r}")
        fault = Fault(kind=args.kind, target=args.upstream, expires_at=expires_at)
        what = f"{args.kind} upstream {args.upstream!r}"
    await target.store.set_fault(fault)
    out.write(f"fault set: {what} for {args.ttl} s\n")


async def faults_clear(args: argparse.Namespace, target: Target, out: TextIO) -> None:
    if args.upstream is not None:
        count = await target.store.clear_faults(upstream=args.upstream)
    elif args.route is not None:
        count = await target.store.clear_faults(route=args.route)
    else:
        count = await target.store.clear_faults()
    out.write(f"{count} fault(s) cleared\n")


async def faults_list(args: argparse.Namespace, target: Target, out: TextIO) -> None:
    faults = await target.store.load_faults()
    if not faults:
        out.write("no faults\n")
    now = time.time()
    for fault in faults:
        where = f"route={fault.target}" if fault.scope == "route" else f"upstream={fault.target}"
        extra = f"\tcandidate={fault.candidate}" if fault.candidate else ""
        out.write(
            f"{fault.kind}\t{where}{extra}\texpires_in={max(fault.expires_at - now, 0):.0f}s\n"
        )


# --- the parser ---------------------------------------------------------------------------

Handler = Callable[[argparse.Namespace, Target, TextIO], Awaitable[None]]


def run_admin(handler: Handler, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    async def main() -> None:
        target = _resolve_target(args)
        try:
            await handler(args, target, out)
        finally:
            await target.store.aclose()

    try:
        asyncio.run(main())
    except (Refused, ConfigError) as exc:
        err.write(f"fallback-mw: refused: {exc}\n")
        return EXIT_REFUSED
    except NotFound as exc:
        err.write(f"fallback-mw: {exc}\n")
        return EXIT_NOT_FOUND
    except StoreError as exc:
        err.write(f"fallback-mw: store error: {exc}\n")
        return EXIT_NOT_FOUND
    return 0


def _store_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", metavar="URL", help="sqlite:///path.db or postgresql://...")
    common.add_argument("--config", metavar="FILE", help="gateway TOML (its store, allowlist)")
    return common


def _leaf(
    parent: Any, name: str, handler: Handler, help_text: str, common: argparse.ArgumentParser
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = parent.add_parser(name, help=help_text, parents=[common])
    parser.set_defaults(
        handler=lambda args, out=None, err=None: run_admin(
            handler, args, out or sys.stdout, err or sys.stderr
        )
    )
    return parser


def register(subparsers: Any) -> None:
    """Add `routes` and `faults` to an argparse subparsers object. Each leaf sets
    `args.handler(args) -> int` (the exit status)."""
    common = _store_options()

    routes = subparsers.add_parser("routes", help="route store administration")
    verbs = routes.add_subparsers(dest="routes_verb", metavar="VERB", required=True)
    add = _leaf(verbs, "add", routes_add, "add a route", common)
    add.add_argument("--id", required=True)
    add.add_argument("--prefix", required=True)
    add.add_argument("--upstream", required=True, metavar="URL")
    add.add_argument("--auth-header", metavar="HEADER")
    add.add_argument("--auth-env", metavar="VAR")
    add.add_argument("--retries", type=int, default=0)
    add.add_argument("--fallback", metavar="URL")
    add.add_argument("--fallback-auth-header", metavar="HEADER")
    add.add_argument("--fallback-auth-env", metavar="VAR")
    setfb = _leaf(verbs, "set-fallback", routes_set_fallback, "set a route's fallback", common)
    setfb.add_argument("--id", required=True)
    setfb.add_argument("--upstream", required=True, metavar="URL")
    setfb.add_argument("--auth-header", metavar="HEADER")
    setfb.add_argument("--auth-env", metavar="VAR")
    clear = _leaf(verbs, "clear-fallback", routes_clear_fallback, "drop the fallback", common)
    clear.add_argument("--id", required=True)
    _leaf(verbs, "list", routes_list, "list routes", common)
    remove = _leaf(verbs, "remove", routes_remove, "remove a route", common)
    remove.add_argument("--id", required=True)

    faults = subparsers.add_parser("faults", help="game-day fault injection")
    fverbs = faults.add_subparsers(dest="faults_verb", metavar="VERB", required=True)
    fset = _leaf(fverbs, "set", faults_set, "set a fault with an expiry", common)
    fset.add_argument("kind", choices=["fail", "hang", "pin"])
    fset.add_argument("--upstream", metavar="NAME")
    fset.add_argument("--route", metavar="ID")
    fset.add_argument("--candidate", metavar="NAME")
    fset.add_argument("--ttl", type=int, required=True, metavar="SECONDS")
    fclear = _leaf(fverbs, "clear", faults_clear, "clear faults", common)
    # SPEC §10: `faults clear [--upstream NAME | --route ID | --all]`; no flag clears all.
    which = fclear.add_mutually_exclusive_group(required=False)
    which.add_argument("--upstream", metavar="NAME")
    which.add_argument("--route", metavar="ID")
    which.add_argument("--all", action="store_true")
    _leaf(fverbs, "list", faults_list, "list active faults", common)


def main(
    argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    parser = argparse.ArgumentParser(prog="fallback-mw")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    status: int = args.handler(args, out, err)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
