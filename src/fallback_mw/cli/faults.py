"""`fallback-mw faults set|clear|list`: game-day faults kept in the store with an expiry
(SPEC §8, §10). `set` prints the expiry it stored, so a script can wait from it."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import Any

from fallback_mw import rules
from fallback_mw.cli.app import Console, Refused, run
from fallback_mw.cli.show import one_line
from fallback_mw.cli.target import StoreTarget, open_route_store, resolve
from fallback_mw.store.model import MAX_FAULT_TTL, Fault
from fallback_mw.store.routes import RouteStore

MAX_TTL_SECONDS = MAX_FAULT_TTL  # a row expiring further ahead no gateway applies


def expiry_text(expires_at: float) -> str:
    """`2026-11-30T18:00:00.250Z (expires_at=1796061600.250)`: ISO time and epoch seconds.
    A stored expiry past the calendar's end (a row written by hand to last "for ever":
    1e12, 1e300, inf) is `after 9999-12-31`, never an internal error."""
    try:
        moment = datetime.fromtimestamp(expires_at, UTC)
    except (ValueError, OverflowError, OSError):
        return f"after 9999-12-31 (expires_at={expires_at:.6g})"
    iso = moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
    return f"{iso} (expires_at={expires_at:.3f})"


async def _names(target: StoreTarget, store: RouteStore) -> tuple[dict[str, Any], set[str]]:
    routes: dict[str, Any] = {r.id: r.plan for r in target.config.routes}
    upstreams = set(target.config.upstreams)
    # The names of the routes that load: a store record that does not (which makes the
    # gateways refuse their route reloads) must not stop a fault, which they still apply.
    for stored in await store.load_routes(unreadable=[]):
        routes[stored.route.id] = stored.route.plan
        upstreams.update(stored.upstreams)
    return routes, upstreams


def _fault(
    args: argparse.Namespace, routes: dict[str, Any], upstreams: set[str], store_now: float
) -> Fault:
    """The fault the arguments describe, checked against the names the CLI can see (with
    --store alone a file's routes and upstreams are invisible: an unknown name is stored with
    a warning, `_unchecked`)."""
    # The expiry is computed once, here, on the store's clock (not this shell's, which may
    # be off from the gateways'), and is what is stored and printed.
    expires_at = round(store_now + args.ttl, 3)
    if args.kind == "pin":
        if args.route is None or args.candidate is None:
            raise Refused("faults set pin needs --route ID and --candidate NAME")
        if args.upstream is not None:
            raise Refused("faults set pin takes --route and --candidate, not --upstream")
        # A name no route or upstream can have (SPEC §12) would never match anything.
        rules.check_id("route", args.route)
        rules.check_id("upstream", args.candidate)
        plan = routes.get(args.route)
        if plan is None and args.config is not None:
            raise Refused(f"unknown route {args.route!r}")
        if plan is not None and args.candidate not in plan:
            raise Refused(
                f"route {args.route!r}: {args.candidate!r} is not one of its candidates "
                f"({', '.join(plan)})"
            )
        return Fault("pin", args.route, expires_at, candidate=args.candidate)
    if args.upstream is None:
        raise Refused(f"faults set {args.kind} needs --upstream NAME")
    if args.route is not None or args.candidate is not None:
        raise Refused(f"faults set {args.kind} takes --upstream only")
    rules.check_id("upstream", args.upstream)
    if args.upstream not in upstreams and args.config is not None:
        raise Refused(f"unknown upstream {args.upstream!r}")
    return Fault(args.kind, args.upstream, expires_at)


def _unchecked(fault: Fault, routes: dict[str, Any], upstreams: set[str]) -> str | None:
    """With --store alone, a name the store does not know may be a file's (invisible here)
    or a typo that faults nothing: stored, with a warning naming what the store knows."""
    if fault.scope == "route":
        if fault.target in routes:
            return None
        what, known = f"route {fault.target!r} is not a store route", sorted(routes)
    else:
        if fault.target in upstreams:
            return None
        what, known = f"upstream {fault.target!r} is not in the store", sorted(upstreams)
    return (
        f"{what} (it has: {', '.join(known) or 'none'}); a config file's names cannot be "
        "checked with --store alone: pass --config FILE to check it"
    )


def faults_set(args: argparse.Namespace, console: Console) -> None:
    if not 0 < args.ttl <= MAX_TTL_SECONDS:
        raise Refused(f"--ttl must be between 1 and {MAX_TTL_SECONDS} seconds")
    target = resolve(args, console, creates=True)

    async def work() -> tuple[Fault, Fault | None, str | None]:
        store = open_route_store(target)
        try:
            routes, upstreams = await _names(target, store)
            fault = _fault(args, routes, upstreams, await store.clock())
            warning = None if target.from_file else _unchecked(fault, routes, upstreams)
            return fault, await store.set_fault(fault, replace=args.replace), warning
        finally:
            await store.aclose()

    fault, active, warning = run(work)
    if active is not None:
        raise Refused(
            f"a {active.kind} fault is already active on {_target(active)} until "
            f"{expiry_text(active.expires_at)}; nothing set (--replace to replace it, or "
            "`fallback-mw faults clear` first)"
        )
    what = (
        f"pin route {fault.target!r} to {fault.candidate!r}"
        if fault.kind == "pin"
        else f"{fault.kind} upstream {fault.target!r}"
    )
    console.print(f"fault set: {what} until {expiry_text(fault.expires_at)}")
    if warning is not None:
        console.warning(warning)


def _target(fault: Fault) -> str:
    return f"route {fault.target!r}" if fault.scope == "route" else f"upstream {fault.target!r}"


def _unknown_selector(
    args: argparse.Namespace, routes: dict[str, Any], upstreams: set[str], active: list[Fault]
) -> str | None:
    """Why `faults clear`'s selector names nothing the CLI knows (None: it does). Known: the
    config file's and the store's route ids / upstream names, and the targets of the faults
    in the store. With --store alone a file's names are invisible: an unknown name is
    refused only while other faults are active (a typo during a game day, when the fault
    meant to end goes on failing requests); with nothing active a cleanup may run twice."""
    scope, name = ("route", args.route) if args.route is not None else ("upstream", args.upstream)
    known = set(routes) if scope == "route" else set(upstreams)
    known.update(fault.target for fault in active if fault.scope == scope)
    if name in known or (args.config is None and not active):
        return None
    shown = sorted(known)
    listed = ", ".join(one_line(n) for n in shown[:20]) or "none"
    if len(shown) > 20:
        listed += f" and {len(shown) - 20} more"
    if args.config is None:
        listed += "; with --store alone a config file's names are not seen"
    return f"unknown {scope} {one_line(name)!r} (known {scope}s: {listed}); nothing cleared"


def faults_clear(args: argparse.Namespace, console: Console) -> None:
    target = resolve(args, console, creates=False)

    async def work() -> tuple[int, list[Fault]]:
        store = open_route_store(target)
        try:
            if args.all:
                return await store.clear_faults(), []
            # Cleared first: a row the store still holds (a fault that expired a moment ago,
            # one no gateway applies) names no typo, whatever `faults list` shows.
            if args.upstream is not None:
                cleared = await store.clear_faults(upstream=args.upstream)
            else:
                cleared = await store.clear_faults(route=args.route)
            if cleared:
                return cleared, []
            active = await store.load_faults()
            routes, upstreams = await _names(target, store)
            unknown = _unknown_selector(args, routes, upstreams, active)
            if unknown is not None:
                raise Refused(unknown)  # nothing was there to clear
            return 0, active
        finally:
            await store.aclose()

    cleared, still_active = run(work)
    console.print(f"{cleared} fault(s) cleared")
    if still_active:
        # A known name that holds no fault while others are active: the fault meant to end
        # may be another's, and is still injecting. (Nothing active at all: nothing to say.)
        selector = (
            f"route {args.route!r}" if args.route is not None else f"upstream {args.upstream!r}"
        )
        active = "; ".join(
            f"{one_line(fault.kind)} {_target(fault)} until {expiry_text(fault.expires_at)}"
            for fault in still_active
        )
        console.warning(f"no active fault on {selector}; still active: {active}")


def faults_list(args: argparse.Namespace, console: Console) -> None:
    target = resolve(args, console, creates=False)

    unreadable: list[str] = []

    async def work() -> list[Fault]:
        store = open_route_store(target)
        try:
            return await store.load_faults(unreadable)
        finally:
            await store.aclose()

    faults = run(work)
    if not faults:
        console.print("no faults")
    for fault in faults:
        # Stored text, checked when `faults set` wrote it but not when a row was written by
        # hand: one printable line per fault, never a terminal's escape sequence.
        name = one_line(fault.target)
        where = f"route={name}" if fault.scope == "route" else f"upstream={name}"
        extra = f"\tcandidate={one_line(fault.candidate)}" if fault.candidate else ""
        kind = one_line(fault.kind)
        console.print(f"{kind}\t{where}{extra}\tuntil {expiry_text(fault.expires_at)}")
    if unreadable:
        console.warning(
            f"{len(unreadable)} fault row(s) in the store are no fault `faults set` writes "
            f"(written by hand?): {', '.join(unreadable)}; no gateway applies them, and "
            "`fallback-mw faults clear --all` removes them"
        )
