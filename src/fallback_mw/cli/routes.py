"""`fallback-mw routes add|set-fallback|clear-fallback|list|remove` (SPEC §10).

The store refuses what the config loader refuses (rules.py, through `merge_routes`), against
the merged view the gateways will build, and stores nothing when it refuses. Credential
variable names are checked for form; that they are set only with `--check-env`: an
operator's shell need not hold the gateway's secrets (a gateway lacking one refuses the
reload and keeps its running routes)."""

from __future__ import annotations

import argparse
from typing import Any

from fallback_mw import rules
from fallback_mw.cli.app import Console, Failed, Refused
from fallback_mw.cli.route_edits import (
    ChangedMeanwhile,
    check_and_write,
    edit_stored,
    newly_unreachable,
    refused_store,
    store_owned,
    store_refusal,
    stored_route,
    stored_route_warnings,
    unless_changed,
    with_store,
)
from fallback_mw.cli.show import route_line
from fallback_mw.cli.target import StoreTarget
from fallback_mw.config import RouteConfig, UpstreamConfig
from fallback_mw.quoting import printable
from fallback_mw.store.model import StoredRoute, build_model, fallback_name, primary_name
from fallback_mw.store.routes import RouteStore, make_upstream


def routes_add(args: argparse.Namespace, console: Console) -> None:
    where = f"route {args.id!r}"
    rules.check_id("route", args.id)  # before the upstream names derived from it
    longest = fallback_name(args.id)  # the longer derived name, kept fit for set-fallback
    if len(longest) > rules.MAX_ID_LENGTH:
        raise Refused(
            f"{where}: the id is too long for the upstream names derived from it ({longest!r}"
            f" is over {rules.MAX_ID_LENGTH} characters); use at most "
            f"{rules.MAX_ID_LENGTH - len(longest) + len(args.id)} characters"
        )
    rules.check_fallback_credentials(
        where, args.fallback, args.fallback_auth_header, args.fallback_auth_env
    )
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
    fields: dict[str, Any] = {
        "id": args.id, "prefix": args.prefix, "plan": plan, "retries": args.retries
    }  # fmt: skip
    if args.tenant is not None:
        fields["tenant"] = args.tenant
    stored = StoredRoute(route=build_model(RouteConfig, fields, where), upstreams=upstreams)
    if args.fallback is not None and args.retries < 1:
        # The loader's own words ("set retries >= 1") name a key this command spells
        # --retries, and its default is 0.
        raise Refused(
            f"{where} has retries = {args.retries}, so its --fallback could never be reached: "
            "add --retries 1 (or more)"
        )

    unreachable: dict[str, str] = {}
    warnings: list[str] = []

    async def work(target: StoreTarget, store: RouteStore) -> str:
        others = await check_and_write(target, store, stored, store.insert_route, args.check_env)
        warnings.extend(stored_route_warnings(target, stored))
        unreachable.update(newly_unreachable(target.config, others, stored))
        refused.extend(await refused_store(target, store, args.check_env))
        tenant = f" (tenant {printable(args.tenant)})" if args.tenant is not None else ""
        return f"route {args.id!r} added{tenant}: {' -> '.join(plan)}"

    refused: list[str] = []
    console.print(with_store(args, console, work, creates=True))
    for warning in warnings:
        console.warning(f"route {args.id!r}: {warning}")
    for route_id, why in unreachable.items():
        console.warning(f"route {route_id!r}: {why}")
    for warning in refused:
        console.warning(warning)


def routes_set_fallback(args: argparse.Namespace, console: Console) -> None:
    warnings: list[str] = []

    async def work(target: StoreTarget, store: RouteStore) -> str:
        store_owned(target, args.id)
        done = await edit_stored(args.id, lambda: attempt(target, store))
        refused.extend(await refused_store(target, store, args.check_env))
        return done

    async def attempt(target: StoreTarget, store: RouteStore) -> str:
        current = stored_route(await store.load_routes(), args.id)
        where = f"route {args.id!r}"
        primary = current.route.plan[0]
        upstreams: dict[str, UpstreamConfig] = {}
        if primary in current.upstreams:
            upstreams[primary] = current.upstreams[primary]
        upstreams[fallback_name(args.id)] = make_upstream(
            args.upstream, args.auth_header, args.auth_env, f"{where}, --upstream"
        )
        fields = {**current.route.model_dump(), "plan": [primary, fallback_name(args.id)]}
        write = unless_changed(store, current)
        if args.retries is not None:
            fields["retries"] = args.retries
        elif current.route.retries < 1:
            # Every other refusal first (checked as if retries were 1), then this one.
            fields["retries"] = 1

            async def refuse(_: StoredRoute) -> None:
                raise Refused(
                    f"{where} has retries = 0, so a fallback could never be reached: "
                    "add --retries 1 (or more)"
                )

            write = refuse

        stored = StoredRoute(route=build_model(RouteConfig, fields, where), upstreams=upstreams)
        await check_and_write(target, store, stored, write, args.check_env)
        warnings.extend(stored_route_warnings(target, stored))
        return (
            f"route {args.id!r}: fallback set ({primary} -> {fallback_name(args.id)}), "
            f"retries {stored.route.retries}"
        )

    refused: list[str] = []
    console.print(with_store(args, console, work))
    for warning in warnings:
        console.warning(f"route {args.id!r}: {warning}")
    for warning in refused:
        console.warning(warning)


