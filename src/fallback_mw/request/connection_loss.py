"""A server's word that a request's connection is gone, without a task reading `receive`.

ASGI says a disconnect only through `receive`, so an app that must notice one while it
waits for something else (the plan walker, during an upstream attempt) reads `receive` in
a task of its own: some 40k instructions a request once that task starts. `fallback-mw
serve` knows when a connection is lost (its protocol's `connection_lost`): it puts the
connection's `ConnectionLoss` in each request's scope under `SCOPE_KEY`, and the walker
adds its watch there instead of starting its watcher task. Any other server (or a host
that builds its own scope) has none, and the walker reads `receive` as before."""

from __future__ import annotations

from typing import Final, Protocol

SCOPE_KEY: Final = "fallback_mw.connection_loss"


class Listener(Protocol):
    def connection_lost(self) -> None: ...


class ConnectionLoss:
    """One connection's loss, told to the listeners of the request in flight on it (held
    as they are, no bound method of theirs: that would be a reference cycle per request)."""

    __slots__ = ("_listeners", "lost")

    def __init__(self) -> None:
        self.lost = False
        self._listeners: list[Listener] = []

    def add(self, listener: Listener) -> bool:
        """Call `listener.connection_lost()` once the connection is lost; False (and nothing
        kept) when it is lost already."""
        if self.lost:
            return False
        self._listeners.append(listener)
        return True

    def discard(self, listener: Listener) -> None:
        for index, found in enumerate(self._listeners):
            if found is listener:
                del self._listeners[index]
                return

    def connection_lost(self) -> None:
        """The server's call, once: every listener added, in order."""
        self.lost = True
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener.connection_lost()
