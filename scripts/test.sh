#!/usr/bin/env bash
# The whole check: ruff (lint and format), mypy (strict), lint-imports, the full pytest suite and
# the negative controls (scripts/mutants.py); on a full run, the pytest suite once more against
# the compiled core (scripts/compile.py --out build/compiled --pgo). Non-zero if any fails.
# Extra arguments go to pytest (e.g. ./scripts/test.sh -k walker -x).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
# Said before anything is installed: what leaves .venv, and why.
if [ -z "${FALLBACK_MW_NO_APT:-}" ]; then
    echo "test.sh: three system tools come from Debian packages, installed with apt-get only" \
         "when missing and only as root or with passwordless sudo:" >&2
    echo "  prometheus  its promtool checks the shipped alert rules (tests/test_alert_rules.py);" \
         "the server scrapes a real serve with them loaded (tests/e2e/test_prometheus.py)" >&2
    echo "  chromium    headless, renders the eval / gameday HTML reports (tests/browser.py)" >&2
    echo "  libnss-wrapper  host names from a file for serve's name-resolution tests" \
         "(tests/e2e/test_serve_names.py)" >&2
    echo "  (FALLBACK_MW_NO_APT=1 installs none: those tests skip, or fail under CI=true)" >&2
fi
source scripts/promtool.sh
source scripts/chromium.sh
source scripts/nss_wrapper.sh

