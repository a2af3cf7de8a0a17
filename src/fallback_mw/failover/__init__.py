"""The failover rules (`decide`, every SPEC §5 rule, pure) and the attempt lifecycle
(`attempt`: admission, start, run, finish, lose the race), used by the walker, its hedge
and the shadow copy alike."""
