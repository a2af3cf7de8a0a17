"""The configuration's pydantic models: what each key of SPEC §3 takes, its default and
its bounds, checked as the file is read (docs/configuration.md)."""

from __future__ import annotations

import difflib
import functools
import ipaddress
import json
import re
import shlex
from decimal import ROUND_DOWN, Decimal
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin
from urllib.parse import unquote, urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from fallback_mw.rules import ConfigError as ConfigError  # re-exported: its public home
from fallback_mw.security.addresses import carried_ipv4_network, is_legacy_ipv4
from fallback_mw.security.fields import (
    DEFAULT_STRIP_HEADERS,
    GATEWAY_HEADER_PREFIX,
    HOP_BY_HOP_HEADERS,
    RECOMPUTED_HEADERS,
)
from fallback_mw.security.queries import DEFAULT_STRIP_QUERY_KEYS
from fallback_mw.security.values import header_value_problem, is_field_name
from fallback_mw.store_url import is_redis_url

MAX_PLAN_LENGTH = 8
# The largest amount of money (currency units) a budget limit, hold or price may name: the
# ledgers keep integer nano-units in signed 64-bit columns (see budget/cost.py).
MAX_MONEY = Decimal(1_000_000_000)
MONEY_DECIMALS = 9  # the ledgers' integer nano-units
_NANO = Decimal(1).scaleb(-MONEY_DECIMALS)
# The longest walk deadline (route or gateway `deadline_ms`): it also bounds every attempt.
MAX_DEADLINE_MS = 600_000


# The plain scalar types a field takes, for `_Strict`'s refusal of type juggling.
_SCALARS = {int: "int", float: "float", bool: "bool", str: "str"}


def _scalar_kinds(annotation: Any) -> frozenset[str]:
    """The plain scalar types a field takes ("int", "float", "bool", "str"), with None
    allowed beside them; empty when it takes anything else too (a tuple, a Decimal, a
    Literal, a model), whose own validation decides."""
    members = (
        get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    )
    kinds = set()
    for member in members:
        if member is type(None):
            continue
        kind = _SCALARS.get(member)
        if kind is None:
            return frozenset()
        kinds.add(kind)
    return frozenset(kinds)


class WrittenFloat(float):
    """A TOML float that keeps the digits the file wrote (`read_config_file`'s
    `parse_float`): money is Decimal, and `limit = 12345678.123456789` read through a binary
    float was kept as 12345678.12345679, `99999999.9999999999` (ten decimals, refused) as
    100000000, a price's 20th decimal dropped. Every other float field takes it as a float."""

    written: str

    def __new__(cls, written: str) -> WrittenFloat:
        number = super().__new__(cls, written)
        number.written = written
        return number


def _as_written(value: Any) -> Any:
    """A money field's TOML float as the Decimal of its written digits."""
    return Decimal(value.written) if isinstance(value, WrittenFloat) else value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _utf8_text(cls, value: Any, info: ValidationInfo) -> Any:
        # A lone surrogate (a dict built from `os.environ` holding bytes that are not UTF-8,
        # a store record's JSON `\ud800`) loaded, then failed where the text is encoded: a
        # `canary_salt` on every request with a session (UnicodeEncodeError, a bare 500), a
        # stored route's prefix in `routes list`. TOML text cannot hold one. A `ca_file` is
        # a file's path, which may hold any bytes (Python spells them so, and opens them).
        if info.field_name == "ca_file":
            return value
        if isinstance(value, dict):
            texts: Any = value.keys()
        elif isinstance(value, list | tuple):
            texts = value
        else:
            texts = (value,)
        for text in texts:
            if isinstance(text, str) and not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise PydanticCustomError(
                        "not_utf8", "must be UTF-8 text (it holds a lone surrogate)"
                    ) from None
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _no_type_juggling(cls, value: Any, info: ValidationInfo) -> Any:
        # TOML has numbers and booleans of its own: `retries = "1"`, `deadline_ms = true`
        # (a 1 ms deadline) and `canary_eligible = 1` are slips, which pydantic's lax mode
        # took as 1, 1 and true. Refused as the wrong type, like `deadline_ms = "5s"`.
        if info.field_name is None:
            return value
        kinds = _scalar_kinds(cls.model_fields[info.field_name].annotation)
        if not kinds or "str" in kinds:
            return value
        numeric = kinds & {"int", "float"}
        if isinstance(value, bool):
            wrong = "bool" not in kinds
        elif isinstance(value, str):
            wrong = True
        else:
            wrong = isinstance(value, int | float) and not numeric
        if not wrong:
            return value
        kind = "int_type" if "int" in kinds else "float_type" if numeric else "bool_type"
        raise PydanticCustomError(kind, "wrong type")


