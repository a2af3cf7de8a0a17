"""STYLE.md's shape of the code, held by the source. Every ASGI middleware class in src/
takes the app it wraps first and positional-only and its options keyword-only
(`__init__(self, app, /, *, ...)`, as Starlette's middleware does), and is called as a
coroutine function (`async def __call__`, or a module coroutine assigned to `__call__` as
the plan walker's is). What only the command line uses lives under cli/ (no module beside
the request path that only the command tree imports; grimp's graph, as import-linter's).
Every local error is sent by the shared writer (no layer starts a response of its own
making). No module is over 400 lines. Seconds: the source is parsed, nothing is served.
Each checker is checked on planted code."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

pytestmark = pytest.mark.pure_pass_only(
    reason="the source is parsed and grimp's import graph read; nothing of the package runs"
)

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "fallback_mw"

# The classes the checker must find (a checker that finds none passes vacuously).
LAYERS = {"Gateway", "RouteResolver", "BudgetGuard", "CredentialInjector", "PlanWalker"}


def _coroutines(tree: ast.Module) -> set[str]:
    return {node.name for node in tree.body if isinstance(node, ast.AsyncFunctionDef)}


def _wraps_an_app(init: ast.FunctionDef) -> bool:
    """An `__init__` taking the app it wraps, in whatever place."""
    args = init.args
    return any(arg.arg == "app" for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs])


def layer_problems(source: str) -> dict[str, list[str]]:
    """Each ASGI middleware class in `source` (its `__init__` takes the `app` it wraps),
    with what its shape breaks. An ASGI app that wraps none (the configuration refusal)
    is no middleware."""
    tree = ast.parse(source)
    coroutines = _coroutines(tree)
    found: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        init: ast.FunctionDef | None = None
        call: ast.stmt | None = None
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                init = item
            elif isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                if item.name == "__call__":
                    call = item
            elif isinstance(item, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "__call__" for target in item.targets
            ):
                call = item
        if init is None or not _wraps_an_app(init):
            continue
        problems = found.setdefault(node.name, [])
        args = init.args
        if [arg.arg for arg in args.posonlyargs] != ["self", "app"]:
            problems.append("`app` is not the only positional-only parameter after self")
        if args.args or args.vararg is not None:
            problems.append("options are not keyword-only (`*` after `app, /`)")
        if isinstance(call, ast.AsyncFunctionDef):
            continue
        if isinstance(call, ast.Assign) and isinstance(call.value, ast.Name):
            if call.value.id not in coroutines:
                problems.append(f"__call__ = {call.value.id}, not a module coroutine")
        else:
            problems.append("__call__ is not a coroutine function")
    return found


def test_every_asgi_layer_takes_the_app_positional_only_and_options_keyword_only() -> None:
    shapes: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name, problems in layer_problems(path.read_text(encoding="utf-8")).items():
            shapes[f"{path.relative_to(PACKAGE)}:{name}"] = problems
    assert {key.rsplit(":", 1)[1] for key in shapes} >= LAYERS, shapes
    assert {key: problems for key, problems in shapes.items() if problems} == {}


PLANTED = {
    "app keyword-able": """
class Layer:
    def __init__(self, app, *, config): ...
    async def __call__(self, scope, receive, send): ...
""",
    "options positional": """
class Layer:
    def __init__(self, app, /, config): ...
    async def __call__(self, scope, receive, send): ...
""",
    "a synchronous __call__": """
class Layer:
    def __init__(self, app, /, *, config): ...
    def __call__(self, scope, receive, send): ...
""",
    "app keyword-only": """
class Layer:
    def __init__(self, *, app, config): ...
    async def __call__(self, scope, receive, send): ...
""",
    "no __call__": """
class Layer:
    def __init__(self, app, /, *, config): ...
""",
    "__call__ a plain function": """
def serve(self, scope, receive, send): ...
class Layer:
    def __init__(self, app, /, *, config): ...
    __call__ = serve
""",
}


@pytest.mark.parametrize("shape", sorted(PLANTED))
def test_the_checker_finds_each_planted_shape(shape: str) -> None:
    assert layer_problems(PLANTED[shape])["Layer"], shape


def test_the_checker_passes_the_anchors_shape() -> None:
    source = """
async def serve(self, scope, receive, send): ...
class Layer:
    def __init__(self, app, /, *, config): ...
    async def __call__(self, scope, receive, send): ...
class Walker:
    def __init__(self, app, /, *, config): ...
    __call__ = serve
class NotALayer:
    def __init__(self, limit): ...
class AnAppNotAMiddleware:
    def __init__(self, error): ...
    async def __call__(self, scope, receive, send): ...
