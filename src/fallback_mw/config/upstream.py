"""`[upstreams.NAME]`: one upstream's URL, credential, timeouts, capacity and connection
settings, and the host and header names it may use."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    Field,
    field_validator,
)

from fallback_mw.config.strict import (
    MAX_TIMER_MS,
    XN_HINT,
    Strict,
    header_name,
    valid_host,
    xn_form,
)
from fallback_mw.rules import ConfigError as ConfigError  # re-exported: its public home
from fallback_mw.security.fields import (
    GATEWAY_HEADER_PREFIX,
    HOP_BY_HOP_HEADERS,
    RECOMPUTED_HEADERS,
)
from fallback_mw.security.values import header_value_problem

# What an upstream URL's path may not hold as written: a `%` that starts no escape, and
# the characters httpx percent-encodes before sending where aiohttp sends them as written
# (outside RFC 3986's path characters, as `|`, `^`, `[`, `]` and `\` are too, but those
# both engines send alike).
_NOT_IN_PATH = re.compile(r'%(?![0-9A-Fa-f]{2})|["<>`{}]')


# `http://[::1%25lo]:8000` loaded, and every attempt failed as "could not connect" on both
# engines. A zone names the interface of a link-local address, which is refused anyway.
_ZONE_ID = (
    "has an IPv6 zone id ('%' in the host), which neither upstream engine connects "
    "through: give the address alone (a link-local fe80:: address is refused anyway)"
)


class UpstreamConfig(Strict):
    url: str
    auth_header: str = "authorization"
    auth_scheme: str = "Bearer"
    auth_env: str | tuple[str, ...] | None = None
    model: str | None = None
    # 3 s: survives one dropped SYN (Linux retransmits the first after 1 s), SPEC §12.
    connect_timeout_ms: int = Field(default=3000, ge=1, le=MAX_TIMER_MS)
    # Requests (so connections) in flight to this upstream from one process, SPEC §12.
    max_connections: int = Field(default=100, ge=1, le=100_000)
    first_byte_timeout_ms: int = Field(default=30_000, ge=1, le=MAX_TIMER_MS)
    idle_timeout_ms: int = Field(default=60_000, ge=1, le=MAX_TIMER_MS)
    rpm: int | None = Field(default=None, ge=1, le=10**9)  # declared capacity: requests per minute
    tpm: int | None = Field(default=None, ge=1, le=10**15)  # declared capacity: tokens per minute
    # A credential pool (auth_env as a list), SPEC §12: how a credential is chosen, and how
    # long a credential whose 429 says its quota is spent is retired when it says not until
    # when.
    selection: Literal["round_robin", "score"] = "round_robin"
    quota_retire_ms: int = Field(default=3_600_000, ge=1, le=31 * 86_400_000)
    ca_file: str | None = None  # PEM bundle trusted for this https:// upstream
    proxy: str | None = None  # egress HTTP proxy, http://host:port
    provider: str | None = None  # GenAI provider name (gen_ai.provider.name), e.g. "openai"

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.isascii() or any(c.isspace() or ord(c) < 0x20 or c == "\x7f" for c in value):
            host = urlsplit(value).hostname or ""
            raise ValueError(
                "must be plain ASCII without spaces or control characters "
                f"({xn_form(host) if not host.isascii() else XN_HINT})"
            )
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if not valid_host(parts.hostname):
            raise ValueError("has a malformed host (a DNS name or an IP address)")
        if "%" in parts.hostname:
            raise ValueError(_ZONE_ID)
        try:
            port = parts.port  # raises for a port that is not 0..65535
        except ValueError:
            raise ValueError("has a malformed port") from None
        if port == 0:  # no server listens there: every attempt would fail as a transport error
            raise ValueError("has port 0 (no server listens on it)")
        # An empty userinfo (`http://@host`, `http://:@host`), query (`/?`) or fragment
        # (`/#`) counts too: the caller's path is appended to this URL, so a trailing `?`
        # or `#` turned it into the query or dropped it, and aiohttp fails every request
        # to `http://:@host` (an empty Basic credential beside the injected one).
        if "@" in parts.netloc:
            raise ValueError("must not carry credentials (use auth_env)")
        if "?" in value or "#" in value:
            raise ValueError("must not carry a query string or fragment")
        # httpx resolves `.` / `..` segments before sending, aiohttp sends them as written:
        # one URL would reach two paths depending on the engine.
        segments = parts.path.lower().replace("%2e", ".").split("/")
        if "." in segments or ".." in segments:
            raise ValueError("has a '.' or '..' segment in its path; write the path it means")
        # httpx percent-encodes `"`, `<`, `>`, `` ` ``, `{`, `}` before sending, aiohttp sends
        # them as written (`/v1/{deployment}` reached two paths depending on the engine), and
        # neither mends a `%` that starts no escape.
        stray = _NOT_IN_PATH.search(parts.path)
        if stray is not None:
            char = stray.group()
            if char == "%":
                raise ValueError(
                    "has a '%' in its path that starts no percent-escape (two hex digits): "
                    "write a literal '%' as %25"
                )
            raise ValueError(
                f"has {char!r} in its path, which a request target cannot carry as written: "
                f"percent-encode it (%{ord(char):02X}), or replace a template placeholder"
            )
        # The scheme in lower case (`HTTPS://` is https): the engines choose TLS and its
        # trust (`ca_file`) by it.
        return parts.scheme + value[len(parts.scheme) :].rstrip("/")

    @field_validator("auth_header")
    @classmethod
    def _header(cls, value: str) -> str:
        name = header_name(value)
        field = name.encode()
        if field in HOP_BY_HOP_HEADERS or field in RECOMPUTED_HEADERS:
            raise ValueError(
                f"{name} is a connection or framing field the upstream client sets itself; "
                "the credential needs a header of its own (authorization, x-api-key, ...)"
            )
        if field.startswith(GATEWAY_HEADER_PREFIX):
            raise ValueError("x-gateway-* headers are the gateway's own")
        return name

    @field_validator("auth_scheme")
    @classmethod
    def _scheme(cls, value: str) -> str:
        # Sent as "<scheme> <credential>": a trailing space would double the separator, and
        # a control character would fail every attempt here at request time.
        scheme = value.strip(" \t")
        problem = header_value_problem(scheme)
        if problem is not None:
            raise ValueError(f"cannot start a header value: it {problem}")
        return scheme

    @field_validator("proxy")
    @classmethod
    def _proxy(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.isascii() or any(c.isspace() or ord(c) < 0x20 for c in value):
            host = urlsplit(value).hostname or ""
            hint = f" ({xn_form(host)})" if not host.isascii() else ""
            raise ValueError(f"must be plain ASCII without spaces or control characters{hint}")
        parts = urlsplit(value)
        if parts.scheme != "http" or not parts.hostname or not valid_host(parts.hostname):
            raise ValueError("must be an http:// proxy URL with a host (http://proxy:3128)")
        if "%" in parts.hostname:
            raise ValueError(_ZONE_ID)
        if "@" in parts.netloc:
            raise ValueError("must not carry credentials (proxy authentication is not supported)")
        if parts.path not in ("", "/") or "?" in value or "#" in value:
            raise ValueError("must be http://host:port, without a path or query")
        try:
            port = parts.port  # raises for a port that is not 0..65535
        except ValueError:
            raise ValueError("has a malformed port") from None
        if port == 0:  # no server listens there: every attempt would fail as a transport error
            raise ValueError("has port 0 (no server listens on it)")
        return parts.scheme + value[len(parts.scheme) :].rstrip("/")

    @field_validator("model")
    @classmethod
    def _model(cls, value: str | None) -> str | None:
        # Sent in the body, and shown by `check`, kept in usage records and span attributes
        # (cut to 200): a line break or an escape reached the terminal and forged lines;
        # "" made every request ask the provider for no model.
        if value is not None and (not value or len(value) > 200 or not value.isprintable()):
            raise ValueError(
                "must be a model name: 1..200 printable characters (no line break, tab or "
                "other control character); omit model to keep the caller's"
            )
        return value

    @field_validator("provider")
    @classmethod
    def _provider(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[a-z0-9][a-z0-9_.\-]{0,63}", value):
            raise ValueError(
                'must be a provider name in lower case, e.g. "openai", "anthropic", "aws.bedrock"'
            )
        return value

    @property
    def proxy_host(self) -> str | None:
        return urlsplit(self.proxy).hostname if self.proxy else None

    @functools.cached_property
    def credential_envs(self) -> tuple[str, ...]:
        """The pool's variables (one for a single credential, none for no auth): asked on
        every pick and attempt, so made once (the model is frozen: `auth_env` stays)."""
        if self.auth_env is None:
            return ()
        if isinstance(self.auth_env, str):
            return (self.auth_env,)
        return self.auth_env

    def model_post_init(self, context: Any, /) -> None:
        # Each attempt names the upstream's host and port (its span's `server.address`,
        # `server.port`) and counts its pool: read now, when the configuration is loaded,
        # and kept in the instance's __dict__, so an attempt reads a plain attribute (a
        # pydantic private attribute is read through `__getattr__`, some 2 µs a read).
        _ = self.host, self.port, self.credential_envs

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        # pydantic copies the instance's __dict__, the values derived above with it: a copy
        # with another `url` or `auth_env` kept the original's host (what allow_hosts
        # checks) and credential variables (whose keys it sent). Derived again.
        copied = super().model_copy(update=update, deep=deep)
        if update:
            for derived in ("host", "port", "credential_envs"):
                copied.__dict__.pop(derived, None)
            copied.model_post_init(None)
        return copied

    @functools.cached_property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @functools.cached_property
    def port(self) -> int:
        """The URL's explicit port, or its scheme's default (80, 443)."""
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)