def routes_set(args: argparse.Namespace, console: Console) -> None:
    warnings: list[str] = []

    async def work(target: StoreTarget, store: RouteStore) -> str:
        store_owned(target, args.id)
        done = await edit_stored(args.id, lambda: attempt(target, store))
        refused.extend(await refused_store(target, store, args.check_env))
        return done

    async def attempt(target: StoreTarget, store: RouteStore) -> str:
        current = stored_route(await store.load_routes(), args.id)
        fields = {**current.route.model_dump(), "retries": args.retries}
        route = build_model(RouteConfig, fields, f"route {args.id!r}")
        stored = StoredRoute(route=route, upstreams=dict(current.upstreams))
        write = unless_changed(store, current)
        await check_and_write(target, store, stored, write, check_env=False)
        warnings.extend(stored_route_warnings(target, stored))
        return (
            f"route {args.id!r}: retries {route.retries} (attempt ceiling {route.attempt_ceiling})"
        )

    refused: list[str] = []
    console.print(with_store(args, console, work))
    for warning in warnings:
        console.warning(f"route {args.id!r}: {warning}")
    for warning in refused:
        console.warning(warning)


def routes_clear_fallback(args: argparse.Namespace, console: Console) -> None:
    async def work(target: StoreTarget, store: RouteStore) -> str:
        store_owned(target, args.id)
        done = await edit_stored(args.id, lambda: attempt(target, store))
        refused.extend(await refused_store(target, store, args.check_env))
        return done

    async def attempt(target: StoreTarget, store: RouteStore) -> str:
        current = stored_route(await store.load_routes(), args.id)
        primary = current.route.plan[0]
        upstreams = {primary: current.upstreams[primary]} if primary in current.upstreams else {}
        fields = {**current.route.model_dump(), "plan": [primary]}
        route = build_model(RouteConfig, fields, f"route {args.id!r}")
        stored = StoredRoute(route=route, upstreams=upstreams)
        dropped = [name for name in current.upstreams if name not in upstreams]
        cleared: list[int] = []

        async def write(stored: StoredRoute) -> None:
            # The faults on the dropped fallback and a pin to it go with it, in the same
            # transaction: left in the store, they would fault the fallback set back under
            # the same derived name. A name the config file defines is the file's: it stays.
            mine = [name for name in dropped if name not in target.config.upstreams]
            count = await store.replace_route_clearing(stored, expected=current.doc, dropped=mine)
            if count is None:
                raise ChangedMeanwhile
            cleared.append(count)

        await check_and_write(target, store, stored, write, check_env=False)
        faults = f"; {cleared[0]} fault(s) on {', '.join(dropped)} cleared" if cleared[0] else ""
        return f"route {args.id!r}: fallback cleared ({primary} only){faults}"

    refused: list[str] = []
    console.print(with_store(args, console, work))
    for warning in refused:
        console.warning(warning)


def routes_list(args: argparse.Namespace, console: Console) -> None:
    unreadable: list[str] = []
    refused: list[str] = []

    async def work(target: StoreTarget, store: RouteStore) -> str:
        config = target.config
        # A record that does not load is said, not a failure of the whole list: the
        # operator sees the rest and which one to remove.
        stored = await store.load_routes(unreadable=unreadable)
        refusal = None if unreadable else await store_refusal(target, store, args.check_env)
        if refusal is not None:
            refused.append(
                f"the gateways refuse the store as it now is ({refusal}) and keep their "
                "running routes: the store routes listed are not what they serve until that "
                "route is fixed or removed"
            )
        if args.tenant is not None:
            # The routes this tenant's requests can match: its own and those for any tenant.
            def serves(route: RouteConfig) -> bool:
                return route.tenant in (None, args.tenant)

            routes = [r for r in config.routes if serves(r)]
            stored = [s for s in stored if serves(s.route)]
        else:
            routes = list(config.routes)
        lines = [route_line(r, config.upstreams, "file") for r in routes]
        lines += [route_line(s.route, s.upstreams, "store") for s in stored]
        if lines:
            return "\n".join(lines)
        if args.tenant is not None:
            return f"no routes for tenant {printable(args.tenant)}"
        return "no routes"

    console.print(with_store(args, console, work))
    for problem in unreadable:
        console.warning(f"{problem}; not listed: every gateway refuses the store while it is there")
    for warning in refused:
        console.warning(warning)


def routes_remove(args: argparse.Namespace, console: Console) -> None:
    async def work(target: StoreTarget, store: RouteStore) -> str:
        # The store's copy first: one whose id the file defines too (added with --store
        # alone) makes every gateway refuse its reloads, and removing it is the repair.
        # The faults it leaves behind (its pin, its upstreams') go in the same transaction,
        # but those on a name the config file defines: the file's, they stay (as for
        # clear-fallback's dropped upstreams).
        file_route = any(route.id == args.id for route in target.config.routes)
        cleared = await store.remove_route(
            args.id, keep_upstreams=target.config.upstreams.keys(), keep_pin=file_route
        )
        if cleared is not None:
            refused.extend(await refused_store(target, store, args.check_env))
            faults = f"; {cleared} fault(s) on it cleared" if cleared else ""
            return f"route {args.id!r} removed{faults}"
        store_owned(target, args.id)
        raise Failed(f"no route {args.id!r} in the store")

    refused: list[str] = []
    console.print(with_store(args, console, work))
    for warning in refused:
        console.warning(warning)
