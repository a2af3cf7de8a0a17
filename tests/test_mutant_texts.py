"""scripts/mutants.py's negative controls still apply: each mutation's text is found exactly
once in src/, and each test it names exists. A change that rewrites a guarded line (the
shadow copy's `rendered` body, beside the model rewrite) made the whole script stop with
"the text to mutate is found 0 times" (exit 2): no control ran, for any guard. Checked
here without running a mutant (seconds, not minutes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.pure_pass_only(
    reason="scripts/mutants.py's texts found in src/; nothing of the package runs"
)

ROOT = Path(__file__).resolve().parent.parent


def mutants_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fmw_mutants", ROOT / "scripts" / "mutants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_every_mutation_finds_its_text_once_and_names_tests_that_exist() -> None:
    script = mutants_script()
    missing = []
    for mutant in script.MUTANTS:
        for path, find, _ in mutant.edits:
            found = (script.SRC / path).read_text(encoding="utf-8").count(find)
            if found != 1:
                missing.append(f"{mutant.name}: {path}: found {found} times: {find!r}")
        for test in mutant.tests:
            file, _, name = test.partition("::")
            source = ROOT / file
            if not source.is_file() or f"def {name.split('[')[0]}(" not in source.read_text(
                encoding="utf-8"
            ):
                missing.append(f"{mutant.name}: no test {test}")
    assert missing == []
