"""Store URLs (`sqlite:///relative.db`, `sqlite:////abs/path.db`, `postgresql://...`) and
state URLs (`redis://`, `rediss://`, `unix://`): read and checked when the configuration
is loaded, so a malformed one is refused by name there, never met as an error on the first
request. No message here ever carries a password."""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit


@dataclass(frozen=True, slots=True)
class StoreURL:
    kind: Literal["sqlite", "postgresql"]
    target: str  # a file path for SQLite, the DSN for PostgreSQL

    def __str__(self) -> str:
        # For messages: never print a password.
        if self.kind == "sqlite":
            return f"sqlite:///{self.target}"
        return redact_url(self.target)


class StoreURLError(ValueError):
    pass


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def is_redis_url(url: str) -> bool:
    """A `gateway.state` naming Redis (shared state) rather than memory."""
    return url.startswith(REDIS_SCHEMES)


def _userinfo(rest: str) -> tuple[str, str]:
    """(the userinfo, what follows its `@`) of a URL's text after `scheme://`; ("", rest)
    without one. The userinfo ends at the last `@` before the query: a password written
    with a `/` unencoded (`u:2024/Spring@h/db`) is still the password, never a host and a
    path to print (the host then read as `u`, port 2024: the URL loads, and every message
    naming the store printed the password whole)."""
    end = len(rest)
    for mark in ("?", "#"):
        found = rest.find(mark)
        if 0 <= found < end:
            end = found
    at = rest.rfind("@", 0, end)
    if at < 0:
        return "", rest
    return rest[:at], rest[at + 1 :]


def redact_url(url: str) -> str:
    """The URL without its password, query (it can carry `password=`) and fragment. Read as
    text, never through `urlsplit(...).port`: a PostgreSQL URL may list several hosts."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return ""
    userinfo, rest = _userinfo(rest)
    authority, slash, path = rest.partition("/")
    authority = authority.split("?", 1)[0].split("#", 1)[0]
    user = userinfo.split(":", 1)[0].split("/", 1)[0]
    if user:
        authority = f"{user}@{authority}"
    path = path.split("?", 1)[0].split("#", 1)[0]
    return f"{scheme}://{authority}{slash}{path}"


def unusable_store(dsn: str, exc: Exception) -> str:
    """What the command line and the log say when the PostgreSQL driver refuses one of the
    store URL's options (`sslmode=requir`): the route store and the ledger say the same."""
    return f"the store {redact_url(dsn)} cannot be used: {driver_reason(exc, dsn)}"


def driver_reason(exc: Exception, dsn: str) -> str:
    """The driver's one-line reason, or its type's name when the URL's password (or its
    query, which may carry `password=`) could be in it."""
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    password = _userinfo(dsn.partition("://")[2])[0].partition(":")[2]
    secrets = [password, unquote(password), dsn.partition("?")[2]]
    if not text or any(secret and secret in text for secret in secrets):
        return type(exc).__name__
    return text


def _check_text(url: str, key: str) -> None:
    """A URL is printable UTF-8 text: a NUL (`\\u0000` in a TOML string) passed the
    loader and `check`, then failed every verb and `serve` as "unexpected internal error
    (ValueError)" when the driver opened it; another control character named a file or
    host no one can type. Never quoted: the URL may hold a password."""
    if any(char < " " or char == "\x7f" for char in url):
        raise StoreURLError(f"{key} URL has a control character (a NUL, a tab, a line break...)")
    try:
        url.encode("utf-8")
    except UnicodeEncodeError:
        raise StoreURLError(f"{key} URL is not UTF-8 text (it holds a lone surrogate)") from None


def parse_store_url(url: str) -> StoreURL:
    _check_text(url, "store")
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///") :]
        if not path:
            raise StoreURLError("sqlite store URL needs a path: sqlite:///gateway.db")
        if "?" in path or "#" in path:
            # No option is read from it: `?mode=ro` would become part of the file's name.
            raise StoreURLError("sqlite store URL takes no query or fragment: sqlite:///gateway.db")
        if path == ":memory:":
            # SQLite's name for a new empty database per connection: the store's tables,
            # made on one connection, are not there on the next, nor in any other process.
            raise StoreURLError(
                "sqlite:///:memory: is a new empty database on every connection, shared by "
                "nothing: omit gateway.store for the in-memory ledger of one process, or "
                "name a file: sqlite:///gateway.db"
            )
        return StoreURL("sqlite", path)
    if url.startswith(("postgresql://", "postgres://")):
        _check_hosts(url, "store")
        return StoreURL("postgresql", url)
    raise StoreURLError(
        "store must be sqlite:///path.db, sqlite:////abs/path.db or postgresql://..."
    )


_PORT = re.compile(r"[0-9]{1,5}")


