# Sourced by test.sh: make `promtool` available for tests/test_alert_rules.py, and the
# Prometheus server itself for tests/e2e/test_prometheus.py (a real Prometheus scraping
# `fallback-mw serve` with the shipped rules loaded). On Debian and Ubuntu (this project's
# CI machines) both come from the `prometheus` package, installed here when either is
# missing (as root, or through sudo without a password). Anywhere else, or when the install
# fails, the tests say so: skipped outside CI, failed under CI=true.

if { ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; } \
        && [ -z "${FALLBACK_MW_NO_APT:-}" ] && command -v apt-get >/dev/null 2>&1; then
    sudo_cmd=""
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo_cmd="sudo -n"
        else
            echo "promtool missing and no root to install it (apt-get install prometheus)" >&2
        fi
    fi
    if [ "$(id -u)" = 0 ] || [ -n "$sudo_cmd" ]; then
        echo "installing promtool (Debian package prometheus)" >&2
        if ! $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                --no-install-recommends prometheus >/dev/null 2>&1; then
            $sudo_cmd apt-get update -qq >/dev/null 2>&1 || true
            $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                --no-install-recommends prometheus >/dev/null 2>&1 \
                || echo "could not install the prometheus package (promtool)" >&2
        fi
    fi
fi
