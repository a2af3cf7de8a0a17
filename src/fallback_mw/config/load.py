"""Loading a configuration: the TOML file read (bounded, never quoted back), parsed into
the models, then the load-time refusals of rules.py, the credential variables and the
CA bundles checked once (`validate`); `as_config` takes any of the forms a host hands."""

from __future__ import annotations

import difflib
import os
import ssl
import stat
import tomllib
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from pydantic import BaseModel, ValidationError

from fallback_mw import extras, rules
from fallback_mw.config.describe import _describe
from fallback_mw.config.model import GatewayConfig
from fallback_mw.config.strict import WrittenFloat, budget_section
from fallback_mw.injected import require_environ
from fallback_mw.rules import ConfigError
from fallback_mw.store_url import is_redis_url


def check_config_extras(config: GatewayConfig) -> None:
    """The extras a loaded configuration needs: redis state, a PostgreSQL store, the httpx
    engine. The memory state, SQLite store and aiohttp engine are in the base install."""
    settings = config.gateway
    if is_redis_url(settings.state):
        extras.require("redis", extras.state_feature(settings.state))
    if settings.store is not None and settings.store.startswith(("postgresql://", "postgres://")):
        extras.require("postgres", extras.store_feature(settings.store))
    if settings.engine == "httpx":
        extras.require("httpx", 'engine = "httpx"')


def check_environment(config: GatewayConfig, environ: Mapping[str, str]) -> None:
    """Every referenced credential variable must be set and usable. Only the name is
    ever printed; every problem is named at once (not one per run)."""
    used = {name for route in config.routes for name in route.plan}
    used |= {route.shadow for route in config.routes if route.shadow is not None}
    problems = []
    for name, upstream in config.upstreams.items():
        if name in used:
            problems += rules.variable_problems(
                f"upstream {name!r}", upstream.credential_envs, environ
            )
    if problems:
        raise ConfigError("; ".join(problems))


