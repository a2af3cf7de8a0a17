# Sourced by promtool.sh and chromium.sh: `apt_install_missing PACKAGE WHAT COMMAND...`
# installs the Debian PACKAGE when none of the COMMANDs (if any are given) is on PATH (as root, or through sudo
# without a password), unless FALLBACK_MW_NO_APT is set or there is no apt-get. Anywhere
# else, or when the install fails, it says so and the tests that need it say why: skipped
# outside CI, failed under CI=true.

apt_install_missing() {
    local package=$1 what=$2
    shift 2
    local command
    for command in "$@"; do
        command -v "$command" >/dev/null 2>&1 && return 0
    done
    [ -z "${FALLBACK_MW_NO_APT:-}" ] && command -v apt-get >/dev/null 2>&1 || return 0
    local sudo_cmd=""
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo_cmd="sudo -n"
        else
            echo "$package missing and no root to install it (apt-get install $package)" >&2
            return 0
        fi
    fi
    echo "installing $package (Debian package, $what)" >&2
    if ! $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends "$package" >/dev/null 2>&1; then
        $sudo_cmd apt-get update -qq >/dev/null 2>&1 || true
        $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends "$package" >/dev/null 2>&1 \
            || echo "could not install the $package package" >&2
    fi
    return 0
}
