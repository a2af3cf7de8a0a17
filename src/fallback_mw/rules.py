"""The load and store refusals of SPEC §3, each in one function.

The config loader (config.py) and the route store (store/routes.py, the admin CLI) call
these and nothing else, so a rule cannot drift between them. The functions take the
models' shapes (read-only protocols), not the models, so this module imports no config.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from fallback_mw.endpoints import same_endpoint
from fallback_mw.quoting import shortened
from fallback_mw.security.addresses import UnsafeUpstream, check_upstream_host, is_legacy_ipv4
from fallback_mw.security.fields import (
    CREDENTIAL_HEADERS,
    FORWARDING_HEADERS,
    GATEWAY_HEADER_PREFIX,
    HOP_BY_HOP_HEADERS,
    RECOMPUTED_HEADERS,
    canonical_name,
)
from fallback_mw.security.values import header_value_problem

# POSIX portable environment variable names; a long name is a mistake, not a variable.
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# Route and upstream ids go into response headers, spans, logs and terminal output.
MAX_ID_LENGTH = 128  # route and upstream ids
_ID = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_ID_LENGTH}}}")


class ConfigError(ValueError):
    """A configuration the gateway refuses to start with (or the store refuses to keep).
    The message names the route, key or variable and never contains a secret value."""


# Its public name, as tracebacks under a host server print it (re-exported there).
ConfigError.__module__ = "fallback_mw.config"


class UpstreamShape(Protocol):
    @property
    def url(self) -> str: ...

    @property
    def host(self) -> str: ...

    @property
    def proxy_host(self) -> str | None: ...

    @property
    def credential_envs(self) -> tuple[str, ...]: ...


class RouteShape(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def plan(self) -> tuple[str, ...]: ...

    @property
    def retries(self) -> int: ...

    @property
    def hedge_after_ms(self) -> int: ...

    @property
    def shadow(self) -> str | None: ...


# Credentials that are also well-formed variable names (Stripe, GitHub, Hugging Face, npm):
# written in `auth_env` by mistake, "environment variable <credential> is not set" would
# print the credential on terminals, CI logs, the gateway's log and its 503 config_error.
_TOKEN_PREFIXES = (
    *("sk_live_", "sk_test_", "rk_live_", "rk_test_", "whsec_"),
    *("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "hf_", "npm_"),
)


def shown_variable(name: str) -> str:
    """A credential variable's name as messages and listings show it: as written, unless
    it is shaped like a credential (a known token prefix, or 20+ characters mixing upper-
    and lower-case letters and digits), which is cut to its first four characters."""
    shaped = len(name) >= 20 and (
        name.startswith(_TOKEN_PREFIXES)
        or (
            any(c.islower() for c in name)
            and any(c.isupper() for c in name)
            and sum(c.isdigit() for c in name) >= 2
        )
    )
    if not shaped:
        return name
    return (
        f"{name[:4]}... (a {len(name)}-character name shaped like a credential, not shown: "
        "auth_env names the variable that holds the credential, never the credential itself)"
    )


def check_variable_name(where: str, name: str) -> None:
    """A credential variable name must be a well-formed environment variable name."""
    if not isinstance(name, str) or _VARIABLE_NAME.fullmatch(name) is None:
        # The value is not echoed: the usual malformed "name" is the credential itself
        # (`auth_env = "sk-..."`), and this line reaches terminals, CI logs and the log.
        text = name if isinstance(name, str) else ""
        if isinstance(name, str) and not name.strip():
            # `--auth-env "$NAME"` with NAME unset in the shell: the usual empty one.
            raise ConfigError(
                f"{where} is empty: give the name of the environment variable that holds "
                "the credential, or leave it out for an upstream that takes none"
            )
        bare = text.removeprefix("$").removeprefix("{").removesuffix("}")
        hint = (
            f"; write {shown_variable(bare)} without the '$'"
            if text.startswith("$") and _VARIABLE_NAME.fullmatch(bare)
            else "; it names the variable that holds the credential, never the credential "
            "itself (the value is not shown)"
        )
        raise ConfigError(
            f"{where} is not a valid environment variable name "
            f"(letters, digits and _, not starting with a digit, at most 128){hint}"
        )


def check_id(kind: str, value: str) -> None:
    """A route or upstream id: letters, digits and `-_.:` only, at most 128 (SPEC §12).
    It travels in `x-gateway-route` / `x-gateway-provider`, spans and terminal output, so
    a control character or a line break in it must never get that far."""
    if not isinstance(value, str) or _ID.fullmatch(value) is None:
        shown = shortened(value) if isinstance(value, str) else value
        text = value if isinstance(value, str) else ""  # `café`: which character is wrong
        wrong = next((f" (not {c!r})" for c in text if _ID.fullmatch(c) is None), "")
        raise ConfigError(
            f"{kind} id {shown!r} is not allowed: use ASCII letters, digits and - _ . : "
            f"only{wrong}, at most 128"
        )


def check_host_spelling(where: str, host: str) -> None:
    """Legacy IPv4 spellings are refused like any other ambiguous host (SPEC §12)."""
    if is_legacy_ipv4(host):
        raise ConfigError(
            f"{where}: host {host!r} spells an IPv4 address in a legacy form (octal, hex, "
            "integer, short, or with a trailing dot); write it as four decimal numbers"
        )


def check_identity_headers(tenant: str, session: str, *, stripped: Iterable[str]) -> None:
    """`tenant_header` / `session_header` may not name a header the gateway strips: a
    credential (SPEC §4's, an upstream's own `auth_header`, `strip_headers`), a hop-by-hop
    or recomputed field, or `x-gateway-*`. Its value would land in spans, logs and the
    request table."""
    refused = CREDENTIAL_HEADERS | HOP_BY_HOP_HEADERS | RECOMPUTED_HEADERS
    refused |= {canonical_name(name.encode("latin-1", "replace")) for name in stripped}
    for key, name in (("tenant_header", tenant), ("session_header", session)):
        canonical = canonical_name(name.encode("latin-1", "replace"))
        if canonical in _FORWARDING and canonical in refused:
            # Not a credential: a default of strip_headers since the gateway stopped
            # forwarding what a caller says of its own address (a session by client IP
            # that a proxy in front sets loaded before, and was refused as "a credential").
            raise ConfigError(
                f"[gateway] {key} = {name!r} names a forwarding header, which strip_headers "
                "removes before any upstream by default (a caller can forge it): to read it "
                f"as the {key[:-7]}, set by a proxy in front that replaces the caller's, list "
                "strip_headers without it (a list replaces the defaults: keep the others; it "
                "is then forwarded), or choose another header"
            )
        if canonical in refused or canonical.startswith(GATEWAY_HEADER_PREFIX):
            raise ConfigError(
                f"[gateway] {key} = {name!r} names a header the gateway strips (a credential"
                " or a connection field): its value would be recorded; choose another header"
            )


_FORWARDING = frozenset(name.encode() for name in FORWARDING_HEADERS)


def check_upstream(name: str, upstream: UpstreamShape, allow_hosts: Sequence[str]) -> None:
    """One upstream: a safe id, a plainly spelled host that passes the allowlist and the
    metadata-address guard, the same of its egress proxy's host, and well-formed credential
    variable names. The config file's upstreams and the route store's both come here."""
    check_id("upstream", name)
    try:
        check_upstream_host(upstream.host, allow_hosts)
    except UnsafeUpstream as exc:
        raise ConfigError(f"upstream {name!r}: {exc}") from None
    check_host_spelling(f"upstream {name!r}", upstream.host)
    if upstream.proxy_host is not None:
        # The proxy is a host the gateway connects to (and sends the credential to).
        check_proxy_host(name, upstream.proxy_host, allow_hosts)
    for variable in upstream.credential_envs:
        check_variable_name(f"upstream {name!r}: auth_env", variable)
    repeated = [
        v for i, v in enumerate(upstream.credential_envs) if v in upstream.credential_envs[:i]
    ]
    if repeated:
        # One key twice in a pool: a 401/403/429 "moves on" to the same key (SPEC §6).
        raise ConfigError(
            f"upstream {name!r}: auth_env names {shown_variable(repeated[0])} more than once: "
            "each credential of a pool is its own variable (a request uses each at most once)"
        )


def check_proxy_host(name: str, host: str, allow_hosts: Sequence[str]) -> None:
    """An upstream's egress proxy: the allowlist and the metadata guard apply to it too."""
    try:
        check_upstream_host(host, allow_hosts)
    except UnsafeUpstream as exc:
        raise ConfigError(f"upstream {name!r}: proxy {exc}") from None
    check_host_spelling(f"upstream {name!r}: proxy", host)