# A breaker's open period at most: 31 days, as `quota_retire_ms`. A Redis `state` keeps
# each breaker for twice its longest cooldown, which must be a valid PEXPIRE: a cooldown of
# 1e20 ms was taken, and every breaker update failed as "Redis unreachable".
MAX_COOLDOWN_MS = 31 * 86_400_000
# The longest timeout or delay an upstream or route may name (connect, first byte, idle,
# hedge): 31 days, as above. 1e400 ms loaded, and every request then ended in a bare 500
# (its conversion to seconds, an OverflowError, on the request path).
MAX_TIMER_MS = 31 * 86_400_000


class BreakerConfig(_Strict):
    window: int = Field(20, ge=1, le=10_000)
    min_calls: int = Field(5, ge=1)
    failure_rate: float = Field(0.5, gt=0.0, le=1.0)
    cooldown_ms: int = Field(5000, ge=1, le=MAX_COOLDOWN_MS)
    max_cooldown_ms: int = Field(300_000, ge=1, le=MAX_COOLDOWN_MS)


class RepeatAllowanceConfig(_Strict):
    """The budget for repeats and hedges, per upstream (docs/failover.md): attempts that go
    back to an upstream already tried in the request, and hedges, are allowed while they
    stay within `percent` of that upstream's first attempts over the last `window_ms`,
    plus `min_per_second` x the window (a floor, so quiet upstreams can still retry). The
    window is kept in whole seconds (`window_ms` rounded down: 1500 is 1 s)."""

    percent: float = Field(20.0, ge=0.0, le=1000.0)
    min_per_second: float = Field(1.0, ge=0.0, le=1_000_000.0)
    window_ms: int = Field(10_000, ge=1000, le=600_000)


