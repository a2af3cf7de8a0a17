"""What a host hands `Gateway` or a layer in place of a piece it would build (`client=`,
`health=`, `faults=`, `ledger=`, `capacity=`, `telemetry=`, `services=`, `table=`,
`environ=`), checked once, at construction: an object without the interface's methods
failed every request with an AttributeError deep in the walk. Nothing here runs per
request. The interfaces themselves are the callers' to name (this module imports none)."""

from __future__ import annotations

import functools
import inspect
import operator
import os
import sys
from collections.abc import Callable, Mapping
from typing import SupportsIndex


def _public_path(interface: type) -> str:
    """Where a user imports `interface` from: the shortest package above its module that
    exports it (`fallback_mw.budget.Ledger`, not `fallback_mw.budget.ledger.Ledger`)."""
    parts = interface.__module__.split(".")
    for end in range(1, len(parts) + 1):
        module = sys.modules.get(".".join(parts[:end]))
        if module is not None and getattr(module, interface.__name__, None) is interface:
            return f"{module.__name__}.{interface.__name__}"
    return f"{interface.__module__}.{interface.__qualname__}"


def _methods(protocol: type) -> list[str]:
    """The public methods a Protocol declares (its own and its bases')."""
    names: dict[str, None] = {}
    for base in reversed(protocol.__mro__):
        if base is object or not getattr(base, "_is_protocol", False):
            continue
        for name, member in vars(base).items():
            if not name.startswith("_") and callable(member):
                names[name] = None
    return list(names)


def _what(value: object) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def require(value: object, interface: type, *, parameter: str, owner: str) -> None:
    """Refuse `value` (TypeError naming `owner`'s `parameter` and the interface) unless it
    is None or implements `interface`: a Protocol's methods (checked by name, as
    `runtime_checkable` would), or an instance of a concrete class."""
    if value is None:
        return
    where = _public_path(interface)
    if getattr(interface, "_is_protocol", False):
        methods = _methods(interface)
        if isinstance(value, type):
            raise TypeError(
                f"{owner}: {parameter}= takes an instance implementing {where}, not the class "
                f"{value.__qualname__} itself: pass {value.__qualname__}(...)"
            )
        missing = [name for name in methods if not callable(getattr(value, name, None))]
        if missing:
            lacks = "none of them" if missing == methods else f"no {', '.join(missing)}"
            raise TypeError(
                f"{owner}: {parameter}= must implement {where} (methods: {', '.join(methods)});"
                f" {_what(value)} has {lacks}"
            )
        return
    if not isinstance(value, interface):
        article = "the class itself" if isinstance(value, type) else _what(value)
        raise TypeError(f"{owner}: {parameter}= takes a {where} instance, not {article}")


def require_client(value: object, interface: type, *, owner: str) -> None:
    """`client=`: an UpstreamClient. An httpx client or transport has a `send` / `aclose`
    of its own, with other arguments: it is wrapped, never taken as one."""
    httpx_made = type(value).__module__.split(".")[0] == "httpx"
    if value is not None and (httpx_made or hasattr(value, "handle_async_request")):
        raise TypeError(
            f"{owner}: client= takes a {_public_path(interface)}, not {_what(value)}: wrap an "
            "httpx transport as fallback_mw.upstream.httpx_engine.HttpxClient(transport=...)"
        )
    require(value, interface, parameter="client", owner=owner)


def require_callable(value: object, *, parameter: str, owner: str, takes: str) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{owner}: {parameter}= takes {takes}, not {_what(value)}")


def require_app(value: object, *, owner: str) -> None:
    """The ASGI app a layer wraps: a callable. An import string (`"main:app"`, as uvicorn
    takes it) or None failed only at the first request no route took, far from the
    mistake ("'str' object is not callable")."""
    wraps = (
        f"{owner}: its first argument is the ASGI app it wraps (a callable: FastAPI(), "
        "Starlette(), Django's get_asgi_application())"
    )
    if not callable(value):
        raise TypeError(f"{wraps}, not {_what(value)}")
    # `Gateway(FastAPI, ...)`, or `Gateway(get_asgi_application, ...)` in a Django asgi.py:
    # callable too, so routed requests were served and every other one was a 500 far from
    # the mistake ("get_asgi_application() takes 0 positional arguments but 3 were given").
    if isinstance(value, type) and any("__call__" in vars(base) for base in value.__mro__[:-1]):
        name = value.__qualname__
        if _binds(_instance_call(value), 3) and not _binds(_instance_call(value), 4):
            # (self, receive, send): made with the scope, as Channels 2's consumers.
            raise TypeError(f"{wraps}, not the class {name}, an ASGI 2 app{_as_asgi3(name)}")
        raise TypeError(f"{wraps}, not the class {name} itself: pass {name}(...)")
    if not isinstance(value, type) and not _takes_scope_receive_send(value):
        name = getattr(value, "__qualname__", None) or _what(value)
        # Called with the scope alone: an ASGI 2 app, or a factory of one argument.
        asgi2 = f", or if it is an ASGI 2 app{_as_asgi3(name)}" if _binds(value, 1) else ""
        raise TypeError(
            f"{wraps}, not {name}, which cannot be called as an ASGI app (scope, receive, "
            f"send): pass the app itself ({name}() if {name} makes it){asgi2}"
        )


