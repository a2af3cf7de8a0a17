# Sourced by test.sh: make a headless `chromium` available for the tests that open the
# HTML report pages of `eval` and `gameday` (tests/browser.py). On Debian and Ubuntu (this
# project's CI machines) it comes from the `chromium` package, installed here when missing
# (as root, or through sudo without a password). Anywhere else, or when the install fails,
# the tests say so: skipped outside CI, failed under CI=true.

if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
        && [ -z "${FALLBACK_MW_NO_APT:-}" ] && command -v apt-get >/dev/null 2>&1; then
    sudo_cmd=""
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo_cmd="sudo -n"
        else
            echo "chromium missing and no root to install it (apt-get install chromium)" >&2
        fi
    fi
    if [ "$(id -u)" = 0 ] || [ -n "$sudo_cmd" ]; then
        echo "installing chromium (Debian package chromium, headless report tests)" >&2
        if ! $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                --no-install-recommends chromium >/dev/null 2>&1; then
            $sudo_cmd apt-get update -qq >/dev/null 2>&1 || true
            $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                --no-install-recommends chromium >/dev/null 2>&1 \
                || echo "could not install the chromium package" >&2
        fi
    fi
fi