# On a full run the compiled core (below) is built from the start, in the background and at
# a low priority: its build (mypyc, then one C compile of minutes) uses a single core,
# beside mypy (another single one) and the pure pass, whose tests wait on sockets, timers
# and subprocesses much of the time; the compiled pass waits for it.
build_missing=""
build_pid=""
build_started=$SECONDS
if [ $# -eq 0 ]; then
    include=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    command -v "${CC:-cc}" >/dev/null 2>&1 || build_missing="a C compiler (${CC:-cc})"
    [ -f "$include/Python.h" ] ||
        build_missing="${build_missing:+$build_missing, }the Python headers ($include)"
    [ -x .venv/bin/mypyc ] ||
        build_missing="${build_missing:+$build_missing, }mypyc (the dev extra's mypy)"
    if [ -z "$build_missing" ]; then
        mkdir -p build
        # In a process group of its own (mypyc and the C compiler under it), stopped whole
        # when this script ends before the compiled pass waited for it: a failed step, or
        # an interrupt (Ctrl-C or SIGTERM, which now end the whole check). A SIGTERM to this
        # script alone, not to its process group, ends it once the step running has ended
        # (bash runs a trap after its foreground command): pytest runs on to its end.
        setsid nice -n 10 .venv/bin/python scripts/compile.py --out build/compiled --pgo \
            > build/compile.log 2>&1 &
        build_pid=$!
        trap '[ -z "$build_pid" ] || kill -- "-$build_pid" 2>/dev/null || true' EXIT
        trap 'exit 130' INT
        trap 'exit 143' TERM
    fi
fi

failed=()
echo "== ruff check, ruff format --check"
.venv/bin/ruff check src tests examples benchmarks scripts || failed+=("ruff")
.venv/bin/ruff format --check src tests examples benchmarks scripts || failed+=("ruff format")
echo "== mypy"
.venv/bin/mypy || failed+=("mypy")
echo "== lint-imports (architecture contracts in pyproject.toml)"
.venv/bin/lint-imports --no-cache || failed+=("lint-imports")
echo "== pytest"
# On FMW_TEST_WORKERS processes (default 3; 0 runs in this one), each taking whole test
# files: a module's shared servers and fixtures stay in one process. Each test has its own
# Redis key prefix and PostgreSQL database, so workers share the services safely. The files
# go out in tests/conftest.py's order (the slowest-marked first), not xdist's (most tests
# first), so that no minutes-long file starts last and alone.
.venv/bin/python -m pytest -n "${FMW_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder \
    "$@" || failed+=("pytest")
if [ $# -eq 0 ]; then
    # The aiohttp engine on ClientSession.request, the path it keeps under an aiohttp
    # release its own request path (upstream/aiohttp_request.py) was not read against: the
    # engine's files of real-socket tests once more on it (tests/conftest.py).
    echo "== pytest (the aiohttp engine on ClientSession.request)"
    FMW_TEST_AIOHTTP_SESSION_PATH=1 .venv/bin/python -m pytest -n "${FMW_TEST_WORKERS:-3}" \
        --dist loadfile --no-loadscope-reorder -q \
        tests/test_stale_connections.py tests/test_upstream_pool.py tests/test_relay_ends.py \
        tests/test_connection_loss.py tests/test_cancel_anywhere.py tests/test_pool_returned.py \
        tests/test_own_engine.py tests/test_gateway.py tests/test_walker.py \
        tests/hostile/test_early_answers.py tests/hostile/test_request_bodies.py \
        tests/hostile/test_egress_proxy.py tests/hostile/test_hostile_upstreams.py \
        tests/hostile/test_fuzz_engines.py tests/e2e/test_tls_upstreams.py \
        tests/test_aiohttp_request_path.py \
        || failed+=("pytest (ClientSession.request)")
fi
if [ $# -eq 0 ]; then  # a full run (not a -k selection): the negative controls as code
    echo "== negative controls (scripts/mutants.py: each mutant must be caught)"
    .venv/bin/python scripts/mutants.py || failed+=("mutants")
fi

# The compiled core is a build of its own (the request path's modules as C extensions): the
# whole suite again against a compiled copy of the package in build/compiled, imported ahead
# of the editable install through PYTHONPATH (serve and the CLI started by tests inherit it).
# FMW_TEST_COMPILED makes tests/conftest.py refuse a pass that imports the pure package.
# The copy is rebuilt only when its sources changed (compile.py keeps their digest).
compiled_pass() {
    if [ -n "$build_missing" ]; then
        local missing=$build_missing
        if [ "${CI:-}" = "true" ]; then
            echo "test.sh: missing $missing: the compiled core cannot be built" >&2
            failed+=("pytest (compiled core)")
        else
            echo "test.sh: missing $missing: the compiled core's pass is skipped (under CI=true it fails)" >&2
        fi
        return 0
    fi
    local started=$SECONDS
    local built=0
    wait "$build_pid" || built=$?
    build_pid=""
    echo "test.sh: waited $((SECONDS - started)) s for the compiled core's build" \
         "(begun $((started - build_started)) s before, beside the checks above)"
    if [ "$built" -ne 0 ]; then
        tail -n 30 build/compile.log >&2
        echo "test.sh: scripts/compile.py --out build/compiled failed (build/compile.log)" >&2
        failed+=("pytest (compiled core)")
        return 0
    fi
    tail -n 1 build/compile.log
    # Less the two tests that build and install wheels in fresh environments (the pure
    # wheel at its lowest dependencies, the compiled wheel through pip's isolated build):
    # what they test does not depend on the build in this checkout, and the pure pass ran them.
    # tests/conftest.py also leaves out those marked pure_pass_only (nothing of the package
    # runs in them: the source parsed, wheels built from the tree; each marker says why).
    PYTHONPATH="$PWD/build/compiled${PYTHONPATH:+:$PYTHONPATH}" FMW_TEST_COMPILED=1 \
        .venv/bin/python -m pytest -n "${FMW_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder \
        --ignore tests/test_fresh_install.py --ignore tests/test_compiled_wheel.py \
        || failed+=("pytest (compiled core)")
    echo "test.sh: the compiled core's pass took $((SECONDS - started)) s (the wait for its build included)"
}
if [ $# -eq 0 ]; then
    echo "== pytest (compiled core)"
    mkdir -p build
    compiled_pass
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "all checks passed"
