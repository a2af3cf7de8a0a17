"""A schema version as the `fmw_schema` table holds it, read by the route store and by the
ledgers alike."""

from __future__ import annotations


def written_version(value: object) -> int | None:
    """`value` when it is a version some fallback_mw writes; None for one none does (text,
    a fraction, a negative number: edited by hand), which read as an internal error."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def unwritten_version(value: object, what: str) -> str:
    """The refusal of such a `value`; `what` names the schema (`the store's ledger schema`)."""
    return (
        f"{what} version reads {str(value)[:40]!r}, which no fallback_mw writes (edited "
        "by hand?): restore its row in the fmw_schema table"
    )
