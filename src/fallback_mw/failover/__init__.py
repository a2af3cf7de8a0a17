"""The failover rules, pure: what an attempt's outcome is (`outcome`), whether a request
may be sent again (`replay`), the next action after any outcome (`decide`); and the
attempt lifecycle (`attempt`: the gates (the breaker, then capacity), start, run, finish,
lose the race), used by the walker, its hedge and the shadow copy alike."""
