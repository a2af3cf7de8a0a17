"""An outage of a shared dependency (a store, a ledger) is logged twice: one WARNING when it
starts, one when it ends. Whatever fails in between (every request, every retry) is only
at DEBUG, so a PostgreSQL restart under traffic is two lines in the log, not one per
request, and never a traceback."""

from __future__ import annotations

import logging


class OutageLog:
    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.logger = logger
        self.what = what
        self.down = False

    def failed(self, reason: str, consequence: str = "") -> None:
        """A call failed; logs only when the outage starts."""
        if self.down:
            self.logger.debug("%s still unreachable (%s)", self.what, reason)
            return
        self.down = True
        suffix = f": {consequence}" if consequence else ""
        self.logger.warning("%s unreachable (%s)%s", self.what, reason, suffix)

    def recovered(self) -> None:
        """A call succeeded; logs only when it ends an outage."""
        if self.down:
            self.down = False
            self.logger.warning("%s reachable again", self.what)
