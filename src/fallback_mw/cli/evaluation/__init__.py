"""`fallback-mw eval`: the route-plan evaluation. Four arms over real loopback sockets —
(1) failing primary, single upstream; (2) failing primary, ordered plan; (3) all healthy,
single upstream; (4) all healthy, ordered plan — reporting per arm the success rate,
attempts per request, fallbacks, latency percentiles and body-integrity failures."""
