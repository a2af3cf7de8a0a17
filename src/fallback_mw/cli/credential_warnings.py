"""What is valid but probably not meant in a configuration's credentials, on the upstreams
some route reaches: a key that already carries its scheme, a header of its own with the
default Bearer scheme, a provider without a key, a key sent over plain http:// to a public
address. Names only, never a value; nothing is rewritten (cli/config_warnings.py says
them with the rest)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fallback_mw.config import RouteConfig, UpstreamConfig
from fallback_mw.rules import shown_variable
from fallback_mw.security.addresses import Allowlist, parse_ip


def reached_upstreams(routes: Sequence[RouteConfig]) -> list[str]:
    """The upstreams some route sends requests to (a plan or a shadow), in route order."""
    names = [name for route in routes for name in (*route.plan, route.shadow) if name]
    return list(dict.fromkeys(names))


def credential_warnings(
    upstreams: Mapping[str, UpstreamConfig],
    routes: Sequence[RouteConfig],
    environ: Mapping[str, str],
) -> list[str]:
    """Credentials that are valid but answered 401 by the provider, on the upstreams some
    route reaches: a variable whose value already starts with the upstream's auth_scheme
    (sent as "Bearer Bearer sk-..."), a header of its own with the default Bearer scheme
    (Anthropic's x-api-key takes the key raw), and a declared provider without auth_env
    (the caller's own key is stripped, SPEC §4, and none is injected). Names only, never a
    value; nothing is rewritten: the credential is sent as configured."""
    warnings = []
    for name in reached_upstreams(routes):
        upstream = upstreams[name]
        scheme = upstream.auth_scheme
        for variable in upstream.credential_envs if scheme else ():
            value = environ.get(variable, "").lstrip()
            head, rest = value[: len(scheme)], value[len(scheme) :]
            if head.lower() == scheme.lower() and rest[:1].isspace() and rest.strip():
                shown = shown_variable(variable)
                warnings.append(
                    f"upstream {name!r}: ${shown} already starts with its auth_scheme "
                    f"{scheme!r}, so {upstream.auth_header} is sent as '{scheme} {scheme} ...' "
                    f"and the provider answers 401; set ${shown} to the key alone, or "
                    f'auth_scheme = "" to send it as written'
                )
        header = upstream.auth_header
        if (
            upstream.credential_envs
            and scheme == "Bearer"
            and header != "authorization"
            and "auth_scheme" not in upstream.model_fields_set
        ):
            # SPEC §3's default scheme is Bearer whatever the header; the providers that
            # take a key in a header of their own read it raw (no rewrite: said here).
            warnings.append(
                f"upstream {name!r}: auth_header = {header!r} with the default auth_scheme "
                f"'Bearer' sends '{header}: Bearer <key>'; the providers that read a key in "
                "a header of their own (Anthropic's x-api-key, Azure OpenAI's api-key, "
                "Gemini's x-goog-api-key) take it raw and answer 401: set "
                'auth_scheme = "" to send the key alone, or auth_scheme = "Bearer" to keep '
                "the prefix"
            )
        if upstream.provider is not None and not upstream.credential_envs:
            warnings.append(
                f"upstream {name!r} is provider {upstream.provider} but has no auth_env: the "
                "caller's own credential is stripped before any upstream and none is "
                "injected, so a provider that needs a key answers every request 401; set "
                "auth_env to the variable holding its key"
            )
    return warnings


def cleartext_credential_warnings(
    upstreams: Mapping[str, UpstreamConfig],
    routes: Sequence[RouteConfig],
    allow_hosts: Sequence[str],
) -> list[str]:
    """An upstream some route reaches that is sent its credential over plain http:// at a
    public address: an IP literal that is global, or a name the allowlist admits by name
    (a listed name admits public addresses only, `security.Allowlist`; `localhost` aside).
    `http://api.openai.com` for `https://` sent the key in clear across the internet
    before the provider's redirect came back. Names only, never a value."""
    allow = Allowlist(allow_hosts)
    warnings = []
    for name in reached_upstreams(routes):
        upstream = upstreams[name]
        if not upstream.credential_envs or not upstream.url.startswith("http://"):
            continue
        host = upstream.host
        literal = parse_ip(host)
        public = (
            literal.is_global
            if literal is not None
            else allow.allows_name(host) and host.rstrip(".").lower() != "localhost"
        )
        if public:
            variables = ", ".join(f"${shown_variable(v)}" for v in upstream.credential_envs)
            warnings.append(
                f"upstream {name!r} is sent its credential ({variables}) over plain http:// "
                f"at {host}, a public address: anyone on the path reads the key; use "
                "https://"
            )
    return warnings
