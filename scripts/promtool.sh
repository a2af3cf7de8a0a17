# Sourced by test.sh: make `promtool` available for tests/test_alert_rules.py, and the
# Prometheus server itself for tests/e2e/test_prometheus.py (a real Prometheus scraping
# `fallback-mw serve` with the shipped rules loaded), from Debian's `prometheus` package
# when either is missing (scripts/apt.sh says how and when).
source scripts/apt.sh
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    apt_install_missing prometheus "promtool and the server for the alert-rule tests"
fi