def known_names(name: str, known: Iterable[str]) -> str:
    """What to write instead of an unknown name: the close one, else the defined ones."""
    names = sorted(known)
    close = difflib.get_close_matches(name, names, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    if not names:
        return " (no upstream is defined: add an [upstreams.NAME] table)"
    shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
    return f" (defined: {shown})"


def check_route(
    route: RouteShape, upstreams: Mapping[str, UpstreamShape], *, where: str | None = None
) -> None:
    """One route's plan: no repeated candidate, every name a known upstream, no fallback at
    the primary's endpoint, every fallback reachable within `retries`, and a hedge that
    cannot spend a fallback's attempt."""
    check_id("route", route.id)
    label = where or f"route {route.id!r}"
    seen: set[str] = set()
    for name in route.plan:
        if name in seen:
            if name == route.plan[0]:
                raise ConfigError(f"{label}: candidate {shortened(name)!r} repeats the primary")
            raise ConfigError(f"{label}: candidate {shortened(name)!r} appears twice in the plan")
        seen.add(name)
        if name not in upstreams:
            known = known_names(name, upstreams)
            raise ConfigError(f"{label}: unknown upstream {shortened(name)!r}{known}")
    primary_url = upstreams[route.plan[0]].url
    for name in route.plan[1:]:
        if same_endpoint(upstreams[name].url, primary_url):
            raise ConfigError(
                f"{label}: fallback {name!r} is the primary's own endpoint ({primary_url}); "
                "use a credential pool for several keys of one upstream"
            )
    if route.shadow is not None:
        if route.shadow not in upstreams:
            raise ConfigError(
                f"{label}: unknown shadow upstream {shortened(route.shadow)!r}"
                f"{known_names(route.shadow, upstreams)}"
            )
        if route.shadow == route.plan[0] or same_endpoint(upstreams[route.shadow].url, primary_url):
            raise ConfigError(
                f"{label}: shadow {route.shadow!r} is the primary: its copies would double "
                "the primary's own load"
            )
    fallbacks = len(route.plan) - 1
    if fallbacks > route.retries:
        raise ConfigError(
            f"{label}: plan has {fallbacks} fallback(s) but retries = {route.retries}; "
            f"a fallback could never be reached (set retries >= {fallbacks})"
        )
    if route.hedge_after_ms > 0 and route.retries < len(route.plan):
        # A hedge spends an attempt; it must never cost a fallback its turn.
        raise ConfigError(
            f"{label}: hedge_after_ms needs retries >= {len(route.plan)} (one attempt for "
            f"the hedge and one for each fallback); retries = {route.retries}"
        )


def check_variables_set(where: str, variables: Iterable[str], environ: Mapping[str, str]) -> None:
    """Every credential variable is set, not empty, and usable as a header value (no
    trailing newline, CR/LF/NUL, control or non-latin-1 characters). Only the name is ever
    printed. Raises one ConfigError naming every problem."""
    problems = variable_problems(where, variables, environ)
    if problems:
        raise ConfigError("; ".join(problems))


def variable_problems(
    where: str, variables: Iterable[str], environ: Mapping[str, str]
) -> list[str]:
    """What `check_variables_set` refuses (names only): the variables of `where` that are
    not set in one phrase, those set but empty in another (a pool of 50 keys said "is not
    set" 50 times, under its upstream's name each time), one phrase per unusable value."""
    unset: list[str] = []
    empty: list[str] = []
    problems = []
    for variable in variables:
        value = environ.get(variable)
        if value is None:
            unset.append(shown_variable(variable))
            continue
        if not value:
            # `export KEY=` (or an empty line in an env file): set, so "not set" would send
            # the reader to check a variable that `env` shows them is there.
            empty.append(shown_variable(variable))
            continue
        problem = header_value_problem(value)
        if problem is not None:
            # The usual cause of a line break or an edge space, not of other characters.
            edge = value != value.strip()
            hint = " (a trailing newline from a secrets file?)" if edge else ""
            problems.append(
                f"{where}: environment variable {shown_variable(variable)} cannot be sent as a "
                f"header value: it {problem}{hint}"
            )
    grouped = [
        _variables_phrase(where, names, state)
        for names, state in ((unset, "not set"), (empty, "set but empty"))
        if names
    ]
    return [*grouped, *problems]


def _variables_phrase(where: str, names: list[str], state: str) -> str:
    if len(names) == 1:
        return f"{where}: environment variable {names[0]} is {state}"
    return f"{where}: environment variables {', '.join(names)} are {state}"


def check_fallback_credentials(
    where: str, fallback: str | None, auth_header: str | None, auth_env: str | None
) -> None:
    """The CLI's own refusal: fallback credentials without a fallback upstream."""
    if fallback is None and (auth_header is not None or auth_env is not None):
        raise ConfigError(
            f"{where}: --fallback-auth-header/--fallback-auth-env given without --fallback "
            "(credentials for a fallback upstream that does not exist)"
        )
