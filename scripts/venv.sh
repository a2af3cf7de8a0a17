# Sourced by demo.sh and test.sh from the repository root: create .venv with Python 3.11
# when missing, and install the package with its dev extra into it. The install is skipped
# while pyproject.toml (and the checkout's location) are unchanged since the last one.

pick_python() {
    for candidate in "${PYTHON:-}" python3.11 python3; do
        [ -n "$candidate" ] || continue
        command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    echo "error: Python 3.11 or newer is needed (set PYTHON=/path/to/python3.11)" >&2
    return 1
}

if [ ! -x .venv/bin/python ]; then
    python=$(pick_python)
    echo "creating .venv with $python" >&2
    "$python" -m venv .venv
fi

stamp=.venv/.fallback_mw-install
wanted="$( (cat pyproject.toml; pwd) | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
    echo "installing fallback_mw and its dev dependencies into .venv" >&2
    .venv/bin/python -m pip install --quiet --quiet --disable-pip-version-check -e '.[dev]'
    echo "$wanted" > "$stamp"
fi
