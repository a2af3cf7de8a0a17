#!/usr/bin/env bash
# The demo: a failing primary, a backup and the gateway on loopback ports; exits when done.
# Arguments go to `fallback-mw demo` (--port P: the gateway on P, the upstreams on P+1, P+2).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
exec .venv/bin/python -m fallback_mw demo "$@"  # e.g. --port 8000
