# Sourced by test.sh: make a headless `chromium` available for the tests that open the
# HTML report pages of `eval` and `gameday` (tests/browser.py), from Debian's `chromium`
# package when missing (scripts/apt.sh says how and when).
source scripts/apt.sh
apt_install_missing chromium "headless report tests" chromium chromium-browser
