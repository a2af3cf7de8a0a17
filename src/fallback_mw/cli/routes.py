"""`fallback-mw routes add|set-fallback|clear-fallback|list|remove` (SPEC §10).

The store refuses what the config loader refuses (rules.py, through `merge_routes`), against
the merged view the gateways will build, and stores nothing when it refuses. Credential
variable names are checked for form; that they are set only with `--check-env`: an
operator's shell need not hold the gateway's secrets (a gateway lacking one refuses the
reload and keeps its running routes)."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fallback_mw import rules
from fallback_mw.cli.app import Console, Failed, Refused, leaf, run
from fallback_mw.cli.config_warnings import route_warnings, unreachable_routes
from fallback_mw.cli.show import route_line
from fallback_mw.cli.target import StoreTarget, open_route_store, resolve, store_options
from fallback_mw.config import ConfigError, GatewayConfig, RouteConfig, UpstreamConfig
from fallback_mw.store.model import StoredRoute, build_model, fallback_name, primary_name
from fallback_mw.store.reload import merged_routes
from fallback_mw.store.routes import RouteStore, make_upstream, merge_routes

T = TypeVar("T")


def _with_store(
    args: argparse.Namespace,
    console: Console,
    work: Callable[[StoreTarget, RouteStore], Awaitable[str]],
    *,
    creates: bool = False,
) -> str:
    target = resolve(args, console, creates=creates)

    async def main() -> str:
        store = open_route_store(target)
        try:
            return await work(target, store)
        finally:
            await store.aclose()

    return run(main)


async def _check_and_write(
    target: StoreTarget,
    store: RouteStore,
    stored: StoredRoute,
    write: Callable[[StoredRoute], Awaitable[None]],
    check_env: bool,
) -> list[StoredRoute]:
    """The loader's refusals over file routes + every other store route + this one.
    Returns those other store routes."""
    if check_env:
        for name, upstream in stored.upstreams.items():
            where = f"route {stored.route.id!r}: upstream {name!r}"
            rules.check_variables_set(where, upstream.credential_envs, os.environ)
    existing = [s for s in await store.load_routes() if s.route.id != stored.route.id]
    try:
        await asyncio.to_thread(merge_routes, target.config, [*existing, stored])
    except ConfigError as exc:
        if target.from_file or "not in allow_hosts" not in str(exc):
            raise
        # "add it to [gateway] allow_hosts" names a file this command did not read: with
        # --store alone the default allowlist (loopback) applies.
        raise ConfigError(
            f"{exc} (with --store alone the default allow_hosts apply, "
            f"{', '.join(target.config.gateway.allow_hosts)}: pass --config FILE, the "
            "gateway's configuration, whose allow_hosts lists it)"
        ) from None
    await write(stored)
    return existing


def _newly_unreachable(
    config: GatewayConfig, others: list[StoredRoute], added: StoredRoute
) -> dict[str, str]:
    """The routes no request can reach once `added` joins the table, that could before
    (the new one included): valid, so stored, but `check` would warn about them."""
    routes = [*config.routes, *(stored.route for stored in others)]
    upstreams = dict(config.upstreams)
    for stored in [*others, added]:
        upstreams.update(stored.upstreams)
    before = unreachable_routes(routes, upstreams)
    after = unreachable_routes([*routes, added.route], upstreams)
    return {route_id: why for route_id, why in after.items() if route_id not in before}


def _stored_route_warnings(target: StoreTarget, stored: StoredRoute) -> list[str]:
    """What `check` would warn about the route just stored (a prefix without its '/', a
    primary whose first-byte timeout the deadline cuts, ...): valid, so stored, but said
    by the verb that stored it rather than left for the next `check`."""
    upstreams = {**target.config.upstreams, **stored.upstreams}
    deadline_ms = target.config.gateway.deadline_ms
    return route_warnings(stored.route, upstreams, deadline_ms, store=True)


async def _store_refusal(target: StoreTarget, store: RouteStore, check_env: bool) -> str | None:
    """Why the gateways' reload (store.reload.merged_routes, their own decision) would
    refuse the store as it now is, another route's fault or this one's, and so keep their
    running routes; None when it would not. Variables are checked in this shell only with
    --check-env (an operator's shell need not hold the gateways' secrets)."""
    try:
        await merged_routes(store, target.config, os.environ if check_env else None)
    except ConfigError as exc:
        shell = " in this shell" if check_env and "is not set" in str(exc) else ""
        return f"{exc}{shell}"
    return None


async def _refused_store(target: StoreTarget, store: RouteStore, check_env: bool) -> list[str]:
    """After a change is stored: the warning that the gateways will not apply it, when they
    refuse the store as a whole. The change itself is stored (exit status 0)."""
    refusal = await _store_refusal(target, store, check_env)
    if refusal is None:
        return []
    return [
        f"the gateways will not apply this change: they refuse the store as it now is "
        f"({refusal}) and keep their running routes until that route is fixed or removed"
    ]


def _stored(routes: list[StoredRoute], route_id: str) -> StoredRoute:
    for stored in routes:
        if stored.route.id == route_id:
            return stored
    raise Failed(f"no route {route_id!r} in the store")


class _ChangedMeanwhile(Exception):
    """Another command changed or removed the route between this one's read and its write."""


_EDIT_ATTEMPTS = 5


def _unless_changed(
    store: RouteStore, current: StoredRoute
) -> Callable[[StoredRoute], Awaitable[None]]:
    """Write an edit of `current` only while the store still holds `current`: of two
    operators editing one route at once, the second re-reads and applies its change to
    the first one's result (or finds the route gone), never overwriting it unseen."""

    async def write(stored: StoredRoute) -> None:
        if not await store.replace_route(stored, expected=current.doc):
            raise _ChangedMeanwhile

    return write


