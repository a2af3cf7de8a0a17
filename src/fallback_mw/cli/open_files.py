"""serve's open-file limit. Every caller's connection and every upstream connection is a
file descriptor; systemd starts a service with a soft limit of 1024 (LimitNOFILE's
default, hard 524288), and Python keeps what it was given. A client holding a few hundred
idle connections per process then left none: until the head timeout closed them, every
new caller's connection was closed unanswered (uvloop's way out of EMFILE) or waited in
the backlog, and a request that got in could open no upstream connection (503
`host_limit`). The soft limit is the process's to raise, up to the hard one the operator
(or the host) set: `serve` raises it at start, as Go's runtime and many servers do."""

from __future__ import annotations

import contextlib

# With no hard limit (RLIM_INFINITY; not on Linux, where it is at most fs.nr_open) the
# soft one is raised this far: an "unlimited" soft limit is refused (macOS: OPEN_MAX).
_UNLIMITED_TARGET = 1_048_576


def raise_open_file_limit() -> tuple[int, int] | None:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit: (before, after) when it
    rose, None when it was there already or cannot be raised (no `resource` module, a
    platform that refuses the value: the limit stays as it was)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return None
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return soft, target
    return None