"""
    assert layer_problems(source) == {"Layer": [], "Walker": []}


def cli_only(graph: grimp.ImportGraph) -> dict[str, list[str]]:
    """Modules outside `fallback_mw.cli` that only the command tree imports, with their
    importers (a module nothing imports, a package or an entry point, is not one)."""
    found: dict[str, list[str]] = {}
    for module in sorted(graph.modules):
        if not module.startswith("fallback_mw.") or module.startswith("fallback_mw.cli"):
            continue
        importers = graph.find_modules_that_directly_import(module)
        if importers and all(name.startswith("fallback_mw.cli") for name in importers):
            found[module] = sorted(importers)
    return found


def test_what_only_the_command_line_uses_lives_under_cli() -> None:
    # STYLE.md: evaluation, game days, one request, serve's server guard, the OTel setup
    # live under cli/; the import-linter contract keeps the request path from importing
    # them, this keeps what only they use from sitting beside the request path.
    assert cli_only(grimp.build_graph("fallback_mw")) == {}


def test_the_cli_check_sees_a_planted_module() -> None:
    graph = grimp.ImportGraph()
    graph.add_import(importer="fallback_mw.cli.serve", imported="fallback_mw.serve_guard")
    graph.add_import(importer="fallback_mw.cli.serve", imported="fallback_mw.gateway")
    graph.add_import(importer="fallback_mw.django", imported="fallback_mw.gateway")
    assert cli_only(graph) == {"fallback_mw.serve_guard": ["fallback_mw.cli.serve"]}
    graph.add_import(importer="fallback_mw.gateway", imported="fallback_mw.serve_guard")
    assert cli_only(graph) == {}


# Where a response may start (an `http.response.start` message is built): the shared
# local-error writer and the configuration refusal (below all four layers), the relay of an
# upstream's answer, and the gateway's own answer to a Max-Forwards: 0 (TRACE / OPTIONS).
RESPONSE_STARTS = {
    "request/local_errors.py",
    "request/config_refusal.py",
    "layers/walker/stream.py",
    "layers/walker/max_forwards.py",
}


def starts_a_response(source: str) -> bool:
    """Whether `source` builds an `http.response.start` message (a dict literal holding it)."""
    return any(
        isinstance(node, ast.Dict)
        and any(
            isinstance(value, ast.Constant) and value.value == "http.response.start"
            for value in node.values
        )
        for node in ast.walk(ast.parse(source))
    )


def test_every_local_error_goes_through_the_shared_writer() -> None:
    # STYLE.md: each layer answers for itself, through the shared local-error writer (its
    # JSON shape, the rule, the gateway headers); the command tree's own servers aside.
    starting = {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "cli" not in path.relative_to(PACKAGE).parts
        and starts_a_response(path.read_text(encoding="utf-8"))
    }
    assert starting == RESPONSE_STARTS


def test_the_response_check_sees_a_planted_start() -> None:
    planted = 'async def refuse(send):\n    await send({"type": "http.response.start"})\n'
    assert starts_a_response(planted)
    assert not starts_a_response('if message["type"] == "http.response.start": pass\n')


MAX_LINES = 400  # a module read in one sitting; past it, split by decision (STYLE.md)


def test_every_module_is_small_enough_to_read_in_one_sitting() -> None:
    lines = {
        str(path.relative_to(PACKAGE)): len(path.read_text(encoding="utf-8").splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    assert len(lines) > 100  # the package itself was read
    assert {module: n for module, n in lines.items() if n > MAX_LINES} == {}


FOUR = ("resolver", "guard", "injector", "walker")


def shared_in_layers(graph: grimp.ImportGraph) -> dict[str, list[str]]:
    """Modules in fallback_mw.layers beside the four layers' own that more than one layer
    imports (directly or through others), with those layers."""

    def layer_of(module: str) -> str | None:
        parts = module.split(".")
        if parts[:2] == ["fallback_mw", "layers"] and len(parts) > 2 and parts[2] in FOUR:
            return parts[2]
        return None

    shared: dict[str, list[str]] = {}
    for module in sorted(graph.modules):
        if not module.startswith("fallback_mw.layers.") or layer_of(module) is not None:
            continue
        users = {layer_of(name) for name in graph.find_downstream_modules(module)} - {None}
        if len(users) > 1:
            shared[module] = sorted(str(user) for user in users)
    return shared


def test_what_several_layers_need_lives_below_them() -> None:
    # STYLE.md: the per-request context, the body reader, the local-error writer... live
    # below all four; a helper beside them in layers/ is one layer's own (the resolver's
    # head and limits, the guard's refusals). The independence contract in pyproject.toml
    # does not see two layers sharing a third module.
    assert shared_in_layers(grimp.build_graph("fallback_mw")) == {}


def test_the_shared_check_sees_a_planted_helper() -> None:
    graph = grimp.ImportGraph()
    graph.add_import(importer="fallback_mw.layers.resolver", imported="fallback_mw.layers.head")
    graph.add_import(
        importer="fallback_mw.layers.walker.walk", imported="fallback_mw.layers.walker.stream"
    )
    assert shared_in_layers(graph) == {}
    graph.add_import(
        importer="fallback_mw.layers.walker.preflight", imported="fallback_mw.layers.head"
    )
    assert shared_in_layers(graph) == {"fallback_mw.layers.head": ["resolver", "walker"]}
