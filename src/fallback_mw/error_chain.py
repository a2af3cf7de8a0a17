"""An error and those it was raised from or during (`__cause__`, else `__context__`), each
once: what the engines, the TLS reader, the frame clearer and the CLI look through for the
error that says what happened (an errno, an SSL error, a gateway frame). A leaf module."""

from __future__ import annotations

from collections.abc import Iterator


def error_chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