def check_ca_file(where: str, path: str) -> None:
    """A `ca_file` must be a readable PEM bundle with at least one certificate. Not
    necessarily a CA's: an upstream's own self-signed certificate, pinned (CA:FALSE, as
    Go's generate_cert and many appliances write it), is a trust anchor OpenSSL verifies
    that upstream by; it was refused as "no CA certificate". A certificate that trusts
    nothing (a leaf another CA signed) fails at the handshake, kind `tls`, whose message
    says to set the CA that signed it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(f"{where}: ca_file {path!r} not found") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise ConfigError(
            f"{where}: ca_file {path!r} is not a readable PEM bundle ({reason})"
        ) from None
    if not stat.S_ISREG(mode):
        # OpenSSL reads it to its end: a FIFO (or a device that never ends) held `check`,
        # `routes list` and a starting gateway forever, and a running one's store reloads.
        raise ConfigError(
            f"{where}: ca_file {path!r} is not a regular file (a directory, a FIFO or a "
            "device): give the path of a PEM bundle"
        )
    try:
        context = ssl.create_default_context(cafile=path)
    except FileNotFoundError:
        raise ConfigError(f"{where}: ca_file {path!r} not found") from None
    except (OSError, ssl.SSLError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise ConfigError(
            f"{where}: ca_file {path!r} is not a readable PEM bundle ({reason})"
        ) from None
    if not context.cert_store_stats()["x509"]:
        raise ConfigError(f"{where}: ca_file {path!r} holds no certificate")


def validate(
    config: GatewayConfig, *, environ: Mapping[str, str] | None = None, check_env: bool = True
) -> GatewayConfig:
    if config.gateway.ca_file is not None:
        check_ca_file("[gateway]", config.gateway.ca_file)
    rules.check_identity_headers(
        config.gateway.tenant_header,
        config.gateway.session_header,
        stripped=(
            *config.gateway.strip_headers,
            *(u.auth_header for u in config.upstreams.values()),
        ),
    )
    for name, upstream in config.upstreams.items():
        rules.check_upstream(name, upstream, config.gateway.allow_hosts)
        if upstream.ca_file is not None:
            check_ca_file(f"upstream {name!r}", upstream.ca_file)
    ids: set[str] = set()
    for route in config.routes:
        if route.id in ids:
            raise ConfigError(f"route {route.id!r} is defined twice")
        ids.add(route.id)
        rules.check_route(route, config.upstreams)
        if (
            route.budget is not None
            and route.budget not in config.budgets
            and config.gateway.store is None
        ):
            close = difflib.get_close_matches(route.budget, list(config.budgets), n=1)
            raise ConfigError(
                f"route {route.id!r}: unknown budget {route.budget!r} "
                + (
                    f"(did you mean {close[0]!r}?)"
                    if close
                    else f"(define {budget_section(route.budget)} or use a store that has it)"
                )
            )
    check_config_extras(config)
    if check_env:
        check_environment(config, os.environ if environ is None else environ)
    _mark_validated(config)
    return config


# The models `validate` passed (by identity: an equal model may not have been):
# `as_config` hands a layer a model the Gateway (or another layer, or the caller's own
# `load_config`) already validated without a second look-up. Whether its credential
# variables were checked is the validating caller's choice: a model loaded with
# `check_env=False` (a variable set later, or rotated away) is taken as it is, and a
# credential missing at run time is a skipped candidate (SPEC §6), never a bare request.
_VALIDATED: dict[int, weakref.ref[GatewayConfig]] = {}


def _mark_validated(config: GatewayConfig) -> None:
    key = id(config)
    _VALIDATED[key] = weakref.ref(config, lambda _: _VALIDATED.pop(key, None))


def _was_validated(config: GatewayConfig) -> bool:
    entry = _VALIDATED.get(id(config))
    return entry is not None and entry() is config


def _as_written(value: Any) -> Any:
    """A model as the data it was made from, for parsing again: the fields it was given
    (an update's unknown key among them), its submodels alike; not the values it
    derives and caches (an upstream's host and port), nor the defaults it was not given
    (so `model_fields_set` reads as before)."""
    if isinstance(value, BaseModel):
        held = value.__dict__
        return {key: _as_written(held[key]) for key in value.model_fields_set if key in held}
    if isinstance(value, dict):
        return {key: _as_written(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_as_written(item) for item in value]
    return value


def parse_config(
    data: Mapping[str, Any], *, model: type[GatewayConfig] = GatewayConfig
) -> GatewayConfig:
    """`data` as a configuration; `model`: a subclass of GatewayConfig (a host's own, with
    fields of its own) when a model of it is parsed again."""
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(f"invalid configuration: {_describe(exc, data)}") from None


MAX_CONFIG_BYTES = 4 * 1024 * 1024

# `config="[gateway]\n..."` was read as a file name: "configuration file '[gateway]\n...'
# not found", the whole text repeated (its hosts, its variables' names). Never quoted back.
TOML_TEXT = (
    "config= was given TOML text, not the path of a file: config= takes the path of a TOML "
    "file, a mapping (dict) or a GatewayConfig; for TOML text, pass tomllib.loads(text)"
)


def _looks_like_toml(name: str) -> bool:
    """A name no configuration file has, but TOML text does: a table header first, or a
    `key = value` (one-line text; asked only once no file of that name could be read)."""
    return name.lstrip().startswith("[") or " = " in name


def _path_shown(path: str) -> str:
    """A path as an error names it: whole up to PATH_MAX (4096, longer than any the system
    opens), else its start and length (a 100,000-character argument was echoed whole)."""
    return path if len(path) <= 4096 else f"{path[:200]}...({len(path)} characters)"


def _refuse_a_special_file(path: Path, name: str) -> bool:
    """A device (but the null device) or a socket is refused before it is opened, as a
    `ca_file` is (check_ca_file): `/dev/zero` never ends. Whether `path` is a FIFO or a pipe: read
    without waiting for a writer to open it (`_opened`); one nothing writes to
    (`mkfifo gw.toml`, where `check`, `serve` and every admin verb blocked for ever) is
    refused once it reads empty, while a pipe with its writer (`--config <(...)`,
    `--config /dev/stdin`) is read as any file. What stat cannot read is left to the
    open, whose error says why."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    if stat.S_ISFIFO(mode):
        return True
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or _null_device(mode, path)):
        raise ConfigError(_special_file(name))
    return False


def _null_device(mode: int, path: Path) -> bool:
    """`path` is the null device (`--config /dev/null`: a script's "no configuration"),
    which reads empty at once, as an empty file does."""
    if not stat.S_ISCHR(mode):
        return False
    try:
        return os.path.samefile(path, os.devnull)
    except OSError:
        return False


def _special_file(name: str) -> str:
    return (
        f"configuration file {name} is not a regular file (a FIFO, a device or a socket): "
        "give the path of a TOML file"
    )


def _opened(path: Path, fifo: bool) -> BinaryIO:
    """`path` open for reading; a FIFO opened without waiting for a writer (a blocking
    open of one nothing writes to waited for ever), then read as usual: to its end, which
    comes at once when no writer has it open."""
    if not fifo:
        return path.open("rb")
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "rb")


def _unreadable(exc: OSError, path: Path, name: str) -> NoReturn:
    if isinstance(exc, FileNotFoundError):
        # A relative path is the server's working directory's: often not where the config
        # is (a Django FALLBACK_MW setting, a service manager's cwd). Say where it looked.
        where = "" if path.is_absolute() else f" ({_looked_for(path)})"
        raise ConfigError(f"configuration file {name} not found{where}") from None
    if isinstance(exc, IsADirectoryError):
        raise ConfigError(f"configuration file {name} is a directory, not a file") from None
    if isinstance(exc, PermissionError):
        raise ConfigError(f"configuration file {name} cannot be read (permission denied)") from None
    raise ConfigError(f"configuration file {name} cannot be read ({exc.strerror})") from None