class GatewaySettings(_Strict):
    tenant_header: str = "x-tenant-id"
    session_header: str = "x-session-id"
    max_request_body: int = Field(8 * 1024 * 1024, ge=0)
    replay_buffer: int = Field(1024 * 1024, ge=0)
    max_response_body: int = Field(10 * 1024 * 1024, ge=0)
    deadline_ms: int = Field(5000, ge=1, le=MAX_DEADLINE_MS)
    allow_hosts: tuple[str, ...] = ("127.0.0.1", "localhost")
    state: str = "memory://"
    store: str | None = None
    engine: Literal["aiohttp", "httpx"] = "aiohttp"
    canary_salt: str = "fallback_mw"
    # Limits that protect the process (SPEC §11); see docs/security.md.
    max_header_bytes: int = Field(65_536, ge=1024, le=16 * 1024 * 1024)
    max_header_count: int = Field(100, ge=1, le=10_000)
    max_concurrency: int = Field(0, ge=0, le=1_000_000)
    header_timeout_ms: int = Field(10_000, ge=1, le=600_000)
    breaker: BreakerConfig = BreakerConfig()
    repeat_budget: RepeatAllowanceConfig = RepeatAllowanceConfig()
    # A PEM bundle of the CAs trusted for https:// upstreams, instead of the system's
    # store (which SSL_CERT_FILE / SSL_CERT_DIR replace); an upstream's own wins.
    ca_file: str | None = None
    # Caller credentials beyond SPEC §4's list, removed before any upstream (SPEC §12);
    # a list given here replaces the defaults.
    strip_headers: tuple[str, ...] = DEFAULT_STRIP_HEADERS
    strip_query_keys: tuple[str, ...] = DEFAULT_STRIP_QUERY_KEYS

    @field_validator("strip_headers", "strip_query_keys")
    @classmethod
    def _names(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        for name in value:
            if not name or not name.isascii() or any(c.isspace() or c in "=&" for c in name):
                raise ValueError(f"{name!r} is not a header name or query key")
            if info.field_name == "strip_headers" and not is_field_name(name):
                # `"x-secret:"` (pasted from a request) matched no header: that credential
                # reached every upstream while the list said it was removed.
                raise ValueError(
                    f"{name!r} is not an HTTP header name (letters, digits and "
                    "!#$%&'*+-.^_`|~, no ':' or control characters), e.g. x-api-key"
                )
        return tuple(name.lower() for name in value)

    @field_validator("allow_hosts")
    @classmethod
    def _allow_hosts(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """Each entry a host name, an IP address or a CIDR network: a URL, a `host:port`
        or a malformed network would otherwise be kept as a name that matches nothing,
        and the error would surface later, naming the upstream instead of the entry."""
        for entry in value:
            text = entry.strip().lower()
            try:
                network = ipaddress.ip_network(text.strip("[]"), strict=False)
            except ValueError:
                pass
            else:
                carried = carried_ipv4_network(network)
                if carried is None:
                    continue
                # `::ffff:127.0.0.1` loaded and matched nothing, not even the upstream
                # `http://[::ffff:127.0.0.1]`, refused as "not in allow_hosts: add it".
                shown = str(carried.network_address if carried.prefixlen == 32 else carried)
                raise ValueError(
                    f"{entry[:80]!r} spells IPv4 addresses in IPv6 (IPv4-mapped or "
                    "-compatible, NAT64, 6to4), which the allowlist judges by the IPv4 "
                    f"address they carry: write the IPv4 address or network meant (this "
                    f"entry spells {shown})"
                )
            if "://" in text:
                hint = ": list the host alone, without scheme or path"
            elif "/" in text:
                hint = ": not a CIDR network (an address, a slash, a prefix length)"
            elif text.count(":") == 1:
                hint = ": list the host alone, without a port"
            elif "*" in text:
                hint = ": exact host names only, no wildcards"
            elif is_legacy_ipv4(text):
                hint = (
                    ": an IPv4 address in a legacy spelling (octal, hex, integer, short, or"
                    " with a trailing dot); write it as four decimal numbers"
                )
            elif not text.isascii():
                hint = f": {_xn_form(text)}"
            elif not _valid_host(text.rstrip(".")):
                hint = ": not a host name"
            else:
                continue
            raise ValueError(
                f"{entry[:80]!r} is not a host name, an IP address or a CIDR network{hint}"
            )
        return value

    @field_validator("tenant_header", "session_header")
    @classmethod
    def _lower(cls, value: str) -> str:
        return _header_name(value)  # a malformed one would match no request, silently

    @field_validator("state")
    @classmethod
    def _state(cls, value: str) -> str:
        if value not in ("memory://", "memory", "") and not is_redis_url(value):
            raise ValueError('must be "memory://" or "redis://host:port/db"')
        if is_redis_url(value):
            from fallback_mw.store_url import StoreURLError, check_state_url

            try:
                check_state_url(value)
            except StoreURLError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("store")
    @classmethod
    def _store(cls, value: str | None) -> str | None:
        if value is not None:
            from fallback_mw.store_url import StoreURLError, parse_store_url

            try:
                parse_store_url(value)
            except StoreURLError as exc:
                raise ValueError(str(exc)) from None
        return value


_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*\.?")


def _header_name(value: str) -> str:
    """A configured header name, lower-cased; ValueError unless it is an HTTP field name."""
    name = value.strip().lower()
    if not is_field_name(name):
        raise ValueError(
            "must be an HTTP header name (letters, digits and !#$%&'*+-.^_`|~, no spaces "
            "or ':'), e.g. authorization or x-api-key"
        )
    return name


_XN_HINT = "write an international host name in its xn-- form"


def _xn_form(host: str) -> str:
    """The hint for a host written in Unicode (`bücher.example`), with its xn-- spelling
    where it has one: such a name matched no upstream (every upstream URL is ASCII) and
    was refused as "not a host name", which it is, in another spelling."""
    try:
        import idna  # yarl's IDNA 2008 (UTS 46) codec, so aiohttp's: always installed

        spelled = idna.encode(host.rstrip("."), uts46=True).decode("ascii")
    except Exception:  # not a name IDNA can spell (a symbol, a space): the hint alone
        return _XN_HINT
    return f"{_XN_HINT}, {spelled}"


def _valid_host(host: str) -> bool:
    """A DNS name (letters, digits, `-`, `_`; labels of at most 63) or an IP literal."""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            return False
        return True
    return len(host) <= 253 and _HOST_NAME.fullmatch(host) is not None


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


class UpstreamConfig(_Strict):
    url: str
    auth_header: str = "authorization"
    auth_scheme: str = "Bearer"
    auth_env: str | tuple[str, ...] | None = None
    model: str | None = None
    # 3 s: survives one dropped SYN (Linux retransmits the first after 1 s), SPEC §12.
    connect_timeout_ms: int = Field(3000, ge=1, le=MAX_TIMER_MS)
    # Requests (so connections) in flight to this upstream from one process, SPEC §12.
    max_connections: int = Field(100, ge=1, le=100_000)
    first_byte_timeout_ms: int = Field(30_000, ge=1, le=MAX_TIMER_MS)
    idle_timeout_ms: int = Field(60_000, ge=1, le=MAX_TIMER_MS)
    rpm: int | None = Field(None, ge=1, le=10**9)  # declared capacity: requests per minute
    tpm: int | None = Field(None, ge=1, le=10**15)  # declared capacity: tokens per minute
    # A credential pool (auth_env as a list), SPEC §12: how a credential is chosen, and how
    # long a credential whose 429 says its quota is spent is retired when it says not until
    # when.
    selection: Literal["round_robin", "score"] = "round_robin"
    quota_retire_ms: int = Field(3_600_000, ge=1, le=31 * 86_400_000)
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
                f"({_xn_form(host) if not host.isascii() else _XN_HINT})"
            )
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if not _valid_host(parts.hostname):
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
        name = _header_name(value)
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
            hint = f" ({_xn_form(host)})" if not host.isascii() else ""
            raise ValueError(f"must be plain ASCII without spaces or control characters{hint}")
        parts = urlsplit(value)
        if parts.scheme != "http" or not parts.hostname or not _valid_host(parts.hostname):
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

    @property
    def credential_envs(self) -> tuple[str, ...]:
        if self.auth_env is None:
            return ()
        if isinstance(self.auth_env, str):
            return (self.auth_env,)
        return self.auth_env

    def model_post_init(self, context: Any, /) -> None:
        # Each attempt names the upstream's host and port (its span's `server.address`,
        # `server.port`): read from the URL now, when the configuration is loaded, and
        # kept in the instance's __dict__, so an attempt reads a plain attribute (a
        # pydantic private attribute is read through `__getattr__`, some 2 µs a read).
        _ = self.host, self.port

    @functools.cached_property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @functools.cached_property
    def port(self) -> int:
        """The URL's explicit port, or its scheme's default (80, 443)."""
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)


