"""The `fallback-mw` command: `serve`, `demo`, and the admin verbs other modules register.

Admin verbs (`routes`, `faults`, `budgets`, `usage`) live in their own modules, each exposing
`register(subparsers)`; they are imported when present so this module never depends on them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from fallback_mw.config import ConfigError
from fallback_mw.types import Receive, Scope, Send

# Modules that add subcommands with `register(subparsers)`, in help order.
ADMIN_MODULES = ("fallback_mw.cli_admin", "fallback_mw.budget.cli", "fallback_mw.cli_request")

Handler = Callable[[argparse.Namespace], int]


def _fail(message: str) -> int:
    """A refusal: one line on stderr, exit status 2, nothing started."""
    print(f"fallback-mw: error: {message}", file=sys.stderr)
    return 2


async def not_found_app(scope: Scope, receive: Receive, send: Send) -> None:
    """The bare host app behind `serve`: a plain 404 for anything no route matched."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] == "websocket":
        # Refuse the handshake explicitly (the server answers 403). Returning without a
        # message would make the server log an error and answer 500.
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008})
        return
    if scope["type"] != "http":
        return
    body = b"Not Found\n"
    await send(
        {
            "type": "http.response.start",
            "status": 404,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def server_options() -> dict[str, str]:
    """uvloop and httptools when installed, uvicorn's automatic choice otherwise."""
    return {
        "loop": "uvloop" if _importable("uvloop") else "auto",
        "http": "httptools" if _importable("httptools") else "auto",
    }


def _configure_logging() -> None:
    # One line per routed request (fallback_mw.request); names and codes only.
    root = logging.getLogger("fallback_mw")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


def _configure_telemetry() -> Any:
    """OpenTelemetry from the OTEL_* variables, when this build has the setup module.
    Returns its handle (with `shutdown()`), or None."""
    try:
        otel_setup = importlib.import_module("fallback_mw.otel_setup")
    except ModuleNotFoundError:
        return None
    configure = getattr(otel_setup, "configure_from_env", None)
    return configure() if callable(configure) else None


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from fallback_mw.config import load_config
    from fallback_mw.gateway import Gateway

    # Every refusal happens here, before a socket is opened.
    try:
        config = load_config(args.config)
        gateway = Gateway(not_found_app, config=config)
    except ConfigError as exc:
        return _fail(str(exc))
    _configure_logging()
    try:
        telemetry = _configure_telemetry()
    except Exception as exc:
        # The setup module's own refusal (e.g. an unknown OTEL_TRACES_EXPORTER): exit 2.
        setup_error = getattr(sys.modules.get("fallback_mw.otel_setup"), "TelemetrySetupError", ())
        if isinstance(exc, setup_error):
            return _fail(str(exc))
        raise
    try:
        uvicorn.run(
            gateway,
            host=args.host,
            port=args.port,
            lifespan="on",
            # uvicorn's access log prints query strings; our request log line replaces it.
            access_log=False,
            **server_options(),  # type: ignore[arg-type]
        )
    finally:
        if telemetry is not None:
            telemetry.shutdown()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from fallback_mw.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fallback-mw",
        description="An ASGI API / LLM gateway with ordered failover.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True

    serve = subparsers.add_parser("serve", help="run the gateway on uvicorn")
    serve.add_argument("--config", required=True, metavar="FILE", help="gateway TOML file")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="bind port (default 8000)")
    serve.set_defaults(handler=cmd_serve)

    demo = subparsers.add_parser(
        "demo", help="show failover, the POST rule and a budget on loopback ports, then exit"
    )
    demo.set_defaults(handler=cmd_demo)

    for module_name in ADMIN_MODULES:
        register = _admin_register(module_name)
        if register is not None:
            register(subparsers)
    return parser


def _admin_register(module_name: str) -> Callable[[Any], None] | None:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            return None  # not part of this build
        # The module exists but is broken: say so, and keep `serve` and `demo` usable.
        print(f"fallback-mw: warning: {module_name} not loaded: {exc}", file=sys.stderr)
        return None
    register = getattr(module, "register", None)
    return register if callable(register) else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except ConfigError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 130
