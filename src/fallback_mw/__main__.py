"""`python -m fallback_mw`: the same command line as `fallback-mw`."""

from __future__ import annotations

import sys

from fallback_mw.cli import main

if __name__ == "__main__":
    sys.exit(main())