async def _edit(route_id: str, attempt: Callable[[], Awaitable[T]]) -> T:
    """Run a read-check-write `attempt` again while another command's edit of the route
    lands between its read and its write."""
    for _ in range(_EDIT_ATTEMPTS):
        try:
            return await attempt()
        except _ChangedMeanwhile:
            continue
    raise Failed(
        f"route {route_id!r} kept changing while this command ran (another command is "
        "editing it); nothing was stored: run it again"
    )


def _store_owned(target: StoreTarget, route_id: str) -> None:
    if any(r.id == route_id for r in target.config.routes):
        raise Refused(f"route {route_id!r} is defined in the config file; edit the file instead")


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
        others = await _check_and_write(target, store, stored, store.insert_route, args.check_env)
        warnings.extend(_stored_route_warnings(target, stored))
        unreachable.update(_newly_unreachable(target.config, others, stored))
        refused.extend(await _refused_store(target, store, args.check_env))
        tenant = f" (tenant {args.tenant})" if args.tenant is not None else ""
        return f"route {args.id!r} added{tenant}: {' -> '.join(plan)}"

    refused: list[str] = []
    console.print(_with_store(args, console, work, creates=True))
    for warning in warnings:
        console.warning(f"route {args.id!r}: {warning}")
    for route_id, why in unreachable.items():
        console.warning(f"route {route_id!r}: {why}")
    for warning in refused:
        console.warning(warning)


def routes_set_fallback(args: argparse.Namespace, console: Console) -> None:
    warnings: list[str] = []

    async def work(target: StoreTarget, store: RouteStore) -> str:
        _store_owned(target, args.id)
        done = await _edit(args.id, lambda: attempt(target, store))
        refused.extend(await _refused_store(target, store, args.check_env))
        return done

    async def attempt(target: StoreTarget, store: RouteStore) -> str:
        current = _stored(await store.load_routes(), args.id)
        where = f"route {args.id!r}"
        primary = current.route.plan[0]
        upstreams: dict[str, UpstreamConfig] = {}
        if primary in current.upstreams:
            upstreams[primary] = current.upstreams[primary]
        upstreams[fallback_name(args.id)] = make_upstream(
            args.upstream, args.auth_header, args.auth_env, f"{where}, --upstream"
        )
        fields = {**current.route.model_dump(), "plan": [primary, fallback_name(args.id)]}
        write = _unless_changed(store, current)
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
        await _check_and_write(target, store, stored, write, args.check_env)
        warnings.extend(_stored_route_warnings(target, stored))
        return (
            f"route {args.id!r}: fallback set ({primary} -> {fallback_name(args.id)}), "
            f"retries {stored.route.retries}"
        )

    refused: list[str] = []
    console.print(_with_store(args, console, work))
    for warning in warnings:
        console.warning(f"route {args.id!r}: {warning}")
    for warning in refused:
        console.warning(warning)


def routes_set(args: argparse.Namespace, console: Console) -> None:
    warnings: list[str] = []

    async def work(target: StoreTarget, store: RouteStore) -> str:
        _store_owned(target, args.id)
        done = await _edit(args.id, lambda: attempt(target, store))
        refused.extend(await _refused_store(target, store, args.check_env))
        return done

    async def attempt(target: StoreTarget, store: RouteStore) -> str:
        current = _stored(await store.load_routes(), args.id)
        fields = {**current.route.model_dump(), "retries": args.retries}
        route = build_model(RouteConfig, fields, f"route {args.id!r}")
        stored = StoredRoute(route=route, upstreams=dict(current.upstreams))
        write = _unless_changed(store, current)
        await _check_and_write(target, store, stored, write, check_env=False)
        warnings.extend(_stored_route_warnings(target, stored))
        return (
            f"route {args.id!r}: retries {route.retries} (attempt ceiling {route.attempt_ceiling})"
        )

    refused: list[str] = []
    console.print(_with_store(args, console, work))
    for warning in warnings:
        console.warning(f"route {args.id!r}: {warning}")
    for warning in refused:
        console.warning(warning)


def routes_clear_fallback(args: argparse.Namespace, console: Console) -> None:
    async def work(target: StoreTarget, store: RouteStore) -> str:
        _store_owned(target, args.id)
        done = await _edit(args.id, lambda: attempt(target, store))
        refused.extend(await _refused_store(target, store, args.check_env))
        return done

    async def attempt(target: StoreTarget, store: RouteStore) -> str:
        current = _stored(await store.load_routes(), args.id)
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
                raise _ChangedMeanwhile
            cleared.append(count)

        await _check_and_write(target, store, stored, write, check_env=False)
        faults = f"; {cleared[0]} fault(s) on {', '.join(dropped)} cleared" if cleared[0] else ""
        return f"route {args.id!r}: fallback cleared ({primary} only){faults}"

    refused: list[str] = []
    console.print(_with_store(args, console, work))
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
        refusal = None if unreadable else await _store_refusal(target, store, args.check_env)
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
        return f"no routes for tenant {args.tenant}" if args.tenant is not None else "no routes"

    console.print(_with_store(args, console, work))
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
            refused.extend(await _refused_store(target, store, args.check_env))
            faults = f"; {cleared} fault(s) on it cleared" if cleared else ""
            return f"route {args.id!r} removed{faults}"
        _store_owned(target, args.id)
        raise Failed(f"no route {args.id!r} in the store")

    refused: list[str] = []
    console.print(_with_store(args, console, work))
    for warning in refused:
        console.warning(warning)


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