# A route that lists no `methods` forwards these; any other method on its paths (TRACE,
# CONNECT, a custom one) is a local 405 `method_not_allowed` (SPEC §12).
DEFAULT_METHODS = ("GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE")
# HTTP's own methods (RFC 9110 §9, PATCH: RFC 5789).
HTTP_METHODS = (*DEFAULT_METHODS, "TRACE", "CONNECT")


def _decoded_prefix_hint(prefix: str) -> str:
    """For a prefix written percent-encoded (`/v1/caf%C3%A9/`, as a browser shows a URL),
    the prefix to write instead: requests are matched on the decoded path, so the encoded
    one could never match, and "without percent-encoding" left the user to decode it."""
    if "%" not in prefix:
        return ""
    try:
        decoded = unquote(prefix, errors="strict")
    except UnicodeDecodeError:
        return ""
    if decoded.count("/") != prefix.count("/") or "%" in decoded or not decoded.isprintable():
        return ""  # an escaped separator, a double escape, a control character: no hint
    if any(seg.split(";", 1)[0] in (".", "..") for seg in decoded.split("/")):
        return ""
    if "//" in decoded or any(char.isspace() or char in "?#\\*" for char in decoded):
        return ""  # refused as written too (`_prefix`)
    return f": write the characters themselves, {decoded!r} (requests match decoded paths)"