def _as_asgi3(name: str) -> str:
    # An ASGI 2 app was never served here: the layers call their app as ASGI 3 does.
    return (
        " (called with the scope alone, its answer with receive and send), wrap it as "
        f"ASGI 3: asgiref.compatibility.guarantee_single_callable({name})"
    )


def _instance_call(cls: type) -> Callable[..., object] | None:
    """The `__call__` its instances run, unbound (None when not a plain function)."""
    found = next(vars(base)["__call__"] for base in cls.__mro__ if "__call__" in vars(base))
    return found if inspect.isfunction(found) else None


def _binds(app: Callable[..., object] | None, count: int) -> bool:
    """Whether `app` can be called with `count` positional arguments (False when its
    signature cannot be read)."""
    if app is None:
        return False
    try:
        inspect.signature(_called(app)).bind(*[None] * count)
    except (TypeError, ValueError):
        return False
    return True


def _takes_scope_receive_send(app: Callable[..., object]) -> bool:
    """Whether `app` can be called with three positional arguments, as a server calls an
    ASGI app; True when its signature cannot be read (a builtin, a C extension's)."""
    try:
        inspect.signature(_called(app)).bind(None, None, None)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def _called(app: Callable[..., object]) -> Callable[..., object]:
    """What `app(...)` runs. For an instance, its class's `__call__` as a call binds it:
    inspect.signature drops the first parameter of any `__call__` as `self`, also of a
    staticmethod's, a classmethod's (already bound) or a callable without `__get__`
    (called as it is), and cannot read a slot's (sentry_sdk's SentryAsgiMiddleware sets
    its `__call__` slot to a bound method): such an app was refused for its `scope`."""
    if isinstance(app, type) or inspect.isroutine(app) or isinstance(app, functools.partial):
        return app
    for base in type(app).__mro__:
        found = vars(base).get("__call__")
        if found is not None:
            if isinstance(found, functools.partial) and sys.version_info < (3, 14):
                # Called as it is before 3.14; asking its __get__ warned on 3.13
                # (FutureWarning: "will be a method descriptor"), an error under -W error.
                return found
            bind = getattr(type(found), "__get__", None)
            return found if bind is None else bind(found, app, type(app))  # type: ignore[no-any-return]
    return app


def require_environ(value: object, *, owner: str) -> None:
    if value is not None and not isinstance(value, Mapping):
        raise TypeError(
            f"{owner}: environ= takes a mapping of environment variables (os.environ, a dict), "
            f"not {_what(value)}"
        )
    if value is None or value is os.environ:
        return
    # A value that is not text (a pydantic-settings SecretStr, bytes, a number) failed deep
    # in the configuration's checks: "'SecretStr' object has no attribute 'encode'".
    for name, held in value.items():
        if held is not None and not isinstance(held, str):
            hint = " (pass its .get_secret_value())" if hasattr(held, "get_secret_value") else ""
            raise TypeError(
                f"{owner}: environ= maps each variable to its value as text; {name!r} holds "
                f"{_what(held)}{hint}"
            )


def count_option(value: SupportsIndex, *, parameter: str, owner: str) -> int:
    """An engine's `max_connections=`: an int (anything with `__index__`, as `range` takes),
    never a bool, a float or a Decimal. Checked here in either build: compiled, an `int`
    parameter refused a float in mypyc's words, and the pure build took it."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{owner}: {parameter}= takes an int, not {_what(value)}")


def path_option(value: str | os.PathLike[str] | None, *, parameter: str, owner: str) -> str | None:
    """An engine's `ca_file=`: None, or a path as text or an `os.PathLike` of one
    (`pathlib.Path`), as the configuration's `ca_file` takes it; its text."""
    if value is None:
        return None
    path = os.fspath(value) if isinstance(value, str | os.PathLike) else None
    if not isinstance(path, str):
        raise TypeError(
            f"{owner}: {parameter}= takes the path of a PEM file (str or os.PathLike), not "
            f"{_what(value)}"
        )
    return path
