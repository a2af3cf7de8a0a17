"""The end of a long body or event, kept by the usage meter (request/usage.py). In a
module of its own: a subclass of a builtin type (bytearray) does not compile with mypyc,
and the meter does (scripts/compile.py)."""

from __future__ import annotations

TAIL = 64 * 1024  # the bytes of a long body or event the meter keeps


class Tail(bytearray):
    """The last TAIL bytes of what was added. Each byte is copied a bounded number of
    times: keeping the tail as one bytes object copied all TAIL of them again for every
    piece added, and an event stream of tiny `data:` lines in an event over json_cap (a
    few bytes each) cost 64 KiB of copying per line. A bytearray itself: every response's
    meter makes two, and most never hold a byte (no `__init__` of its own to run)."""

    __slots__ = ()

    def add(self, data: bytes | bytearray) -> None:
        self.extend(data)
        if len(self) > 2 * TAIL:
            self._trim(self)

    @staticmethod
    def _trim(buffer: bytearray) -> None:
        del buffer[: len(buffer) - TAIL]

    def read(self) -> bytes:
        return bytes(self[-TAIL:])
