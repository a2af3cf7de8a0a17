"""serve's connection transport that writes an answer's head with its body: one system
call, one TCP segment and one wakeup of the client where uvicorn makes two.

uvicorn (h11 and httptools alike) writes the status line and headers the moment the app
sends `http.response.start`, and the body at `http.response.body`: two writes a request
even when the app sends both in one step, as the gateway does for an answer it has read
(each write on loopback also runs the client's receive path and wakes it: about 10 µs of
system time per request, measured by benchmarks/syscalls.py). Here the first write after
a request head was parsed (`hold_next`) is held until the end of the event loop's step:
a write in the same step goes out with it, and otherwise it is written alone at the next
iteration of the loop, with every head held in the same iteration (`StepFlusher`: one
`call_soon` for all of them, not one a request). So a head whose body comes later (a
stream's first event) is written when it was before, within one loop iteration; the bytes
and their order are the same."""

from __future__ import annotations

import asyncio
from typing import Any, Final

from fallback_mw.python_class import python_class

# Above this, a body is written on its own after the head (as before) rather than copied
# into one buffer with it.
JOIN_LIMIT: Final = 64 * 1024


class StepFlusher:
    """The heads held in one iteration of a loop, written by one callback at the next."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._holding: list[HeadWithBody] = []

    def add(self, writes: HeadWithBody) -> None:
        if not self._holding:
            self.loop.call_soon(self._flush)
        self._holding.append(writes)

    def _flush(self) -> None:
        holding, self._holding = self._holding, []
        for writes in holding:
            writes.flush()  # nothing, when its body went out with it


@python_class  # forwards what it does not define (`__getattr__`): a Python class
class HeadWithBody:
    """The transport uvicorn's protocol and its cycles write through (everything but
    `write`, `writelines`, `close`, `abort` and `write_eof` is the transport's own)."""

    def __init__(self, transport: asyncio.Transport, flusher: StepFlusher) -> None:
        self._transport = transport
        self._flusher = flusher
        self._hold = False  # the next write is held (a request head was parsed)
        self._held: bytes | None = None
        # What uvicorn calls per request, bound here: no lookup through __getattr__.
        self.is_closing = transport.is_closing
        self.get_extra_info = transport.get_extra_info
        self.pause_reading = transport.pause_reading
        self.resume_reading = transport.resume_reading
        self.get_protocol = transport.get_protocol  # the head guard's, per request

    def hold_next(self) -> None:
        self._hold = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if len(data) <= JOIN_LIMIT:
                self._transport.write(held + data)
                return
            self._transport.write(held)
        elif self._hold and data:
            self._hold = False
            self._held = bytes(data)
            self._flusher.add(self)
            return
        self._transport.write(data)

    def writelines(self, lines: Any) -> None:
        self.flush()
        self._transport.writelines(lines)

    def flush(self) -> None:
        """Write what is held (end of the step, or before the connection is closed)."""
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():  # the client left: nothing to write to
                self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self.flush()
        self._transport.abort()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