def _check_hosts(url: str, key: str) -> None:
    """Every `host[:port]` of the URL's authority (PostgreSQL takes a comma-separated
    list) well formed: a bracketed IPv6 literal closed, a port of digits in 1-65535."""
    rest = url.split("://", 1)[1]
    if "/" in _userinfo(rest)[0]:
        # The drivers read `u:2024/pw@h/db` as host `u`, port 2024: "cannot reach" a host
        # nobody wrote. Said without the URL: the password is in it.
        raise StoreURLError(
            f"{key} URL has a '/' in its user or password: percent-encode it as %2F"
        )
    region = rest.split("/", 1)[0]
    at = region.rfind("@")
    fragment, query = region.find("#", 0, at), region.find("?", 0, at)
    # (`h?user=a@b`, a query before any path, is a query: a `=` comes before its `@`.)
    if at > 0 and (fragment >= 0 or (query >= 0 and "=" not in region[query:at])):
        # `u:pw#1@h/db`: asyncpg read `pw` as the port and raised "invalid literal for
        # int() with base 10: 'pw'", the password's first part in the host's traceback.
        raise StoreURLError(
            f"{key} URL has a '#' or '?' in its user or password: percent-encode them "
            "as %23 and %3F"
        )
    authority = url.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
    hosts = authority.rsplit("@", 1)[-1]  # never look at (or print) the user's password
    for host in hosts.split(","):
        port = ""
        if host.startswith("["):
            end = host.find("]")
            if end < 0:
                raise StoreURLError(f"{key} URL has an unclosed [ in its host")
            rest = host[end + 1 :]
            if rest and not rest.startswith(":"):
                raise StoreURLError(f"{key} URL has text after its IPv6 host")
            port = rest[1:]
        elif ":" in host:
            port = host.rsplit(":", 1)[1]
        if port and not (_PORT.fullmatch(port) and 0 < int(port) <= 65535):
            raise StoreURLError(f"{key} URL has a port that is not a number from 1 to 65535")


def split_state_url(url: str) -> tuple[str, str]:
    """(the URL for redis-py, the key prefix from `?prefix=`)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefix = next((value for key, value in query if key == "prefix"), "fallback_mw:")
    rest = urlencode([(key, value) for key, value in query if key != "prefix"])
    # Not urlunsplit: it writes `unix:///run/redis.sock` as `unix:/run/redis.sock`, which
    # redis-py 8 refuses ("must specify one of the following schemes").
    url = f"{parts.scheme}://{parts.netloc}{parts.path}" + (f"?{rest}" if rest else "")
    return url, prefix


_UNKNOWN_ARGUMENT = re.compile(r"unexpected keyword argument '([A-Za-z0-9_]{1,64})'")


def check_state_url(url: str) -> None:
    """A `redis://` / `rediss://` / `unix://` state URL read as redis-py will read it when
    the first request needs it: its port, its database number (the path: digits or
    nothing), and every query parameter (`?max_connections=abc`, `?socket_timeout=x`, a
    parameter redis-py does not know). Without redis installed only the shape is checked:
    the missing extra is refused on its own."""
    _check_text(url, "state")
    if url.startswith(("redis://", "rediss://")):
        _check_hosts(url, "state")
        path = urlsplit(url).path.strip("/")
        if path and not path.isdigit():
            raise StoreURLError(
                "state URL's path is the Redis database number: redis://host:6379/0"
            )
    try:
        import redis.asyncio as aioredis
        from redis.exceptions import RedisError
    except ImportError:
        return
    try:
        pool = aioredis.BlockingConnectionPool.from_url(split_state_url(url)[0])
        pool.make_connection()  # type: ignore[no-untyped-call]  # builds it; connects nothing
    except RedisError as exc:
        # redis-py refuses some values as it builds the connection with errors of its own
        # (`?protocol=5`, `?ssl_cert_reqs=bogus`): they were "unexpected internal error".
        # Named by option, never quoting a value of the query (it may carry `password=`).
        reason = driver_reason(exc, url).rstrip(".")
        for option, given in parse_qsl(urlsplit(url).query, keep_blank_values=True):
            if given and given in reason:
                reason = f"redis-py refuses the value of its {option[:40]!r} option"
                break
        raise StoreURLError(f"state URL: {reason}") from None
    except (ValueError, TypeError, OverflowError) as exc:
        unknown = _UNKNOWN_ARGUMENT.search(str(exc))
        if unknown is not None:
            reason = f"unknown query parameter {unknown.group(1)!r}"
        elif isinstance(exc, ValueError) and "connection URL" in str(exc):
            reason = str(exc).rstrip(".")  # "Invalid value for 'max_connections' in ..."
        else:
            reason = "it cannot be read as a Redis URL"
        raise StoreURLError(f"state URL: {reason}") from None
    options = pool.connection_kwargs
    # redis-py uses these only when it first encodes a command: `?encoding=bogus` loaded,
    # then every routed request failed (LookupError) as an internal error. The gateway's
    # keys and scripts are ASCII: an encoding must write them as ASCII (`utf-16` would send
    # Redis scripts it cannot read, `rot13` is no text encoding).
    errors = options.get("encoding_errors", "strict")
    encoding = options.get("encoding", "utf-8")
    try:
        codecs.lookup_error(str(errors))
    except LookupError:
        raise StoreURLError(
            "state URL: encoding_errors names no error handler Python knows"
        ) from None
    sample = "fallback_mw:{breaker}"
    try:
        written = sample.encode(str(encoding))
    except LookupError:
        written = b""
    if written != sample.encode("ascii"):
        raise StoreURLError(
            "state URL: encoding is not a text encoding that writes ASCII as ASCII (omit it: utf-8)"
        )
    for name in ("socket_timeout", "socket_connect_timeout"):
        # 0 or less: every call to Redis times out at once (or the socket refuses it), so
        # the state is never shared, while the name reads as "no timeout".
        value = options.get(name)
        if isinstance(value, int | float) and not value > 0:
            raise StoreURLError(f"state URL: {name} must be a number of seconds above 0")
