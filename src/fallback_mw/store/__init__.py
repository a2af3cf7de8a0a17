"""Persistent stores: routes, faults and the budget ledger, on SQLite or PostgreSQL."""
