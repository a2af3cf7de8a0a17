# Sourced by test.sh: Debian's `libnss-wrapper` (cwrap's nss_wrapper, made for testing name
# resolution) for tests/e2e/test_serve_names.py, which runs `fallback-mw serve` with
# LD_PRELOAD=libnss_wrapper.so and NSS_WRAPPER_HOSTS=FILE: its host names resolve from that
# file, through libc's getaddrinfo as every resolver path of the gateway calls it (Python's
# socket module, uvloop's libuv), without editing /etc/hosts (scripts/apt.sh says how and when).
source scripts/apt.sh
if ! ls /usr/lib/*/libnss_wrapper.so /usr/lib/libnss_wrapper.so >/dev/null 2>&1; then
    apt_install_missing libnss-wrapper "host names from a file for the name-resolution tests"
fi
