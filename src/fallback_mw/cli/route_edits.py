"""How a `routes` verb's edit reaches the store: checked against the merged view the gateways
will build (rules.py, through `merge_routes`), written only when the store's routes did
not change meanwhile (tried again a few times), refused with the loader's words and
nothing stored. cli/routes.py has the verbs."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fallback_mw import rules
from fallback_mw.cli.app import Console, Failed, Refused, run
from fallback_mw.cli.config_warnings import route_warnings, unreachable_routes
from fallback_mw.cli.target import StoreTarget, open_route_store, resolve
from fallback_mw.config import ConfigError, GatewayConfig
from fallback_mw.store.model import StoredRoute
from fallback_mw.store.reload import merged_routes
from fallback_mw.store.routes import RouteStore, merge_routes

T = TypeVar("T")


def with_store(
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


async def check_and_write(
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


def newly_unreachable(
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


def stored_route_warnings(target: StoreTarget, stored: StoredRoute) -> list[str]:
    """What `check` would warn about the route just stored (a prefix without its '/', a
    primary whose first-byte timeout the deadline cuts, ...): valid, so stored, but said
    by the verb that stored it rather than left for the next `check`."""
    upstreams = {**target.config.upstreams, **stored.upstreams}
    deadline_ms = target.config.gateway.deadline_ms
    return route_warnings(stored.route, upstreams, deadline_ms, store=True)


async def store_refusal(target: StoreTarget, store: RouteStore, check_env: bool) -> str | None:
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


async def refused_store(target: StoreTarget, store: RouteStore, check_env: bool) -> list[str]:
    """After a change is stored: the warning that the gateways will not apply it, when they
    refuse the store as a whole. The change itself is stored (exit status 0)."""
    refusal = await store_refusal(target, store, check_env)
    if refusal is None:
        return []
    return [
        f"the gateways will not apply this change: they refuse the store as it now is "
        f"({refusal}) and keep their running routes until that route is fixed or removed"
    ]


def stored_route(routes: list[StoredRoute], route_id: str) -> StoredRoute:
    for stored in routes:
        if stored.route.id == route_id:
            return stored
    raise Failed(f"no route {route_id!r} in the store")


class ChangedMeanwhile(Exception):
    """Another command changed or removed the route between this one's read and its write."""


_EDIT_ATTEMPTS = 5


def unless_changed(
    store: RouteStore, current: StoredRoute
) -> Callable[[StoredRoute], Awaitable[None]]:
    """Write an edit of `current` only while the store still holds `current`: of two
    operators editing one route at once, the second re-reads and applies its change to
    the first one's result (or finds the route gone), never overwriting it unseen."""

    async def write(stored: StoredRoute) -> None:
        if not await store.replace_route(stored, expected=current.doc):
            raise ChangedMeanwhile

    return write


async def edit_stored(route_id: str, attempt: Callable[[], Awaitable[T]]) -> T:
    """Run a read-check-write `attempt` again while another command's edit of the route
    lands between its read and its write."""
    for _ in range(_EDIT_ATTEMPTS):
        try:
            return await attempt()
        except ChangedMeanwhile:
            continue
    raise Failed(
        f"route {route_id!r} kept changing while this command ran (another command is "
        "editing it); nothing was stored: run it again"
    )


def store_owned(target: StoreTarget, route_id: str) -> None:
    if any(r.id == route_id for r in target.config.routes):
        raise Refused(f"route {route_id!r} is defined in the config file; edit the file instead")