class RouteConfig(_Strict):
    id: str = Field(min_length=1, max_length=200)
    prefix: str
    tenant: str | None = None
    methods: tuple[str, ...] | None = None  # None: DEFAULT_METHODS
    plan: tuple[str, ...] = Field(min_length=1, max_length=MAX_PLAN_LENGTH)
    strategy: Literal["sequential", "random"] = "sequential"
    retries: int = Field(0, ge=0, le=32)
    backoff_ms: int = Field(25, ge=0, le=60_000)
    deadline_ms: int | None = Field(None, ge=1, le=MAX_DEADLINE_MS)
    replayable_methods: tuple[str, ...] = ("GET", "HEAD", "OPTIONS")
    # A POST carrying an Idempotency-Key header (IETF HTTPAPI draft) is replayable too: the
    # upstream deduplicates on the key, so a second attempt cannot act twice.
    replay_with_idempotency_key: bool = False
    failover_status: tuple[StrictInt, ...] = (502, 503, 504)  # ["503"] refused, as retries = "1"
    on_exhausted: Literal["error", "last_response"] = "error"
    budget: str | None = None
    hedge_after_ms: int = Field(0, ge=0, le=MAX_TIMER_MS)
    # Hedge a POST that carries an Idempotency-Key too (two concurrent requests, one key).
    hedge_idempotent_posts: bool = False
    canary_percent: float = Field(0.0, ge=0.0, le=100.0)
    canary_eligible: bool = False
    shadow: str | None = None  # an upstream that gets copies of the slice, answer discarded
    shadow_percent: float = Field(0.0, ge=0.0, le=100.0)

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with '/'")
        # `..;x` and `.;x` too: the request path is read as servlet containers read it, a
        # dot segment with a parameter (routing.normalise_path), so such a prefix loaded
        # and no request could ever match it.
        if any(seg.split(";", 1)[0] in (".", "..") for seg in value.split("/")) or "%" in value:
            raise ValueError(
                "must be a plain path without dot segments or percent-encoding"
                + _decoded_prefix_hint(value)
            )
        # Requests are matched on the normalised path (no empty segments, `\\` read as `/`,
        # no query or fragment): a prefix holding one of these could never match.
        if "//" in value or any(char in value for char in "?#\\*"):
            raise ValueError(
                "must be a plain path: no '//', '?', '#', '\\' or '*' (a prefix is literal "
                "and matches every path below it: '/v1/' takes /v1/chat/completions)"
            )
        # A space is a quoting slip far more often than a path (such a route serves only
        # `%20` spellings); a control character would also split `routes list` lines.
        if any(char.isspace() or char < " " or "\x7f" <= char <= "\x9f" for char in value):
            raise ValueError(
                "must be a plain path: no spaces or control characters (route a parent "
                "path, e.g. '/files/', to serve paths that contain them)"
            )
        return value

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, value: str | None) -> str | None:
        # Matched against the tenant header's value, stripped and never empty (empty is
        # tenant "default"), which no control character can be part of: such a tenant could
        # never match, and a line break would split `routes list` / `check` lines.
        if value is None:
            return None
        control = any(c < " " or "\x7f" <= c <= "\x9f" for c in value)
        # A comma separates the values of a field sent twice (RFC 9110 §5.3): refused.
        if not value or value != value.strip() or control or "," in value:
            raise ValueError(
                "must be a tenant header value: not empty, no surrounding spaces, no control "
                "characters, no comma (omit tenant for a route that serves every tenant)"
            )
        return value

    @field_validator("budget")
    @classmethod
    def _budget(cls, value: str | None) -> str | None:
        return None if value is None else budget_id(value)

    @field_validator("methods", "replayable_methods")
    @classmethod
    def _upper(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        for method in value:
            # A method is a token, as a field name is (RFC 9110 §9.1): "GET,HEAD" or
            # "GET POST" would match no request, silently.
            if not is_field_name(method):
                raise ValueError(
                    f"{method!r} is not an HTTP method: list one method per string, e.g. "
                    '["GET", "HEAD"]'
                )
        return tuple(m.upper() for m in value)

    @field_validator("methods")
    @classmethod
    def _some_methods(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None and not value:
            raise ValueError(
                "a route of no methods serves no request: list its methods, or omit the key "
                f"for {', '.join(DEFAULT_METHODS)}"
            )
        return value

    @field_validator("replayable_methods")
    @classmethod
    def _replayable_known(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        # `replayable_methods = ["PSOT"]` loaded, and POST silently never failed over. A
        # method is listed here only to be forwarded: one of HTTP's own, or one the route's
        # `methods` names (a custom method such as PROPFIND).
        routed = info.data.get("methods") or DEFAULT_METHODS
        known = (*routed, *(m for m in HTTP_METHODS if m not in routed))
        for method in value:
            if method not in known:
                close = difflib.get_close_matches(method, known, n=1)
                hint = f": did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"{method!r} is neither an HTTP method nor one this route's methods "
                    f"list ({', '.join(routed)}){hint}"
                )
        return value

    @field_validator("failover_status")
    @classmethod
    def _statuses(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        for status in value:
            if not 100 <= status <= 599:
                raise ValueError(f"{status} is not an HTTP status")
            if status < 300:  # a 2xx would fail over (and mark the breaker) on every success
                raise ValueError(
                    f"{status} is not a failure: list the statuses that should move the walk "
                    "on, e.g. 429, 500, 502, 503, 504, 529 (a 1xx as the final answer always does)"
                )
        return value

    @property
    def attempt_ceiling(self) -> int:
        return 1 + self.retries

    @property
    def accepted_methods(self) -> tuple[str, ...]:
        return DEFAULT_METHODS if self.methods is None else self.methods


MAX_BUDGET_ID = 200


def budget_id(value: str) -> str:
    """A budget id, as `budgets set --budget` takes one: 1..200 printable characters. It
    reaches log lines, error bodies and `check` / `budgets show` output, so a line break or
    an escape sequence in it (a hand-written store record's route) must never get that far."""
    if not value or len(value) > MAX_BUDGET_ID or not value.isprintable():
        raise ValueError(
            f"budget id {value[:80]!r} is not allowed: 1..{MAX_BUDGET_ID} printable "
            "characters (no line break, tab or other control character)"
        )
    return value


def budget_section(value: str) -> str:
    """The TOML table a budget id is configured under, as it must be written: a bare key
    (`[budgets.acme]`), else quoted (`[budgets."予算 2026"]`, which unquoted is no TOML)."""
    if _BARE_KEY.fullmatch(value):
        return f"[budgets.{value}]"
    return f"[budgets.{json.dumps(value, ensure_ascii=False)}]"


def budget_argument(value: str) -> str:
    """A budget id as a shell command's argument (`--budget '予算 2026'`): pasted as it was
    printed, a space split it into two arguments."""
    return shlex.quote(value)


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class BudgetConfig(_Strict):
    limit: Decimal = Field(ge=0, le=MAX_MONEY)
    window: Literal["day", "month", "total"] = "month"
    default_hold: Decimal = Field(Decimal("0.01"), ge=0, le=MAX_MONEY)

    _written = field_validator("limit", "default_hold", mode="before")(_as_written)

    @field_validator("limit", "default_hold")
    @classmethod
    def _whole_nano_units(cls, value: Decimal) -> Decimal:
        # The ledgers keep amounts in integer nano-units (budget/cost.py): a limit of
        # 0.1000000001 would be kept as 0.100000001, more than was asked for.
        if value != value.quantize(_NANO, rounding=ROUND_DOWN):  # finite, <= MAX_MONEY here
            raise ValueError(f"at most {MONEY_DECIMALS} decimal places (the ledger's unit)")
        return value + 0  # -0 is 0


class PriceConfig(_Strict):
    input_per_mtok: Decimal = Field(ge=0, le=MAX_MONEY)
    output_per_mtok: Decimal = Field(ge=0, le=MAX_MONEY)

    _written = field_validator("input_per_mtok", "output_per_mtok", mode="before")(_as_written)


class GatewayConfig(_Strict):
    gateway: GatewaySettings = GatewaySettings()
    upstreams: dict[str, UpstreamConfig] = {}
    routes: tuple[RouteConfig, ...] = ()
    budgets: dict[str, BudgetConfig] = {}
    prices: dict[str, PriceConfig] = {}

    @field_validator("budgets")
    @classmethod
    def _budget_ids(cls, value: dict[str, BudgetConfig]) -> dict[str, BudgetConfig]:
        for name in value:
            budget_id(name)
        return value
