"""The failover rules (`decide`: the SPEC §5 rules, pure) and the attempt lifecycle
(`attempt`: the gates (the breaker, then capacity), start, run, finish, lose the race),
used by the walker, its hedge and the shadow copy alike."""
