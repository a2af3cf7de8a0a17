"""Header hygiene and the upstream address checks: the caller's request head as forwarded
(`fields`), query strings (`queries`), what a field or query may hold to be sent
(`values`), the upstream's answer as relayed (`answers`), and the upstream addresses the
gateway may contact (`addresses`: the allowlist, link-local / metadata refusal)."""
