"""Store URLs: `sqlite:///relative.db`, `sqlite:////abs/path.db`, `postgresql://...`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class StoreURL:
    kind: Literal["sqlite", "postgresql"]
    target: str  # a file path for SQLite, the DSN for PostgreSQL

    def __str__(self) -> str:
        # For messages: never print a password.
        if self.kind == "sqlite":
            return f"sqlite:///{self.target}"
        return redact_url(self.target)


class StoreURLError(ValueError):
    pass


def redact_url(url: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    if parts.username:
        netloc = f"{parts.username}@{netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def parse_store_url(url: str) -> StoreURL:
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///") :]
        if not path:
            raise StoreURLError("sqlite store URL needs a path: sqlite:///gateway.db")
        return StoreURL("sqlite", path)
    if url.startswith(("postgresql://", "postgres://")):
        return StoreURL("postgresql", url)
    raise StoreURLError(
        "store must be sqlite:///path.db, sqlite:////abs/path.db or postgresql://..."
    )
