#!/usr/bin/env bash
# The whole check: ruff (lint and format), mypy (strict), lint-imports, the full pytest suite and
# the negative controls (scripts/mutants.py). Non-zero if any fails.
# Extra arguments go to pytest (e.g. ./scripts/test.sh -k walker -x).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
source scripts/promtool.sh
source scripts/chromium.sh

failed=()
echo "== ruff check, ruff format --check"
.venv/bin/ruff check src tests examples benchmarks scripts || failed+=("ruff")
.venv/bin/ruff format --check src tests examples benchmarks scripts || failed+=("ruff format")
echo "== mypy"
.venv/bin/mypy || failed+=("mypy")
echo "== lint-imports (architecture contracts in pyproject.toml)"
.venv/bin/lint-imports --no-cache || failed+=("lint-imports")
echo "== pytest"
.venv/bin/python -m pytest "$@" || failed+=("pytest")
if [ $# -eq 0 ]; then  # a full run (not a -k selection): the negative controls as code
    echo "== negative controls (scripts/mutants.py: each mutant must be caught)"
    .venv/bin/python scripts/mutants.py || failed+=("mutants")
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "all checks passed"