def _looked_for(path: Path) -> str:
    try:
        return f"looked for {path.absolute()}"
    except OSError:  # asking for the current directory failed: it has been removed
        return (
            "relative to the current directory, which no longer exists (deleted or moved): "
            "give an absolute path, or run from a directory that exists"
        )


def read_config_file(path: Path) -> dict[str, Any]:
    """The TOML table in `path`; every way the file can be unreadable is one ConfigError
    naming the file and what is wrong (never its content)."""
    name = repr(_path_shown(str(path)))
    fifo = _refuse_a_special_file(path, name)
    try:
        with _opened(path, fifo) as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        if _looks_like_toml(str(path)):
            raise ConfigError(TOML_TEXT) from None
        _unreadable(exc, path, name)
    except ValueError:
        # A NUL or a lone surrogate in the path: open() raised ValueError (UnicodeEncodeError),
        # a traceback out of `Gateway(config=...)` rather than the refusal of a path.
        raise ConfigError(
            f"configuration file {name} cannot be opened: its path holds a NUL or a character "
            "that is not UTF-8 text"
        ) from None
    if fifo and not raw:  # nothing writes to it (a FIFO nobody opened), or wrote nothing
        raise ConfigError(_special_file(name))
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"configuration file {name} is larger than 4 MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"configuration file {name} is not UTF-8 text (invalid byte at offset {exc.start})"
        ) from None
    # A UTF-8 byte order mark (Notepad, PowerShell 5's `Out-File -Encoding utf8`) is not TOML:
    # tomllib's "Invalid statement (at line 1, column 1)" would point at nothing visible.
    text = text.removeprefix("\ufeff")
    try:
        # Floats keep their written digits: money fields read them exactly (model.py).
        return tomllib.loads(text, parse_float=WrittenFloat)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{name} is not valid TOML: {exc}") from None
    except RecursionError:
        # tomllib parses nested arrays and inline tables recursively: `a = [[[...]]]` some
        # thousand deep was an "unexpected internal error" (and a RecursionError to
        # `load_config`), not a refusal of the file.
        raise ConfigError(
            f"{name} nests arrays or inline tables too deeply (no key of a gateway "
            "configuration nests more than a few levels)"
        ) from None


def load_config(
    source: GatewayConfig | Mapping[str, Any] | str | os.PathLike[str],
    *,
    environ: Mapping[str, str] | None = None,
    check_env: bool = True,
) -> GatewayConfig:
    """Load and validate a configuration from a path to a TOML file, a dict or a model."""
    require_environ(environ, owner="load_config")
    if isinstance(source, GatewayConfig):
        # One `validate` passed is whole; any other is parsed again from what it holds:
        # pydantic's `model_copy(update=...)` and `model_construct` check nothing, so a copy
        # with `methods=("post",)` routed no POST and one with `plan=()` was an IndexError.
        # As its own class: a subclass's own fields are not unknown keys.
        config = (
            source
            if _was_validated(source)
            else parse_config(_as_written(source), model=type(source))
        )
    elif isinstance(source, Mapping):
        config = parse_config(source)
    elif isinstance(source, str) and "\n" in source.strip() and not os.path.lexists(source):
        # No configuration file's name, unless one is there (`--config` of a folder
        # whose name holds a newline is a path, as the command line always gives).
        raise ConfigError(TOML_TEXT)
    elif isinstance(source, str | os.PathLike) and not isinstance(os.fspath(source), bytes):
        config = parse_config(read_config_file(Path(source)))
    else:
        # Path()'s own "expected str, bytes or os.PathLike object" named neither a dict nor
        # a GatewayConfig, and bytes, which it then refused too.
        raise TypeError(
            "config must be a GatewayConfig, a dict or the path of a TOML file (str or "
            f"os.PathLike), not {type(source).__name__}"
        )
    return validate(config, environ=environ, check_env=check_env)


ConfigSource = GatewayConfig | Mapping[str, Any] | str | os.PathLike[str]


def as_config(
    source: ConfigSource, *, environ: Mapping[str, str] | None = None, check_env: bool = True
) -> GatewayConfig:
    """What every layer's `config=` takes, as `Gateway` does (SPEC §2): a path, a dict or
    a `GatewayConfig`, loaded and validated (`load_config`; `check_env=False` for a layer
    that reads no credential). A model `validate` already passed (`Gateway` hands its
    layers the one it validated) is taken as it is; one built directly
    (`GatewayConfig.model_validate(...)`, or a `model_copy(update=...)`, parsed again)
    meets the load-time refusals like a dict."""
    if isinstance(source, GatewayConfig) and _was_validated(source):
        return source
    return load_config(source, environ=environ, check_env=check_env)
