#!/usr/bin/env bash
# The demo: a failing primary, a backup and the gateway on loopback ports; exits when done.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
exec .venv/bin/python -m fallback_mw demo
