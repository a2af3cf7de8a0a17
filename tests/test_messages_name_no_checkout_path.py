"""What the package says to its users (errors, warnings, help, local error bodies) names no
file of the source checkout: `pip install fallback_mw` installs no `docs/` directory, so a
warning that said "see Upgrading in docs/operations.md" sent an installed user to a file
they do not have. A message says what to do itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fallback_mw

pytestmark = pytest.mark.pure_pass_only(
    reason="the package's .py sources are parsed; nothing of the package runs"
)

PACKAGE = Path(fallback_mw.__file__).parent


def _docstrings(tree: ast.AST) -> set[int]:
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def test_no_message_of_the_package_names_a_file_of_the_checkout() -> None:
    named: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and ("docs/" in node.value or ".md" in node.value)
            ):
                named.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}")
    assert not named, "\n".join(named)
